"""Sync-free mode: keep a flagged step's update out of the weights on the device, with no host read.

:class:`UpdateGate` holds one 0-d float32 device flag, ``tripped``: the MAX of the failure
flags (:func:`~nanguard.pytorch.detect.gather.failure_flag`) of every check since the
host last read them. It is sticky: once a step is flagged, every later update is kept out
too, until the host reads the flags and rewinds (the weights then still hold the state
from before the first flagged step, which is what the replay, the report and recovery
need). How an update is kept out depends on the optimizer:

* ``found_inf`` (fused ``Adam``, ``AdamW``, ``SGD``, ``Adagrad``: ``fused=True``, the
  optimizers with ``_step_supports_amp_scaling``): the flag is passed as the optimizer's
  ``found_inf``; the fused kernel then leaves parameters and state untouched (the step
  counters are put back). Cost: nothing. With ``found_inf`` = 0 the update is bit-for-bit
  the same as without it.
* ``scaler`` (a GradScaler is used): the flag is merged (MAX) into the scaler's own
  ``found_inf`` for the optimizer, so the scaler skips the step (and backs off its scale;
  the rewind puts the scale back). A non-fused optimizer under a GradScaler keeps the
  scaler's own sync (``found_inf.item()``), which PyTorch makes anyway.
* ``masked`` (every other optimizer): before the update, the parameters that have a
  gradient and their optimizer state on the flag's device are copied to shadow tensors
  (allocated once); after it, ``torch.where(tripped, shadow, live, out=live)`` puts them
  back when the flag is set. Cost per step: one copy and one ``where`` over the parameters
  and their state (3x the parameter bytes read+written twice for Adam-like optimizers),
  and one extra copy of them in device memory. Optimizer state on another device (the
  CPU step counters of a non-capturable Adam on CUDA) is saved at each step's start by
  the driver (:meth:`UpdateGate.host_state`) and put back at the rewind.

A step in which an optimizer creates per-parameter state for the first time (its first
step, or a parameter that gets its first gradient) is read at once by the driver instead
(one sync): a skipped first step can leave freshly allocated, uninitialised state (fused
SGD's momentum buffer) that no mask can undo.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..buffers import BufferCache
from ..gradscaler import scaler_enabled
from .tensors import local, locals_of


_TENSOR = torch.Tensor  # a plain tensor is its own local shard: local() not called for it


def gate_kind(opt: Any, scaler: Any = None) -> str:
    """How ``opt``'s update is kept out: ``"scaler"``, ``"found_inf"`` or ``"masked"``."""
    if scaler is not None and scaler_enabled(scaler):
        return "scaler"
    if getattr(opt, "_step_supports_amp_scaling", False) and all(
            g.get("fused") for g in getattr(opt, "param_groups", [{}])):
        return "found_inf"
    return "masked"


