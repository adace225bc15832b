"""Batch rows: the batch size of an arbitrary batch, selecting rows, and finding the offending rows
by bisection.

A batch is any nesting of tuples, lists, dicts and tensors; its batch size is the first dimension
most of its tensors share. Dropping rows indexes every tensor with that first dimension and keeps
the rest (scalars, lengths lists, strings) as it is.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, List, Optional, Sequence

import torch

from ...core.experiments.kinds import PER_SAMPLE
from ...core.experiments.rows import bisect_rows, complement  # noqa: F401 (re-exported)


def tensors_of(x: Any, out: List[torch.Tensor]) -> None:
    """Append every tensor of a nested batch to ``out``."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            tensors_of(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            tensors_of(v, out)


def batch_size_of(batch: Any) -> Optional[int]:
    """The first dimension most tensors of ``batch`` share (the first tensor's on a tie); None without
    a tensor of at least one dimension."""
    ts: List[torch.Tensor] = []
    tensors_of(batch, ts)
    dims = [t.shape[0] for t in ts if t.dim() >= 1]
    if not dims:
        return None
    counts = Counter(dims)
    best = max(counts.values())
    return next(d for d in dims if counts[d] == best)


def select_rows(batch: Any, rows: Sequence[int], size: Optional[int]) -> Any:
    """``batch`` with only ``rows`` of every tensor whose first dimension is ``size``."""
    cache: dict = {}

    def idx(dev: torch.device) -> torch.Tensor:
        if dev not in cache:
            cache[dev] = torch.as_tensor(list(rows), dtype=torch.long, device=dev)
        return cache[dev]

    def sel(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.index_select(0, idx(x.device)) if (x.dim() >= 1 and x.shape[0] == size) else x
        if isinstance(x, dict):
            return {k: sel(v) for k, v in x.items()}
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*[sel(v) for v in x])
        if isinstance(x, (list, tuple)):
            return type(x)(sel(v) for v in x)
        return x

    return sel(batch)


def indices_at(indices: Optional[Sequence[Any]], rows: Sequence[int], size: int) -> Optional[List[Any]]:
    """The dataset indices of batch ``rows`` (plain numbers), when ``indices`` gives one per row."""
    if indices is None or len(indices) != size:
        return None
    out = []
    for r in rows:
        v = indices[r]
        out.append((v.item() if v.numel() == 1 else v.tolist()) if isinstance(v, torch.Tensor) else v)
    return out


INDEX_KEYS = ("indices", "index")


def batch_indices(batch: Any, indices: Optional[Sequence[Any]] = None) -> Optional[List[Any]]:
    """The dataset index of every row of ``batch``: ``indices`` when given, else a dict batch's
    ``"indices"`` or ``"index"`` entry (a tensor or a list), else None."""
    if indices is None and isinstance(batch, dict):
        indices = next((batch[k] for k in INDEX_KEYS if k in batch), None)
    if indices is None:
        return None
    if isinstance(indices, torch.Tensor):
        return indices.reshape(-1).tolist() if indices.dim() <= 1 else None
    try:
        return list(indices)
    except TypeError:
        return None


def name_samples(event: Any, indices: Optional[Sequence[Any]]) -> None:
    """``cause.evidence.bad_samples`` for bad input data and per-sample failures: the batch rows the
    localization (or a ``drop_samples`` experiment) named and, with ``indices``, their dataset rows."""
    cause = event.cause if isinstance(event.cause, dict) else None
    if cause is None:
        return
    ev = cause.setdefault("evidence", {})
    s = ev.get("bad_samples")
    if s is None:
        o = event.origin or {}
        rows = [r for r in (o.get("samples") or []) if isinstance(r, int)]
        shape = o.get("shape") or []
        confined = bool(shape) and isinstance(shape[0], int) and len(rows) < min(shape[0], 10)
        if not rows or not (cause.get("category") == "bad_input_data" or
                            (confined and cause.get("category") in PER_SAMPLE)):
            return
        if indices is not None and shape and shape[0] != len(indices):
            indices = None  # the origin's first dimension is not the batch's
        s = ev["bad_samples"] = {"batch_rows": rows[:10]}
    if indices is not None and "dataset_indices" not in s:
        idx = indices_at(indices, [r for r in s["batch_rows"] if r < len(indices)], len(indices))
        if idx:
            s["dataset_indices"] = idx


NO_INDICES = ("dataset row not traceable: Guard.step was given no indices= and the batch has no "
              "'indices' entry")


def annotate_rows(loc_run: Optional[dict], indices: Optional[Sequence[Any]]) -> None:
    """Name the dataset rows of a Guard step's bad input data before it is diagnosed (in place): with the
    step's ``indices`` (one per batch row), ``preexisting.source_rows`` and the origin's; without them,
    ``source_rows_note`` says why they cannot be named (the batch positions are all the report has)."""
    loc = (loc_run or {}).get("localization") or {}
    pre = loc.get("preexisting") or {}
    rows = [r for r in (pre.get("samples") or []) if isinstance(r, int)]
    if pre.get("kind") != "data" or not rows or pre.get("source_rows"):
        return
    dim0 = (pre.get("first_use") or {}).get("out_dim0") or ((pre.get("stats") or {}).get("shape") or [None])[0]
    src = indices_at(indices, rows, dim0) if indices is not None and isinstance(dim0, int) else None
    if src:
        pre["source_rows"] = src
        pre["source_rows_from"] = "the dataset indices given with the batch"
        if isinstance(pre.get("first_use"), dict):
            pre["first_use"]["source_rows"] = src
        o = loc.get("origin")
        if isinstance(o, dict) and o.get("kind") == "data":
            o["source_rows"] = src
        return
    pre["source_rows_note"] = f"batch position(s) {rows}; " + (
        NO_INDICES if indices is None else f"dataset row not traceable: {len(indices)} indices were given for "
                                           f"a batch of {dim0} rows")
