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

import copy
import os
import platform
import random
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
        optimizer state(s) (in the order they were created), GradScaler and (``rng=True``) the RNG.

        Everything is checked first (the model's names, shapes and dtypes, each optimizer state's
        structure against its optimizer, the scaler's and the RNG's states): a bundle that does not fit
        raises :class:`BundleError` and leaves the model, the optimizers, the scaler and the RNG as they were."""
        opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers or ())
        state = self.state_for(model)
        _check_model_state(state, model)
        if len(opts) > len(self.optimizer_states):
            raise BundleError(f"the bundle holds {len(self.optimizer_states)} optimizer state(s), "
                              f"{len(opts)} optimizer(s) given")
        for i, (o, st) in enumerate(zip(opts, self.optimizer_states)):
            _check_optimizer_state(st, o, i)
        use_scaler = scaler is not None and bool(self.scaler_state)
        if use_scaler:
            _check_scaler_state(self.scaler_state)
        if rng:
            _check_rng(self.rng)
        # what the checks cannot know (an optimizer class's own required keys) fails inside its
        # load_state_dict: the load is all or nothing, the state before it put back on any error
        before = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                  [copy.deepcopy(o.state_dict()) for o in opts],
                  copy.deepcopy(scaler.state_dict()) if use_scaler else None)
        try:
            model.load_state_dict(state)
            for o, st in zip(opts, self.optimizer_states):
                o.load_state_dict(st)
            if use_scaler:
                scaler.load_state_dict(self.scaler_state)
        except Exception as e:
            model.load_state_dict(before[0])
            for o, st in zip(opts, before[1]):
                o.load_state_dict(st)
            if use_scaler:
                scaler.load_state_dict(before[2])
            raise BundleError(f"the bundle does not load into these objects: {type(e).__name__}: {e}"[:300]) from None
        if rng:
            self.restore_rng()


def _check_model_state(state: Dict[str, Any], model: torch.nn.Module) -> None:
    """The bundle's model state fits ``model`` exactly: the same names, shapes, dtypes and layouts."""
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        bits = ([f"missing {missing[:5]}"] if missing else []) + ([f"unexpected {extra[:5]}"] if extra else [])
        raise BundleError(f"the bundle's model state does not fit {type(model).__name__}: {'; '.join(bits)}")
    for k, v in state.items():
        t = own[k]
        if not isinstance(v, torch.Tensor):
            raise BundleError(f"model state {k!r} is a {type(v).__name__}, not a tensor")
        if not isinstance(t, torch.Tensor):
            continue  # extra state a module serialises itself
        if v.layout != t.layout or v.dtype != t.dtype or tuple(v.shape) != tuple(t.shape):
            raise BundleError(f"model state {k!r} is {v.dtype} {tuple(v.shape)} ({v.layout}) in the bundle, "
                              f"{t.dtype} {tuple(t.shape)} ({t.layout}) in the model")


_NUMBER = (int, float)


def _fits(saved: Any, live: Any) -> bool:
    """A saved hyperparameter can stand in for the live one: numbers for numbers (a tensor learning
    rate too), sequences of the same length, None/str/bool like for like."""
    if isinstance(live, bool) or isinstance(saved, bool):
        return saved is None or (isinstance(saved, bool) and isinstance(live, bool))
    if isinstance(live, (_NUMBER, torch.Tensor)):
        return isinstance(saved, _NUMBER) or (isinstance(saved, torch.Tensor) and saved.numel() == 1
                                                and not saved.is_complex())
    if isinstance(live, (list, tuple)):
        return isinstance(saved, (list, tuple)) and len(saved) == len(live) and all(
            _fits(a, b) for a, b in zip(saved, live))
    if live is None:
        return saved is None or isinstance(saved, (_NUMBER, str))
    return saved is None or type(saved) is type(live) or isinstance(saved, type(live))