class UpdateGate:
    """The sticky device flag of the pending sync-free checks, and how it keeps updates out."""

    def __init__(self) -> None:
        self.tripped: Optional[torch.Tensor] = None
        self._shadow: Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}  # opt -> (live, shadow)
        self._armed: List[Any] = []

    def flag(self, dev: torch.device) -> torch.Tensor:
        if self.tripped is None or self.tripped.device != dev:
            self.tripped = torch.zeros((), dtype=torch.float32, device=dev)
        return self.tripped

    def trip(self, bad: torch.Tensor) -> torch.Tensor:
        """``tripped = max(tripped, bad)`` on the device; returns the flag."""
        t = self.flag(bad.device)
        torch.maximum(t, bad.reshape(()).to(t.dtype), out=t)
        return t

    def reset(self) -> None:
        if self.tripped is not None:
            self.tripped.zero_()

    # ------------------------------------------------------------------ around the update
    def before_update(self, opt: Any, scaler: Any = None) -> str:
        """Arm ``opt``'s next update with the flag. Returns the kind used."""
        kind = gate_kind(opt, scaler)
        t = self.tripped
        if t is None:
            return kind
        if kind == "scaler":
            st = scaler._per_optimizer_states[id(opt)].get("found_inf_per_device") or {}
            for v in st.values():
                torch.maximum(v, t.to(v.device, v.dtype).reshape(v.shape), out=v)
        elif kind == "found_inf":
            opt.found_inf = t
            self._armed.append(opt)
        else:
            live, shadow = self._tensors(opt, t.device)
            if live:
                with torch.no_grad():
                    torch._foreach_copy_(shadow, live)
        return kind

    def after_update(self, opt: Any, kind: str) -> None:
        """Undo the flagged update (masked), disarm (found_inf)."""
        t = self.tripped
        if t is None:
            return
        if kind == "found_inf":
            if opt in self._armed:
                self._armed.remove(opt)
                try:
                    del opt.found_inf
                except AttributeError:
                    pass
        elif kind == "masked":
            live, shadow = self._shadow.get(id(opt), ([], []))
            cond = t.bool()
            with torch.no_grad():
                for a, s in zip(live, shadow):
                    torch.where(cond, s, a, out=a)

    def _tensors(self, opt: Any, dev: torch.device) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The live tensors the masked update guards (parameters with a gradient and their state on
        ``dev``), as local shards, with their shadows (reused while the set is unchanged)."""
        tensor = torch.Tensor
        # one comprehension, no per-tensor Python frame: this runs on every step (the state by id:
        # opt.state.get(p) would call Tensor.__hash__, a Python function, once per parameter)
        state = {id(p): st for p, st in opt.state.items()}
        cand = locals_of([t for g in opt.param_groups for p in g["params"] if p.grad is not None
                          for t in (p, *(state.get(id(p)) or {}).values()) if isinstance(t, tensor)])
        live = [t for t in cand if t.device == dev and t.numel() and (t.is_floating_point() or t.is_complex())]
        old = self._shadow.get(id(opt))
        if old is not None and len(old[0]) == len(live) and all(map(operator.is_, old[0], live)):
            return old
        shadow = [torch.empty_like(t) for t in live]
        self._shadow[id(opt)] = (live, shadow)
        return live, shadow

    # ------------------------------------------------------------------ state on other devices
    @staticmethod
    def host_state(optimizers: Sequence[Any], dev: torch.device) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the optimizer state tensors that live on another device than the flag (CPU step
        counters of a CUDA run): the masked update cannot put them back without a read, the rewind
        does (:func:`restore_host_state`). Empty on a CPU run."""
        out = []
        for o in optimizers:
            for st in o.state.values():
                for v in (st.values() if isinstance(st, dict) else ()):
                    if isinstance(v, torch.Tensor) and (v if type(v) is _TENSOR else local(v)).device != dev:
                        out.append((v, v.detach().clone()))
        return out


def restore_host_state(saved: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for live, copy in saved:
            live.copy_(copy)


class BufferLatch:
    """The buffers (BatchNorm statistics and counters...) as they were at the start of the first flagged
    step since the last read: a forward updates them whatever the gate does, so the rewind puts them
    back from here. One ``where`` per buffer per step (version counters cannot tell: the batch-norm
    kernel writes its running statistics without bumping them)."""

    def __init__(self) -> None:
        self._saved: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (buffer, copy)
        self._bufs = BufferCache()  # each step: the buffers listed without walking the module tree

    def latch(self, modules: Sequence[torch.nn.Module], tripped: Optional[torch.Tensor]) -> None:
        bufs = [b for m in modules for _, b in self._bufs.named(m)]  # integer ones too (num_batches_tracked)
        if not bufs:
            return
        with torch.no_grad():
            for b in bufs:
                if not b.numel():
                    continue
                got = self._saved.get(id(b))
                if got is None or got[0] is not b or got[1].shape != b.shape:
                    self._saved[id(b)] = (b, b.detach().clone())
                elif tripped is None:
                    got[1].copy_(b)
                else:
                    torch.where(tripped.to(b.device).bool(), got[1], b, out=got[1])

    def restore(self) -> int:
        with torch.no_grad():
            for b, saved in self._saved.values():
                b.copy_(saved)
        return len(self._saved)
