"""Sync-free reads: a check's vector is copied to host memory without waiting, and read later.

Each sync-free check (:meth:`~nanguard.pytorch.detect.StepMonitor.check_lazy`) hands its
vector to :class:`LazyReads`, which copies it into a host "mailbox" slot: on CUDA a
pinned buffer filled by a ``non_blocking`` copy on the current stream, with a CUDA event
recorded after it; on CPU a plain buffer (the copy is done when it returns). The values
are read through a ``ctypes`` view of the slot's memory, i.e. from host memory, never by
a torch read of a device tensor (``item``/``tolist``/``.cpu()``), so reading a completed
slot is not a host-device synchronization.

When values are read (:meth:`LazyReads.ready`):

* CUDA, one process: at every step, the oldest slots whose event has completed
  (``Event.query()``, which does not block): the host reads a step's flags as soon as
  the GPU has produced them, typically one or two steps later; when the host has
  synchronized anyway (a ``loss.item()`` in the user's loop) everything is ready.
* at the latest ``every`` steps after a check (``force``: ``Event.synchronize()`` on an
  event that is usually long complete). On CPU (no asynchrony to wait for) and under
  torch.distributed (every rank must read the same steps at the same time, since the
  slow path is a collective) this fixed schedule is the only one: on CPU it stands in
  for the GPU's latency, so the late-read path (the rewind) is exercised in tests.

Cost per step: one small device-to-host copy (a few dozen floats) and, on CUDA, one
event record and a few event queries. Memory: ``every + 1`` slots.
"""
from __future__ import annotations

import ctypes
from collections import deque
from typing import Any, Deque, List, Optional, Tuple

import torch


class _Slot:
    __slots__ = ("buf", "view", "event", "n")

    def __init__(self, n: int, pinned: bool) -> None:
        self.buf = torch.empty(max(n, 16), dtype=torch.float64, pin_memory=pinned)
        # host memory, read as plain C doubles: not a torch read of a tensor
        self.view = (ctypes.c_double * self.buf.numel()).from_address(self.buf.data_ptr())
        self.event: Any = None
        self.n = 0


class LazyReads:
    """The pending sync-free checks of one monitor, in step order, and their host mailboxes."""

    def __init__(self, every: int = 8, opportunistic: Optional[bool] = None) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.every = every
        self.opportunistic = opportunistic  # None: on CUDA, when not distributed
        self.queue: Deque[Tuple[Any, _Slot]] = deque()
        self._free: List[_Slot] = []
        self.reads = 0       # reads done (each may cover several steps)
        self.forced = 0      # of them, reads that had to wait (Event.synchronize) on CUDA

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, pending: Any, vec: torch.Tensor) -> None:
        """Start the copy of ``vec`` (1-d, on the device) to a host slot; read it later."""
        cuda = vec.device.type == "cuda"
        slot = self._slot(vec.numel(), cuda)
        n = vec.numel()
        src = vec.detach().reshape(-1).to(torch.float64)  # float64 holds every dtype's finiteness
        slot.buf[:n].copy_(src, non_blocking=cuda)
        slot.n = n
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            slot.event = ev
        else:
            slot.event = None
        self.queue.append((pending, slot))

    def _slot(self, n: int, pinned: bool) -> _Slot:
        for i, s in enumerate(self._free):
            if s.buf.numel() >= n and s.buf.is_pinned() == pinned:
                return self._free.pop(i)
        return _Slot(max(n, 2 * n if n > 16 else 16), pinned)

    def due(self, distributed: bool = False) -> bool:
        """Whether the oldest check must be read now (``every`` checks are pending), or (CUDA, one
        process) some completed check can be read without waiting."""
        if not self.queue:
            return False
        if len(self.queue) >= self.every:
            return True
        opp = self.opportunistic
        if opp is None:
            opp = not distributed
        if not opp:
            return False
        ev = self.queue[0][1].event
        return ev is not None and ev.query()

    def ready(self, force: bool = False) -> List[Tuple[Any, List[float]]]:
        """The checks that can be read now, in order, with their values (``force``: all of them)."""
        out: List[Tuple[Any, List[float]]] = []
        while self.queue:
            pending, slot = self.queue[0]
            ev = slot.event
            if ev is not None and not ev.query():
                if not force:
                    break
                ev.synchronize()
                self.forced += 1
            self.queue.popleft()
            out.append((pending, slot.view[:slot.n]))
            slot.event = None
            self._free.append(slot)
        if out:
            self.reads += 1
        return out

    def drop(self) -> List[Any]:
        """Forget every pending check (after a rewind: they describe steps that are re-run)."""
        dropped = [p for p, _ in self.queue]
        while self.queue:
            _, slot = self.queue.popleft()
            if slot.event is not None:
                slot.event.synchronize()  # the copy must land before the slot is reused
                slot.event = None
            self._free.append(slot)
        return dropped
