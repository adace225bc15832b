"""Repro bundles: everything needed to re-run the failing step, in one file.

A bundle holds the offending batch, the pre-step state (model, optimizer(s),
GradScaler, RNG), the guard's configuration and the library versions. It is a
plain ``torch.save`` file of tensors and containers, read back **only** with
``torch.load(weights_only=True)``: a crafted file cannot run code, and a
truncated or foreign file raises :class:`BundleError` with a clear message.

Reproducing the failing step with your own model code::

    b = nanguard.load_bundle("nanguard_bundle.pt")
    model = MyModel();  opt = torch.optim.AdamW(model.parameters())
    b.load_into(model, opt)         # weights, buffers, optimizer state, RNG of the failing step's start
    loss = loss_fn(b.batch);  loss.backward()      # the same non-finite value, at the same op

``batch`` is what ``Guard.step`` was given (a list for micro-batches); under
``nanguard run`` it is the list of positional arguments of the outermost
module call of the failing step (the model's inputs: targets used only by the
loss outside the model are not in it).
"""
from __future__ import annotations

import os
import platform
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .._version import __version__
from ..core.jsonio import write_atomic
from .rng import restore_rng

FORMAT = "nanguard.bundle/1"
_REQUIRED = {"format": str, "step": int, "phase": str, "model_state": dict, "optimizer_states": list,
             "rng": dict, "config": dict, "versions": dict}


class BundleError(ValueError):
    """A file that is not a readable nanguard bundle."""


@dataclass
class Bundle:
    step: int
    phase: str
    batch: Any
    model_state: Dict[str, torch.Tensor]
    optimizer_states: List[Dict[str, Any]]
    scaler_state: Optional[Dict[str, Any]]
    rng: Dict[str, Any]
    config: Dict[str, Any] = field(default_factory=dict)
    versions: Dict[str, str] = field(default_factory=dict)
    event: Dict[str, Any] = field(default_factory=dict)

    def restore_rng(self) -> None:
        """Put the RNG back where it was at the start of the failing step."""
        restore_rng(self.rng)

    def state_for(self, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """``model_state`` for ``model`` (under ``nanguard run`` with several watched models the keys
        are prefixed ``"TypeName:"``; the prefix of ``model``'s type is taken off)."""
        prefix = type(model).__name__ + ":"
        if any(k.startswith(prefix) for k in self.model_state):
            return {k[len(prefix):]: v for k, v in self.model_state.items() if k.startswith(prefix)}
        return dict(self.model_state)

    def load_into(self, model: torch.nn.Module, optimizers: Any = (), scaler: Any = None,
                  rng: bool = True) -> None:
        """Put the failing step's starting state into your own objects: model weights and buffers,
        optimizer state(s) (in the order they were created), GradScaler and (``rng=True``) the RNG."""
        model.load_state_dict(self.state_for(model))
        opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers or ())
        if len(opts) > len(self.optimizer_states):
            raise BundleError(f"the bundle holds {len(self.optimizer_states)} optimizer state(s), "
                              f"{len(opts)} optimizer(s) given")
        for o, st in zip(opts, self.optimizer_states):
            o.load_state_dict(st)
        if scaler is not None and self.scaler_state:
            scaler.load_state_dict(self.scaler_state)
        if rng:
            self.restore_rng()


def versions() -> Dict[str, str]:
    return {"nanguard": __version__, "torch": str(torch.__version__), "python": platform.python_version(),
            "platform": platform.platform()}


def _plain(obj: Any, depth: int = 0) -> Any:
    """Keep what ``weights_only`` can load: tensors, numbers, strings, containers. Others -> repr."""
    if depth > 20:
        return repr(obj)[:200]
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if obj is None:
        return None
    for t in (bool, int, float, str):  # exact builtins: subclasses (TorchVersion...) would not load
        if isinstance(obj, t):
            return t(obj)
    if isinstance(obj, dict):
        return {(k if isinstance(k, (str, int)) else repr(k)): _plain(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v, depth + 1) for v in obj]
    if hasattr(obj, "__dict__"):
        return {"__type__": type(obj).__name__, **{k: _plain(v, depth + 1) for k, v in vars(obj).items()}}
    return repr(obj)[:200]


def save_bundle(path: str, *, step: int, phase: str, batch: Any, model_state: Dict[str, torch.Tensor],
                optimizer_states: List[Dict[str, Any]], scaler_state: Optional[Dict[str, Any]],
                rng: Dict[str, Any], config: Optional[Dict[str, Any]] = None,
                event: Optional[Dict[str, Any]] = None) -> str:
    """Write a bundle atomically and return its path."""
    data = {"format": FORMAT, "step": int(step), "phase": str(phase), "batch": _plain(batch),
            "model_state": {k: v.detach().to("cpu", copy=True) for k, v in model_state.items()},
            "optimizer_states": [_plain(s) for s in optimizer_states],
            "scaler_state": _plain(scaler_state), "rng": _plain(rng), "config": _plain(config or {}),
            "versions": versions(), "event": _plain(event or {})}
    return write_atomic(path, lambda tmp: torch.save(data, tmp))


def load_bundle(path: str) -> Bundle:
    """Read a bundle with ``torch.load(weights_only=True)``; raise :class:`BundleError` if it is not one."""
    if not os.path.isfile(path):
        raise BundleError(f"no bundle at {path}")
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error below says it all
            warnings.simplefilter("ignore")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, disallowed globals...
        raise BundleError(f"{path} is not a readable nanguard bundle ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path} is not a nanguard bundle (top level is {type(data).__name__})")
    if data.get("format") != FORMAT:
        raise BundleError(f"{path} is not a nanguard bundle (format {data.get('format')!r}, expected {FORMAT!r})")
    for k, t in _REQUIRED.items():
        if not isinstance(data.get(k), t):
            raise BundleError(f"{path}: field {k!r} is missing or not a {t.__name__}")
    if not all(isinstance(v, torch.Tensor) for v in data["model_state"].values()):
        raise BundleError(f"{path}: model_state must map names to tensors")
    if not isinstance(data["rng"].get("torch"), torch.Tensor):
        raise BundleError(f"{path}: rng state has no torch generator state")
    if not all(isinstance(o, dict) for o in data["optimizer_states"]):
        raise BundleError(f"{path}: optimizer_states must be a list of optimizer state dicts")
    if data.get("scaler_state") is not None and not isinstance(data["scaler_state"], dict):
        raise BundleError(f"{path}: scaler_state must be a dict or None")
    return Bundle(step=data["step"], phase=data["phase"], batch=data.get("batch"),
                  model_state=data["model_state"], optimizer_states=data["optimizer_states"],
                  scaler_state=data.get("scaler_state"), rng=data["rng"], config=data["config"],
                  versions=data["versions"], event=data.get("event") or {})


def default_bundle_path(report_path: Optional[str]) -> str:
    folder = os.path.dirname(os.path.abspath(report_path)) if report_path else os.getcwd()
    return os.path.join(folder, "nanguard_bundle.pt")

