"""Dataset rows for TensorFlow/Keras: which row of the data given to training a bad batch row is.

A failing batch names its bad rows by position in the batch ("row 21"); the user needs the row of
their data ("row 1234 of ``x``"). Keras does not keep the indices it shuffles (``fit`` on arrays
draws a permutation in-graph; ``tf.data`` shuffles inside its C++ runtime), so the row is traced by
*value*, only after a failure: the batch row is looked up in the arrays the batches were sliced
from, and a row whose values are all equal (NaN matching NaN) is its source.

Where the arrays come from:

* ``model.fit(x, y)`` on arrays: the arrays of fit's data adapter (found on the running ``fit``'s
  frame, so the Keras callback and ``nanguard run`` both see them);
* ``model.fit(dataset)`` or a loop over a ``tf.data.Dataset``: the dataset's chain of input
  datasets is walked down to ``from_tensor_slices`` (its tensors are the arrays); the operations
  passed through are listed. Row-preserving ones (shuffle, batch, prefetch, cache, repeat, take,
  skip, filter, shard, rebatch, unbatch...) keep the values, so the match is exact; one that makes new
  values (``map``) or rows from elsewhere (a generator, ``interleave``) may leave no match, and the
  report then says ``"batch position 21; dataset row not traceable through map"``.

Arrays given to ``fit`` without shuffling are sliced in order (batch ``k`` of an epoch holds rows
``k * batch_size`` onwards), so there the row is known by its position, not guessed from its values
(the value match only confirms it): duplicated rows are then no ambiguity. Elsewhere a value that
several rows share (duplicated data) names every candidate and says the match is ambiguous
(``ambiguous``; a localization's ``source_rows_ambiguous`` and a note), never one of them alone.
Cost: nothing per step; at a failure, one comparison of a column of the source, then full rows of
the few candidates.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["RowSource", "fit_source", "dataset_source", "trace_rows", "annotate_localization", "bad_part", "loop_source"]

_MAX_ROWS = 10
_MAX_CANDIDATES = 5   # rows sharing a batch row's values: more than this is no answer
# tf.data operations whose elements are the input's rows unchanged (possibly reordered, regrouped or fewer)
_ROW_PRESERVING = {"Shuffle", "Batch", "ParallelBatch", "PaddedBatch", "Prefetch", "Cache", "Repeat", "Take",
                   "Skip", "Filter", "Shard", "Rebatch", "Unbatch", "Options", "AssertCardinality", "Snapshot",
                   "IgnoreErrors", "TakeWhile", "slice", "shuffle", "batch"}

# operations that make their rows from elsewhere: the trace stops there
_MAKES_ROWS = {"FlatMap": "flat_map (e.g. from_generator)", "Interleave": "interleave",
               "ParallelInterleave": "interleave", "Generator": "from_generator", "Window": "window",
               "TextLine": "a file reader", "TFRecord": "a file reader", "FixedLengthRecord": "a file reader"}


@dataclass
class RowSource:
    """The arrays batches were sliced from (``arrays``, flattened, each with the rows first), how
    (``through``: the operations between them and the batch) and what it was (``what``); or, when no
    array was found, why (``blocker``)."""

    arrays: List[np.ndarray] = field(default_factory=list)
    through: List[str] = field(default_factory=list)
    what: str = ""
    blocker: Optional[str] = None
    first_row: Optional[int] = None   # the row of batch row 0, when known from the order (unshuffled fit)
    windowed: bool = False   # batch rows are windows of ``arrays[0]``'s rows (timeseries_dataset_from_array)

    @property
    def altering(self) -> List[str]:
        """The operations on the way that may change values (a match through them is not guaranteed)."""
        return [t for t in self.through if t not in _ROW_PRESERVING]


def _op_name(ds: Any) -> str:
    n = type(ds).__name__.lstrip("_")
    return n[:-len("Dataset")] if n.endswith("Dataset") else n


def _np(x: Any) -> Optional[np.ndarray]:
    try:
        a = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    except Exception:
        return None
    return a if isinstance(a, np.ndarray) and a.ndim >= 1 and a.dtype.kind in "fiub" else None


def _flat_arrays(x: Any) -> List[np.ndarray]:
    out: List[np.ndarray] = []
    if x is None:
        return out
    if isinstance(x, dict):
        for k in x:
            out += _flat_arrays(x[k])
    elif isinstance(x, (list, tuple)):
        for v in x:
            out += _flat_arrays(v)
    else:
        a = _np(x)
        if a is not None:
            out.append(a)
    return out


def dataset_source(ds: Any) -> RowSource:
    """Walk a ``tf.data.Dataset`` down to the tensors of its ``from_tensor_slices`` (see module doc)."""
    through: List[str] = []
    seen = 0
    while ds is not None and seen < 64:
        seen += 1
        name = _op_name(ds)
        tensors = getattr(ds, "_tensors", None)
        if name == "TensorSlice" and tensors is not None:
            return RowSource(_flat_arrays(list(tensors)), list(reversed(through)), "the tensors of from_tensor_slices")
        pool = _window_pool(ds) if name == "Zip" else None
        if pool is not None:
            return RowSource([pool], list(reversed(through)) + ["window"],
                             "the array windowed by timeseries_dataset_from_array", windowed=True)
        if name in _MAKES_ROWS or name in ("Zip", "Concatenate") or getattr(ds, "_input_dataset", None) is None:
            what = _MAKES_ROWS.get(name) or {"Tensor": "from_tensors (one element, no rows)", "Zip": "zip",
                                             "Concatenate": "concatenate", "Range": "range"}.get(name, name)
            return RowSource([], list(reversed(through)), blocker=what or "an unknown source")
        through.append(name)
        ds = ds._input_dataset
    return RowSource([], list(reversed(through)), blocker="a chain of datasets too long to follow")


def _window_pool(zipped: Any) -> Optional[np.ndarray]:
    """The array whose rows a window dataset gathers: Keras' ``timeseries_dataset_from_array`` zips
    (windows, targets), each ``map(gather)`` over ``zip(from_tensors(array).repeat(), indices)``; the
    inputs' array is the first component's ``from_tensors`` tensor with rows (2-D or more). None for any
    other zip."""
    parts = getattr(zipped, "_datasets", None)
    first = parts[0] if isinstance(parts, (list, tuple)) and parts else None
    for _ in range(3):   # map -> zip -> repeat -> from_tensors
        if first is None or _op_name(first) not in ("Map", "ParallelMap"):
            return None
        inner = getattr(first, "_input_dataset", None)
        comps = getattr(inner, "_datasets", None)
        if not isinstance(comps, (list, tuple)) or not comps:
            return None
        src = comps[0]
        while _op_name(src) in ("Repeat", "Prefetch"):
            src = getattr(src, "_input_dataset", None)
        tensors = getattr(src, "_tensors", None) if src is not None and _op_name(src) == "Tensor" else None
        if tensors:
            a = _np(tensors[0])
            return a if a is not None and a.ndim >= 2 and a.dtype.kind == "f" else None
        first = src
    return None


def _window_rows(source: RowSource, batch: Any, rows: Sequence[int]) -> Dict[str, Any]:
    """Rows of the windowed array that the bad windows ``rows`` hold: each non-finite step of a window is
    matched by value against the array's rows (NaN equals NaN)."""
    pool = source.arrays[0]
    parts = [p for p in _flat_arrays(list(batch) if isinstance(batch, (list, tuple)) else [batch])
             if p.ndim == pool.ndim + 1 and p.shape[2:] == pool.shape[1:] and p.dtype.kind == "f"]
    found: set = set()
    for p in parts[:1]:
        for r in rows:
            if r >= p.shape[0]:
                continue
            win = p[r].reshape(p.shape[1], -1)
            for i in np.nonzero(~np.isfinite(win).all(axis=1))[0]:
                c = _candidates(pool, p[r][i])
                if 0 < len(c) <= _MAX_CANDIDATES:
                    found.update(int(j) for j in c)
    if not found:
        return {"note": f"batch position(s) {list(rows)}; dataset row not traceable: no row of {source.what} "
                        "has the values of the bad windows' steps"}
    return {"dataset_rows": sorted(found)[:_MAX_ROWS],
            "how": f"the bad steps of window(s) {list(rows)} matched by value in {source.what}"}


