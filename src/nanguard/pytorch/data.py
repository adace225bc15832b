"""DataLoader hooks: batches are data, and their rows have dataset indices.

:class:`DataHooks` wraps three methods of torch's DataLoader iterators (``_BaseDataLoaderIter``,
both the single-process and the worker-process kinds) while a zero-code run is installed:

* ``_next_index``: the sampler's indices of each batch, recorded in the main process (the index
  sampler feeds the workers: a worker only ever sees the indices it was sent). With workers, they
  are kept by task number (the batch's ``send_idx``) and matched with the task the iterator returns;
* ``__next__``: runs with the step tape's function mode paused (and the op recorder of a re-run,
  through the ``on_begin`` / ``on_end`` callbacks): a batch is data. Tensors that arrive from a
  worker process are rebuilt from shared memory by ``Tensor.set_``; that is not an op that made
  their values;
* ``_reset``: a new epoch (persistent workers included) forgets the previous epoch's indices.

After each batch, the batch's tensors whose first dimension is the number of indices are
registered: :meth:`DataHooks.rows_of` gives the dataset indices of a tensor's rows. Only map-style
datasets with automatic batching and in-order delivery have them (an ``IterableDataset`` has no
indices; ``in_order=False`` loses the order). A tensor derived from the batch (``xb.to(device)``)
is matched by its first dimension against the most recent batch.

Cost: three Python wrappers per batch, a dictionary entry per batch tensor; no tensor op.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.data import dataloader as _dl

from .detect import tensors_in

__all__ = ["DataHooks"]

_KEEP = 16  # batches whose tensors stay registered (weakly)


class DataHooks:
    def __init__(self, tape: Any = None, on_begin: Optional[Callable[[], None]] = None,
                 on_end: Optional[Callable[[], None]] = None) -> None:
        self.tape = tape                  # paused while a batch is fetched
        self.on_begin = on_begin          # before a fetch (the re-run child pauses its recorder)
        self.on_end = on_end              # after (even on StopIteration)
        self._rows: Dict[int, tuple] = {}        # id(tensor) -> (weakref, indices)
        self._order: List[int] = []
        self.last: Optional[List[int]] = None     # indices of the most recent batch
        self._orig: Dict[str, Any] = {}
        self._installed = False

    # ------------------------------------------------------------------ lookup
    def rows_of(self, t: torch.Tensor) -> Optional[List[int]]:
        """Dataset indices of the rows of ``t`` (a batch tensor, or one derived from the latest batch)."""
        r = self._rows.get(id(t))
        if r is not None and r[0]() is t:
            return r[1]
        last = self.last
        if last is not None and t.dim() >= 1 and t.shape[0] == len(last):
            return last
        return None

    @property
    def batch_size(self) -> Optional[int]:
        return len(self.last) if self.last is not None else None

    def _register(self, batch: Any, indices: Any) -> None:
        if not isinstance(indices, (list, tuple)) or not indices:
            return
        try:
            idx = [int(i) for i in indices]
        except (TypeError, ValueError):
            return
        self.last = idx
        for t in tensors_in(batch):
            if t.dim() >= 1 and t.shape[0] == len(idx):
                self._rows[id(t)] = (weakref.ref(t), idx)
                self._order.append(id(t))
        while len(self._order) > 4 * _KEEP:
            self._rows.pop(self._order.pop(0), None)

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        base = _dl._BaseDataLoaderIter
        orig_next, orig_index, orig_reset = base.__next__, base._next_index, base._reset
        self._orig = {"__next__": orig_next, "_next_index": orig_index, "_reset": orig_reset}
        hooks = self

        def _next_index(it):
            idx = orig_index(it)
            if _indexed(it):
                key = getattr(it, "_send_idx", None) if it._num_workers > 0 else None
                it.__dict__.setdefault("_nanguard_idx", {})[key] = idx
            return idx

        def _reset(it, *a, **k):
            it.__dict__["_nanguard_idx"] = {}
            return orig_reset(it, *a, **k)

        def __next__(it):
            paused = hooks.tape.pause() if hooks.tape is not None else False
            if hooks.on_begin is not None:
                hooks.on_begin()
            try:
                data = orig_next(it)
            finally:
                if hooks.on_end is not None:
                    hooks.on_end()
                if hooks.tape is not None:
                    hooks.tape.resume(paused)
            if _indexed(it):
                try:
                    table = it.__dict__.get("_nanguard_idx") or {}
                    key = (it._rcvd_idx - 1) if it._num_workers > 0 else None
                    hooks._register(data, table.pop(key, None))
                except Exception:
                    pass
            return data

        base.__next__, base._next_index, base._reset = __next__, _next_index, _reset

    def uninstall(self) -> None:
        if not self._installed:
            return
        self._installed = False
        base = _dl._BaseDataLoaderIter
        base.__next__ = self._orig["__next__"]
        base._next_index = self._orig["_next_index"]
        base._reset = self._orig["_reset"]


def _indexed(it: Any) -> bool:
    """Map-style dataset, automatic batching, in-order delivery: batch rows have dataset indices."""
    return (getattr(it, "_dataset_kind", None) == _dl._DatasetKind.Map and getattr(it, "_auto_collation", False)
            and getattr(it, "_in_order", True))
