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

Quarantine (recovery): dataset rows a drop-samples replay proved bad (:meth:`DataHooks.exclude`; rows of
the dataset of the most recent batch, the failing one) are taken out of every later batch's indices from
that dataset in ``_next_index``, before the dataset is read (a batch of nothing but excluded rows is passed
over for the next one), and ``on_filter(rows)`` says so each time. Other datasets (an evaluation set's
row of the same index) are left alone.

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

from .detect.tensors import all_tensors, leaves
from .rng import capture_rng, restore_rng


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
        self._step_rows: List[List[int]] = []     # the batches module calls took since the step began
        self._orig: Dict[str, Any] = {}
        self._installed = False
        self.excluded: Dict[int, tuple] = {}      # id(dataset) -> (its weakref, the rows kept out of its batches)
        self._source: Any = None                  # a weakref to the dataset of the most recent batch
        self.on_filter: Optional[Callable[[List[int]], None]] = None  # told each time rows are taken out
        self._collate: Any = None                 # the collate_fn of the most recent batch's loader

    # ------------------------------------------------------------------ quarantine
    def exclude(self, rows: List[int], on_filter: Optional[Callable[[List[int]], None]] = None) -> Optional[Dict[str, Any]]:
        """Keep ``rows`` of the most recent batch's dataset out of every later batch from it;
        ``on_filter(rows)`` is called each time some are taken out of one. None: no batch came from a
        DataLoader with dataset indices."""
        ds = self._source() if self._source is not None else None
        if ds is None:
            return None
        ref, have = self.excluded.setdefault(id(ds), (self._source, set()))
        have.update(int(r) for r in rows)
        if on_filter is not None:
            self.on_filter = on_filter
        return {"rows": sorted(int(r) for r in rows), "dataset": type(ds).__name__,
                "how": "taken out of each later batch's sampler indices before the dataset is read"}

    def _filtered(self, it: Any, idx: Any, fetch: Callable[[], Any]) -> Any:
        """``idx`` without the rows excluded from ``it``'s dataset (a batch of nothing else: the next
        batch's); ``fetch`` draws the next batch's indices (its StopIteration ends the epoch)."""
        ds = getattr(it, "_dataset", None)
        ref, bad = self.excluded.get(id(ds), (None, None))
        if ref is None or ref() is not ds:
            return idx
        while isinstance(idx, list) and idx:
            try:
                out = [i for i in idx if int(i) not in bad]
            except (TypeError, ValueError):
                return idx
            if len(out) == len(idx):
                return idx
            if self.on_filter is not None:
                try:
                    self.on_filter([int(i) for i in idx if int(i) in bad])
                except Exception:  # the record never stops the run
                    pass
            if out:
                return out
            idx = fetch()
        return idx

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

    def used(self, args: tuple) -> None:
        """A module call takes ``args``: the batch its tensors came in is the step's (``last``), also when the
        loader has fetched the next one already (accelerate's ``DataLoaderShard`` fetches one batch ahead)."""
        rows = self._rows
        if not rows:
            return
        for t in all_tensors(args):
            r = rows.get(id(t))
            if r is not None and r[0]() is t:
                self.last = r[1]
                if not self._step_rows or self._step_rows[-1] is not r[1]:
                    self._step_rows.append(r[1])
                return

    def reread(self, rows: List[int]) -> Optional[Dict[str, Any]]:
        """After a failure: read the dataset items of ``rows`` (of the most recent batch's dataset) again. When
        every one holds floating values and all are finite, the NaN was made after the dataset, as the batch
        was assembled: ``{"rows": ..., "collate_fn": its name when the loader has one of the script's}``. None
        otherwise (an item with no floating array, a non-finite one, a dataset that cannot be indexed)."""
        ds = self._source() if self._source is not None else None
        if ds is None or not rows or len(rows) > 16:
            return None
        paused = self.tape.pause() if self.tape is not None else False
        rng = capture_rng(plain=False)  # a random transform draws from the global generators: the run's stream is kept
        try:
            for r in rows:
                arrays = _float_arrays(ds[r])  # (read once: a random transform draws anew each time)
                if not arrays or not all(_finite(a) for a in arrays):
                    return None
        except Exception:
            return None
        finally:
            restore_rng(rng)
            if self.tape is not None:
                self.tape.resume(paused)
        out: Dict[str, Any] = {"rows": [int(r) for r in rows]}
        fn = self._collate
        if fn is not None and getattr(fn, "__module__", "").split(".")[0] != "torch":
            out["collate_fn"] = getattr(fn, "__qualname__", None) or type(fn).__name__
        return out

    def new_step(self) -> None:
        self._step_rows = []

    def step_indices(self) -> Optional[List[int]]:
        """The dataset indices of the step's batch rows; None when its module calls took more than one batch
        (gradient accumulation: which one a row belongs to is not known)."""
        return self.last if len(self._step_rows) <= 1 else None

    def loaded(self, t: torch.Tensor) -> bool:
        """``t`` is a tensor a data loader returned (not one derived from it)."""
        r = self._rows.get(id(t))
        return r is not None and r[0]() is t

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
        for t in all_tensors(batch):  # token ids too: a module call is matched to its batch by them
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
            if hooks.excluded and _indexed(it):
                idx = hooks._filtered(it, idx, lambda: orig_index(it))
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
                    hooks._source = _ref(it._dataset)
                    hooks._collate = getattr(it, "_collate_fn", None)
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


def _float_arrays(item: Any) -> List[Any]:
    """The floating tensors and numpy arrays in a dataset item (numpy only when it is loaded already)."""
    import sys
    np = sys.modules.get("numpy")
    return leaves(item, lambda x: (isinstance(x, torch.Tensor) and x.is_floating_point())
                  or (np is not None and isinstance(x, np.ndarray) and x.dtype.kind == "f"))


def _finite(a: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.isfinite(a).all())
    import numpy as np
    return bool(np.isfinite(a).all())


def _ref(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``, or (an object that takes none) a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _indexed(it: Any) -> bool:
    """Map-style dataset, automatic batching, in-order delivery: batch rows have dataset indices."""
    return (getattr(it, "_dataset_kind", None) == _dl._DatasetKind.Map and getattr(it, "_auto_collation", False)
            and getattr(it, "_in_order", True))