def fit_source(step_in_epoch: Optional[int] = None) -> Optional[RowSource]:
    """The data of the running ``model.fit`` (from its frame on a thread's stack), or None outside ``fit``.
    (Two fits running at once in two threads: the first found.) ``step_in_epoch``: the failing batch's
    place in its epoch (arrays given unshuffled: its first row is known)."""
    try:
        from keras.src.backend.tensorflow import trainer
        path = trainer.__file__.rsplit(".", 1)[0]
    except Exception:
        return None
    f = None
    # the in-graph capture runs in a py_function, on a thread of TensorFlow's: fit is on another stack
    for top in [sys._getframe(1)] + list(sys._current_frames().values()):
        f = top
        while f is not None and not (f.f_code.co_name == "fit" and f.f_code.co_filename.rsplit(".", 1)[0] == path):
            f = f.f_back
        if f is not None:
            break
    if f is None:
        return None
    it = f.f_locals.get("epoch_iterator")
    adapter = getattr(it, "data_adapter", None)
    inputs = getattr(adapter, "_inputs", None)
    if inputs is not None:
        shuffled = getattr(adapter, "_shuffle", False)
        bs = getattr(adapter, "_batch_size", None)
        first = step_in_epoch * int(bs) if shuffled is False and isinstance(bs, int) and step_in_epoch is not None \
            else None
        return RowSource(_flat_arrays(inputs), ["shuffle" if shuffled else "slice", "batch"], "the arrays given to fit",
                         first_row=first)
    ds = getattr(adapter, "_dataset", None)
    if ds is not None:
        return dataset_source(ds)
    x = f.f_locals.get("x")
    return RowSource([], [], blocker=type(x).__name__ if x is not None else "no data")