def _check_optimizer_state(st: Any, opt: Any, i: int) -> None:
    """``st`` is a state dict ``opt.load_state_dict`` takes as it is, with nothing of the wrong kind in it."""
    where = f"optimizer state {i} ({type(opt).__name__})"
    if not isinstance(st, dict) or not isinstance(st.get("state"), dict) or not isinstance(st.get("param_groups"), list):
        raise BundleError(f"{where}: not an optimizer state dict ('state' and 'param_groups')")
    groups, live = st["param_groups"], opt.param_groups
    if len(groups) != len(live):
        raise BundleError(f"{where}: {len(groups)} parameter group(s) in the bundle, {len(live)} in the optimizer")
    ids: Dict[int, torch.Tensor] = {}
    for g, lg in zip(groups, live):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise BundleError(f"{where}: a parameter group without its 'params' list")
        if len(g["params"]) != len(lg["params"]):
            raise BundleError(f"{where}: a group of {len(g['params'])} parameters in the bundle, "
                              f"{len(lg['params'])} in the optimizer")
        for pid, p in zip(g["params"], lg["params"]):
            if isinstance(pid, bool) or not isinstance(pid, (int, str)) or pid in ids:
                raise BundleError(f"{where}: parameter ids must be distinct integers (or names)")
            ids[pid] = p
        for k, v in g.items():
            if k != "params" and k in lg and not _fits(v, lg[k]):
                raise BundleError(f"{where}: hyperparameter {k!r} is {type(v).__name__} {str(v)[:40]!r}, "
                                  f"the optimizer's is {type(lg[k]).__name__}")
    for pid, ps in st["state"].items():
        if pid not in ids:
            raise BundleError(f"{where}: state for parameter id {pid!r}, which no group holds")
        if not isinstance(ps, dict) or not all(isinstance(k, str) for k in ps):
            raise BundleError(f"{where}: the state of parameter {pid!r} is not a dict of named values")
        p = ids[pid]
        for k, v in ps.items():
            if isinstance(v, torch.Tensor):
                if v.layout != torch.strided or v.is_complex() != p.is_complex() and v.numel() > 1:
                    raise BundleError(f"{where}: state {k!r} of parameter {pid!r} is a {v.dtype} {v.layout} "
                                      f"tensor, which does not fit a {p.dtype} parameter")
            elif not (v is None or isinstance(v, (bool, int, float, str))):
                raise BundleError(f"{where}: state {k!r} of parameter {pid!r} is a {type(v).__name__}")


_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _check_scaler_state(st: Any) -> None:
    if not isinstance(st, dict):
        raise BundleError("the GradScaler state is not a dict")
    for k in _SCALER_KEYS:
        v = st.get(k)
        if isinstance(v, bool) or not isinstance(v, _NUMBER) or not (v == v):
            raise BundleError(f"the GradScaler state's {k!r} is {v!r}, not a number")


def _check_rng(st: Any) -> None:
    """Each RNG state has the type and size its generator takes."""
    t = st.get("torch") if isinstance(st, dict) else None
    cur = torch.get_rng_state()
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.shape != cur.shape:
        raise BundleError(f"the bundle's torch RNG state is not a uint8 tensor of {cur.numel()} bytes")
    r = st.get("random")
    if r is not None:
        ok = isinstance(r, (list, tuple)) and len(r) == 3 and isinstance(r[1], (list, tuple))
        if ok:
            try:
                state = random.getstate()
                random.setstate((r[0], tuple(r[1]), r[2]))  # checked by the generator itself, then put back
                random.setstate(state)
            except (TypeError, ValueError, OverflowError):
                ok = False
        if not ok:
            raise BundleError("the bundle's Python RNG state is not one random.setstate takes")
    cuda = st.get("cuda")
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(
            isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda)):
        raise BundleError("the bundle's CUDA RNG states are not uint8 tensors")
    n = st.get("numpy")
    if n is not None:
        ok = isinstance(n, (list, tuple)) and len(n) == 5 and isinstance(n[0], str)
        keys = n[1] if ok else None
        if isinstance(keys, torch.Tensor):
            ok = keys.dim() == 1 and keys.numel() == 624 and not keys.is_floating_point()
        elif ok:
            ok = hasattr(keys, "__len__") and len(keys) == 624  # native form
        if not ok:
            raise BundleError("the bundle's numpy RNG state is not an MT19937 state")


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
    return write_atomic(path, lambda tmp: torch.save(data, tmp), ".pt.tmp", kind="bundle")


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
    """The run's own bundle, beside its report: ``run/r.json`` -> ``run/r.bundle.pt`` (runs with different
    reports never share a bundle); ``./nanguard_bundle.pt`` when there is no report."""
    if not report_path:
        return os.path.join(os.getcwd(), "nanguard_bundle.pt")
    root, ext = os.path.splitext(os.path.abspath(report_path))
    return (root if ext.lower() == ".json" else root + ext) + ".bundle.pt"
