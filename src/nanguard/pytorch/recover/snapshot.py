"""Rollback snapshots: CPU copies of the training state at one step boundary, and putting them back.

A snapshot holds CPU copies of every parameter, buffer and optimizer-state tensor,
plus the GradScaler state and the RNG state (torch CPU/CUDA, ``random``, numpy).
One snapshot costs ``sum(numel * element_size)`` of those tensors (e.g. a float32
model trained with Adam: 12 bytes per parameter; the report gives
``snapshot_bytes``); taking one is a device-to-host copy of that size.
:meth:`Snapshot.refill` copies a new state into an existing snapshot's tensors
(the per-step tier reuses its oldest one, so it allocates nothing).
Which snapshots are kept is the policy's (:mod:`nanguard.core.recovery.snapshots`).

A rollback restores model (parameters and buffers), optimizer state, GradScaler
and RNG, but keeps the current hyperparameters of every param group (``lr``,
momentum...), which belong to the LR scheduler: schedulers are never stepped or
rewound by nanguard.
"""
from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch

from ..gradscaler import scaler_enabled
from ..rng import capture_rng, restore_rng
from .loose import LooseTensors
from .state import tensors_finite


class Snapshot:
    """CPU copy of model(s), optimizer(s), GradScaler and RNG state at one step boundary."""

    def __init__(self, step: int, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any],
                 scaler: Any = None, loss: Optional[float] = None) -> None:
        self.step = step
        self.prev_loss = loss  # loss of the step before (a fallback when the history has no record)
        self.modules = [(id(m), {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()})
                        for m in modules]
        self.optimizers = [(id(o), _cpu_copy(o.state_dict())) for o in optimizers]
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None and scaler_enabled(scaler) else None
        self.rng = capture_rng(plain=False)
        self.nbytes = sum(_nbytes(d) for _, d in self.modules) + sum(_nbytes(d) for _, d in self.optimizers)
        self._finite: Optional[bool] = None

    def refill(self, step: int, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any],
               scaler: Any = None, loss: Optional[float] = None) -> bool:
        """Become the snapshot of ``step`` by copying into this snapshot's own tensors (no allocation).

        Used for the per-step tier, whose oldest snapshot is dropped anyway: the copy is the same
        bytes, minus a fresh allocation (and, with the default glibc allocator, its page faults) of
        the whole model + optimizer state every step. False (nothing usable left) when the
        structure changed (new optimizer state, other shapes): the caller takes a fresh one.
        """
        mods = [(id(m), m.state_dict()) for m in modules]
        opts = [(id(o), o.state_dict()) for o in optimizers]
        if [i for i, _ in mods] != [i for i, _ in self.modules] or \
                [i for i, _ in opts] != [i for i, _ in self.optimizers]:
            return False
        with torch.no_grad():
            if not all(_copy_into(dst, src) for (_, dst), (_, src) in zip(self.modules, mods)) or \
                    not all(_copy_into(dst, src) for (_, dst), (_, src) in zip(self.optimizers, opts)):
                return False
        self.step, self.prev_loss = step, loss
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None and scaler_enabled(scaler) else None
        self.rng = capture_rng(plain=False)
        self._finite = None
        return True

    def mark_finite(self) -> None:
        """It was just filled from a state that was checked finite (no second pass needed)."""
        self._finite = True

    def finite(self) -> bool:
        if self._finite is None:
            self._finite = tensors_finite(v for _, d in self.modules for v in d.values())
        return self._finite

    def restore_buffers(self, modules: Sequence[torch.nn.Module]) -> int:
        """Put the buffers (e.g. BatchNorm running statistics) back; returns how many were restored."""
        saved, n = dict(self.modules), 0
        with torch.no_grad():
            for m in modules:
                sd = saved.get(id(m))
                if sd is None or isinstance(m, LooseTensors):  # bare trained tensors: weights, not buffers
                    continue
                for name, b in m.named_buffers():
                    if name in sd and b is not None:
                        put_back(b, sd[name])
                        n += 1
        return n

    def repair_nonfinite(self, modules: Sequence[torch.nn.Module]) -> int:
        """Put back only the non-finite elements of the parameters/buffers (from this snapshot); returns
        how many elements were restored, or -1 when a non-finite element has no finite saved value."""
        saved, n = dict(self.modules), 0
        plan = []
        for m in modules:
            sd = saved.get(id(m))
            if sd is None:
                continue
            own = m.state_dict(keep_vars=True)
            for k, t in own.items():
                t = t.data if isinstance(t, torch.nn.Parameter) else t
                if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.device.type == "meta":
                    continue
                bad = ~torch.isfinite(t)
                if not bool(bad.any()):
                    continue
                v = sd.get(k)
                if v is None or v.shape != t.shape:
                    return -1
                v = v.to(t.device, t.dtype)
                if not bool(torch.isfinite(v[bad]).all()):
                    return -1
                plan.append((t, bad, v))
        with torch.no_grad():
            for t, bad, v in plan:
                t[bad] = v[bad]
                n += int(bad.sum())
        return n

    def restore(self, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any], scaler: Any = None) -> None:
        """Put everything back exactly as it was (optimizer hyperparameters excepted, see module doc)."""
        saved = dict(self.modules)
        with torch.no_grad():
            for m in modules:
                sd = saved.get(id(m))
                if sd is None:
                    continue
                own = m.state_dict(keep_vars=True)
                for k, v in sd.items():
                    if k in own:
                        t = own[k]
                        t = t.data if isinstance(t, torch.nn.Parameter) else t
                        t.copy_(v.to(t.device, t.dtype))
        saved_o = dict(self.optimizers)
        for o in optimizers:
            sd = saved_o.get(id(o))
            if sd is None:
                continue
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
            o.load_state_dict(_clone(sd))  # a copy: load_state_dict may alias the tensors it is given
            for g, h in zip(o.param_groups, hyper):  # the scheduler's (and lr_backoff's) hyperparameters
                g.update(h)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        restore_rng(self.rng)


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _copy_into(dst: Any, src: Any) -> bool:
    """Copy ``src`` (a state dict) into the same-shaped ``dst`` in place; False on any mismatch
    (``dst`` is then partly overwritten and must be dropped)."""
    if isinstance(src, torch.Tensor):
        if not isinstance(dst, torch.Tensor) or dst.shape != src.shape or dst.dtype != src.dtype:
            return False
        dst.copy_(src.detach())
        return True
    if isinstance(src, dict):
        if not isinstance(dst, dict) or dst.keys() != src.keys():
            return False
        for k, v in src.items():
            if isinstance(v, (torch.Tensor, dict, list, tuple)):
                if not _copy_into(dst[k], v):
                    return False
            else:
                dst[k] = copy.deepcopy(v)
        return True
    if isinstance(src, list):
        if not isinstance(dst, list) or len(dst) != len(src):
            return False
        for i, v in enumerate(src):
            if isinstance(v, (torch.Tensor, dict, list, tuple)):
                if not _copy_into(dst[i], v):
                    return False
            else:
                dst[i] = copy.deepcopy(v)
        return True
    if isinstance(src, tuple):  # immutable: only tensors inside can be refilled
        return isinstance(dst, tuple) and len(dst) == len(src) and all(
            _copy_into(d, v) if isinstance(v, (torch.Tensor, dict, list, tuple)) else d == v
            for d, v in zip(dst, src))
    return dst == src


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def put_back(buf: torch.Tensor, value: torch.Tensor) -> None:
    """Give a buffer back its saved values without an in-place write a live autograd graph would see:
    BatchNorm saves its running statistics for its backward, and a GAN's generator graph, built before the
    discriminator's skipped step, is still to be differentiated (``copy_`` bumps their version, and that
    backward raises "modified by an inplace operation"). The values are swapped in under the same tensor
    (``.data``, no version bump); an unchanged buffer is left alone."""
    v = value.to(buf.device, buf.dtype)
    if not torch.equal(buf, v):
        buf.data = v.clone() if v is value else v