def loop_source(batch: Any) -> Optional[RowSource]:
    """Outside ``fit``: the ``tf.data.Dataset`` a training loop iterates (``for x, y in train_dataset:``
    around a ``@tf.function`` step), found among the locals of the script's frames (a module's are its
    globals), or an iterator's dataset there; of several (train and validation sets), the one whose
    ``from_tensor_slices`` arrays hold the batch's first row. None when none does."""
    try:
        import tensorflow as tf
    except Exception:
        return None
    here = __file__.rsplit("/", 2)[0]
    seen: Dict[int, Any] = {}
    for top in list(sys._current_frames().values()):
        f = top
        while f is not None:
            fn = f.f_code.co_filename
            if not fn.startswith(here) and "site-packages" not in fn and not fn.startswith("<"):
                for v in list(f.f_locals.values()):
                    ds = v if isinstance(v, tf.data.Dataset) else getattr(v, "_dataset", None)
                    if isinstance(ds, tf.data.Dataset):
                        seen.setdefault(id(ds), ds)
            f = f.f_back
    for ds in seen.values():
        src = dataset_source(ds)
        if src.arrays and trace_rows(src, batch, [0]).get("dataset_rows"):
            return src
    return None


def _equal_rows(src: np.ndarray, cand: np.ndarray, row: np.ndarray) -> np.ndarray:
    """Which of the source rows ``cand`` equal ``row`` (NaN equals NaN), compared in ``row``'s dtype."""
    s = src[cand].reshape(len(cand), -1)
    if s.dtype != row.dtype:
        s = s.astype(row.dtype)
    r = row.reshape(-1)
    eq = s == r
    if r.dtype.kind == "f":
        eq |= np.isnan(s) & np.isnan(r)
    return eq.all(axis=1)


def _candidates(src: np.ndarray, row: np.ndarray) -> np.ndarray:
    """Rows of ``src`` equal to ``row``: one column narrows them, full rows decide."""
    if src.shape[1:] != row.shape:
        return np.zeros(0, dtype=np.int64)
    flat = src.reshape(src.shape[0], -1)
    r = row.reshape(-1)
    if r.size == 0:
        return np.zeros(0, dtype=np.int64)
    fin = np.nonzero(np.isfinite(r))[0] if r.dtype.kind == "f" else np.arange(r.size)
    if fin.size:
        j = int(fin[0])
        col = flat[:, j] if flat.dtype == r.dtype else flat[:, j].astype(r.dtype)
        cand = np.nonzero(col == r[j])[0]
    else:
        cand = np.arange(flat.shape[0])
    return cand[_equal_rows(flat, cand, r)] if cand.size else cand


