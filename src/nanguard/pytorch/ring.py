"""The last steps a :class:`~nanguard.Guard` can run again: their batches, RNG and hyperparameters.

The Guard holds each step's function, batch and RNG state anyway (for the in-process
replay). :class:`StepRing` keeps them for the last few steps, which lets it:

* **rewind** (sync-free mode): the flags of step ``f`` are read a few steps later; the
  weights still hold the state before ``f`` (the update gate kept every update since
  out), so the guard goes back to ``f``, handles the failure as a synchronous check
  would, and runs the masked steps ``f+1..t`` again from their entries;
* **replay forward** (recovery): a rollback to a step between two real snapshots
  restores the earlier snapshot and re-runs the steps in between from their entries
  (:class:`~nanguard.pytorch.recover.snapshot.VirtualSnapshot`), so the state is exactly
  the one at that step without copying the whole state every step.

An entry keeps references to the batch tensors (no copy) with their version counters:
a batch the loop later overwrites in place (a reused buffer) is detected
(:meth:`StepEntry.intact`) and that entry is not replayed. Memory: the batches of the
last ``maxlen`` steps stay alive.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from .detect.tensors import all_tensors

from .numerics import version



@dataclass
class StepEntry:
    step: int
    batches: List[Any]
    loss_fn: Callable[[Any], torch.Tensor]
    rng: Dict[str, Any]
    hyper: List[List[Dict[str, Any]]]             # per optimizer, per param group (no "params")
    scaler: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # GradScaler scale, growth tracker
    host: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # see gate.host_state
    versions: List[Tuple[torch.Tensor, int]] = field(default_factory=list)
    loss: Optional[torch.Tensor] = None            # the loss this step returned (detached)
    nbytes: int = 0                                # bytes of the batch tensors it keeps alive

    def intact(self) -> bool:
        """No batch tensor was written in place since the step ran."""
        return all(version(t) == v for t, v in self.versions)


def hyperparameters(optimizers) -> List[List[Dict[str, Any]]]:
    """Per optimizer, per param group: the group's entries but ``params`` (loops: it runs every step)."""
    out = []
    for o in optimizers:
        hs = []
        for g in o.param_groups:
            h = dict(g)
            h.pop("params", None)
            hs.append(h)
        out.append(hs)
    return out


def set_hyperparameters(optimizers, hyper: List[List[Dict[str, Any]]], lr_ratio=None) -> None:
    """Put ``hyper`` back into the optimizers' param groups (``lr_ratio[o][g]`` scales the lr)."""
    for oi, (o, hs) in enumerate(zip(optimizers, hyper)):
        for gi, (g, h) in enumerate(zip(o.param_groups, hs)):
            g.update(h)
            if lr_ratio is not None and "lr" in h and not isinstance(h["lr"], torch.Tensor):
                g["lr"] = h["lr"] * lr_ratio[oi][gi]


def scaler_state(scaler) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """A GradScaler's scale and growth tracker as device clones (no host read)."""
    s, t = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if isinstance(s, torch.Tensor) and isinstance(t, torch.Tensor):
        return s.detach().clone(), t.detach().clone()
    return None


def restore_scaler_state(scaler, st: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    if st is None:
        return
    with torch.no_grad():
        scaler._scale.copy_(st[0])
        scaler._growth_tracker.copy_(st[1])
    try:
        scaler._per_optimizer_states.clear()
    except Exception:
        pass


class StepRing:
    """The entries of the last ``maxlen`` steps, oldest first; beyond ``keep`` entries, older ones go
    when the batches held exceed ``max_bytes``."""

    def __init__(self, maxlen: int, keep: Optional[int] = None, max_bytes: int = 256 << 20) -> None:
        self.entries: Deque[StepEntry] = deque(maxlen=max(1, maxlen))
        self.keep = keep if keep is not None else maxlen
        self.max_bytes = max_bytes

    @property
    def maxlen(self) -> int:
        return self.entries.maxlen or 1

    def resize(self, maxlen: int) -> None:
        if maxlen != self.maxlen:
            self.entries = deque(self.entries, maxlen=max(1, maxlen))

    def record(self, step: int, batches: List[Any], loss_fn, rng, optimizers, scaler=None,
               host=None) -> StepEntry:
        ts = all_tensors(batches, 256)
        versions, nbytes = [], 0
        for t in ts:  # (a loop: no comprehension or generator frame every step)
            try:
                v = t._version
            except Exception:  # inference tensors have no version counter (numerics.version)
                v = None
            versions.append((t, v))
            nbytes += t.numel() * t.element_size()
        e = StepEntry(step=step, batches=list(batches), loss_fn=loss_fn, rng=rng,
                      hyper=hyperparameters(optimizers),
                      scaler=scaler_state(scaler) if scaler is not None else None,
                      host=list(host or []), versions=versions, nbytes=nbytes)
        while self.entries and self.entries[-1].step >= step:  # a step run again replaces its entry
            self.entries.pop()
        self.entries.append(e)
        if len(self.entries) > self.keep:
            held = sum(x.nbytes for x in self.entries)
            while len(self.entries) > self.keep and held > self.max_bytes:
                held -= self.entries.popleft().nbytes
        return e

    def get(self, step: int) -> Optional[StepEntry]:
        return next((e for e in self.entries if e.step == step), None)

    def since(self, step: int) -> List[StepEntry]:
        return [e for e in self.entries if e.step >= step]

    def between(self, start: int, stop: int) -> Optional[List[StepEntry]]:
        """The entries of steps ``start .. stop-1``, when every one is held and intact."""
        want = [e for e in self.entries if start <= e.step < stop]
        if len(want) != stop - start or any(not e.intact() for e in want):
            return None
        return want

    def truncate(self, step: int) -> None:
        """Drop the entries of ``step`` and after."""
        while self.entries and self.entries[-1].step >= step:
            self.entries.pop()

    def clear(self) -> None:
        self.entries.clear()