def trace_rows(source: Optional[RowSource], batch: Sequence[Any], rows: Sequence[int]) -> Dict[str, Any]:
    """The dataset rows of batch ``rows``. ``batch``: the batch's arrays (any nesting); the arrays of the
    source are paired with the batch's by position when both have as many, else by row shape.
    Returns ``{"dataset_rows": [...], "how": ...}`` or ``{"note": "batch position(s) ...; dataset row not
    traceable through ..."}``."""
    rows = [int(r) for r in rows][:_MAX_ROWS]
    pos = f"batch position(s) {rows}"
    if source is None:
        return {"note": f"{pos}; dataset row not traceable: the batches come from the script's own code, not "
                        "from fit's data or a tf.data pipeline"}
    if not source.arrays:
        return {"note": f"{pos}; dataset row not traceable through {source.blocker or 'the input pipeline'}"}
    if source.windowed:
        return _window_rows(source, batch, rows)
    parts = _flat_arrays(list(batch) if isinstance(batch, (list, tuple)) else [batch])
    b = max((p.shape[0] for p in parts), default=0)
    parts = [p for p in parts if p.shape[0] == b]
    pairs = list(zip(parts, source.arrays)) if len(parts) == len(source.arrays) else \
        [(p, s) for p in parts for s in source.arrays if s.shape[1:] == p.shape[1:]]
    found: List[int] = []
    ambiguous = False
    by_order = source.first_row is not None
    finite_source = all(_finite(a) for a in source.arrays)
    for r in rows:
        cand: Optional[set] = None
        mapped = False  # a non-finite part of the row matches no row of the finite arrays: a mapped function made it
        for p, s in pairs:
            if r >= p.shape[0]:
                continue
            c = set(int(i) for i in _candidates(s, p[r])) if s.shape[1:] == p.shape[1:] else set()
            mapped = mapped or (not c and bool(source.altering) and finite_source and not _finite(p[r]))
            if not c:
                continue
            cand = c if cand is None else (cand & c) or cand
        if mapped and cand and len(cand) > _MAX_CANDIDATES:
            cand = None  # only the kept parts (labels shared by many rows) matched: no row, and the map made it
        if by_order and cand and source.first_row + r in cand:
            found.append(source.first_row + r)   # its place in the unshuffled arrays, confirmed by its values
            continue
        by_order = False
        if not cand:
            via = _named(source.altering) or ", ".join(source.through) or "the input pipeline"
            out = {"note": f"{pos}; dataset row not traceable through {via} (no row of {source.what} has "
                           f"the values of batch row {r})"}
            if source.altering and finite_source:  # so a function on the way made it
                out["made_by"] = _named(source.altering)
            return out
        if len(cand) > _MAX_CANDIDATES:
            return {"note": f"{pos}; dataset row not traceable: {len(cand)} rows of {source.what} have the "
                            f"values of batch row {r}"}
        ambiguous = ambiguous or len(cand) > 1
        found += [i for i in sorted(cand) if i not in found]  # (two batch rows of the same values: each row once)
    how = (f"the batch's place in {source.what}, not shuffled (its values match)" if by_order else
           f"matched by value in {source.what}" + (f" (through {', '.join(source.through)})" if source.through else ""))
    out: Dict[str, Any] = {"dataset_rows": found, "how": how}
    if ambiguous:
        out["ambiguous"] = True
    if source.altering and found and all(_finite(a[found]) for a in source.arrays if len(a) > max(found)):
        out["made_by"] = _named(source.altering)  # the rows are finite where they were sliced
    return out


_PARTS = ("inputs", "targets", "sample_weight")   # Keras' (x, y, sample_weight) data convention


def bad_part(batch: Any, rows: Sequence[int]) -> Optional[str]:
    """Which part of a batch holds the non-finite values of batch ``rows``: ``"targets"`` or
    ``"sample_weight"`` for the 2nd / 3rd element of an ``(x, y[, sample_weight])`` batch (what ``fit``
    gives its train step, what a ``tf.data`` pipeline of (features, labels) yields), ``"inputs"`` for the
    first; ``"inputs['key']"`` for a dict of inputs. None when unknown or when several parts hold them."""
    parts: List[tuple] = []
    if isinstance(batch, (list, tuple)) and 2 <= len(batch) <= 3:
        named = [(_PARTS[i], b) for i, b in enumerate(batch)]
    else:
        named = [("inputs", batch)]
    for role, b in named:
        subs = [(f"{role}[{k!r}]", v) for k, v in b.items()] if isinstance(b, dict) else [(role, b)]
        for name, v in subs:
            for a in _flat_arrays(v):
                if a.dtype.kind != "f":
                    continue
                r = [i for i in rows if 0 <= i < a.shape[0]]
                if r and not np.isfinite(a[r]).all():
                    parts.append(name)
                    break
    return parts[0] if len(parts) == 1 else None


def zero_weights(batch: Any, part: str, rows: Sequence[int]) -> bool:
    """The sample weights an ``(x, y, sample_weight)`` batch gives the bad target rows are all 0 (those of the
    same output, for ``targets['key']``)."""
    if not isinstance(batch, (list, tuple)) or len(batch) != 3:
        return False
    sw = batch[2]
    key = part[len("targets["):-1] if part.startswith("targets[") else None
    if isinstance(sw, dict) and key is not None:
        sw = next((v for k, v in sw.items() if repr(k) == key), None)
    arrays = _flat_arrays(sw) if not isinstance(sw, dict) else []
    if len(arrays) != 1:
        return False
    a = arrays[0]
    r = [i for i in rows if 0 <= i < a.shape[0]]
    return bool(r) and bool((a[r] == 0).all())


def annotate_localization(loc: Optional[Dict[str, Any]], source: Optional[RowSource], batch: Any) -> None:
    """Name the dataset rows of a localization's bad input data (``preexisting.source_rows`` and its
    ``first_use``), in place; or say why they cannot be named (``source_rows_note`` and a note)."""
    pre = (loc or {}).get("preexisting") or {}
    if pre.get("kind") != "data":
        return
    rows = [r for r in (pre.get("samples") or []) if isinstance(r, int)]
    if rows and batch is not None and not pre.get("part"):
        part = bad_part(batch, rows)
        if part:
            pre["part"] = part
            if part.startswith("targets") and zero_weights(batch, part, rows):
                pre["zero_weight"] = True  # the script meant to mask those targets: 0 * NaN is still NaN
    if not rows or batch is None or pre.get("source_rows"):
        return
    t = trace_rows(source, batch, rows)
    if t.get("made_by"):
        pre["made_by_pipeline"] = t["made_by"]
    if t.get("dataset_rows"):
        pre["source_rows"] = t["dataset_rows"]
        pre["source_rows_from"] = t["how"]
        if t.get("ambiguous"):  # rows with the same values: the bad one is among them, which is not known
            pre["source_rows_ambiguous"] = True
            notes = loc.setdefault("notes", [])
            if isinstance(notes, list):
                notes.append(f"dataset rows {t['dataset_rows']} have the same values as the bad batch row(s) "
                             f"{rows}: which of them the batch held is not known")
        if isinstance(pre.get("first_use"), dict):
            pre["first_use"]["source_rows"] = t["dataset_rows"]
        o = loc.get("origin")
        if isinstance(o, dict) and o.get("kind") == "data":
            o["source_rows"] = t["dataset_rows"]
    elif t.get("note"):
        pre["source_rows_note"] = t["note"]
        notes = loc.setdefault("notes", [])
        if isinstance(notes, list):
            notes.append(t["note"])


def _named(ops: Sequence[str]) -> str:
    """The pipeline's altering stages, each kind once with its count ("Map (2)", not "Map, Map")."""
    return ", ".join(f"{k} ({ops.count(k)})" if ops.count(k) > 1 else k for k in dict.fromkeys(ops))


def _finite(a: np.ndarray) -> bool:
    return a.dtype.kind != "f" or bool(np.isfinite(a).all())
