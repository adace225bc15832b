"""The localisation dict of one recorded step (``OpRecorder.result()``), from the sinks' taints.

The sink choice, the phase and the dict's shape are the core's
(:func:`nanguard.core.locate.result.build_localization`); this module is PyTorch's side of it: the
origin's keys, the batch and dataset rows of bad data, flattened rows mapped to batch rows, and the
optimizer's parameter, state slot and hyper-parameters.
"""
from __future__ import annotations

from typing import Any

import torch

from ...core.locate.result import LocalizationPort, OptimizerInfo, OriginShape, Preexisting, build_localization
from .. import numerics as N
from ..numerics import jnum
from .evidence import Evidence
from .naming import Names
from .oplog import OpLog
from .provenance import Origin, Provenance, Sinks

__all__ = ["build_result"]

# the origin's keys, in report order; a backward origin with a recorded forward line is named by it
_SHAPE = OriginShape(
    keys=("op", "api", "module", "file", "line", "function", "dtype", "shape", "stage", "autograd_node",
          "forward_op", "forward_file", "forward_line", "forward_function", "forward_module", "inputs", "output",
          "samples", "library", "kind", "forward_api", "scalars", "module_type", "hook"),
    backward_if="forward_line",
    from_forward=(("file", "forward_file"), ("line", "forward_line"), ("function", "forward_function"),
                  ("module", "forward_module")),
    only_if_set=("module",))


class _Port(LocalizationPort):
    """PyTorch's side of :func:`~nanguard.core.locate.result.build_localization`."""

    shape = _SHAPE
    constant_example = "masked_fill with -inf"

    def __init__(self, names: Names, log: OpLog, evidence: Evidence, data_rows: Any, batch_size: int | None,
                 batch_inputs: list | None) -> None:
        self.names, self.log, self.evidence = names, log, evidence
        self.data_rows, self.batch_size, self.batch_inputs = data_rows, batch_size, batch_inputs

    def preexisting(self, taint: Origin) -> Preexisting:
        return _preexisting(taint, self.names, self.data_rows, self.batch_size, self.batch_inputs)

    def where_trap(self, op: int) -> bool:
        return self.evidence.where_trap(op)

    def finish_origin(self, origin: dict, facts: dict) -> None:
        _user_rows(origin, facts, self.batch_size)

    def optimizer(self, taint: Origin, sinks: Sinks) -> OptimizerInfo | None:
        return optimizer_info(taint, sinks, self.names, self.log)


def build_result(notes: list[str], n_ops: int, sinks: Sinks, prov: Provenance, names: Names, log: OpLog,
                 evidence: Evidence, data_rows: Any = None, batch_size: int | None = None,
                 batch_inputs: list | None = None) -> dict:
    """Pick the sink that failed (loss, else gradients, else parameters/state after the update), follow
    its earliest real taint to the origin and describe it (:func:`~nanguard.core.locate.result.build_localization`)."""
    port = _Port(names, log, evidence, data_rows, batch_size, batch_inputs)
    return build_localization(sinks, prov, notes, n_ops, port).as_dict()


def _preexisting(taint: Origin, names: Names, data_rows: Any = None, batch_size: int | None = None,
                 batch_inputs: list | None = None) -> Preexisting:
    t = taint.tref() if taint.tref is not None else None
    if t is not None and taint.pre_kind in ("param", "buffer", "data"):
        pn = names.param_name(t)    # names may have been learnt (or improved) after the first read
        if pn is not None and pn[1] is not None:
            taint.pre_kind, taint.name = pn
    st = (taint.detail or {}).get("stats", {})
    fu = taint.first_use or {}
    is_data = taint.pre_kind == "data"   # batch rows only mean something for data
    samples, source = (_data_rows(t, fu, data_rows, batch_size) if is_data else ([], []))
    if is_data and not samples:  # e.g. x[3, 5] = nan written into the batch: the batch's own bad rows
        samples, source, batch_t = _batch_input_rows(batch_inputs or [], data_rows, source)
        if batch_t is not None and (t is None or t.dim() == 0):  # describe the batch, not the scalar
            st = N.tensor_stats(batch_t)
            st["bad_rows"] = samples
    pre = Preexisting.of(taint, samples, source, st)
    if is_data and data_rows is not None and t is not None and source and fu.get("source_rows") != source:
        pre.source_rows_from = "the DataLoader's sampler (dataset indices of the batch)"
    return pre


def optimizer_info(taint: Origin, sinks: Sinks, names: Names, log: OpLog) -> OptimizerInfo | None:
    """Which parameter and which state slot the optimizer-stage origin belongs to (followed through the
    optimizer's op graph by tensor id), and the optimizer's hyperparameters."""
    optimizers = names.optimizers
    if not optimizers and not sinks.opt:
        return None
    ident: dict[int, tuple[str, str | None]] = {}
    for pid in names.params:
        ident[pid] = (names.param_ids[pid], None)
    for opt in optimizers:
        for p, st in list(opt.state.items()):
            if isinstance(st, dict):
                pname = names.param_ids.get(id(p), "?")
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        ident[id(v)] = (pname, k)
    assoc = dict(ident)
    d = taint.detail or {}
    pos0 = (d.get("positions") or [None])[0]
    found: list[tuple[Any, tuple]] = []
    for idx, ins, outs in log.opt_ops:
        by_pos: dict[Any, list] = {}
        for k, p, tid in ins:
            a = assoc.get(tid)
            if a is not None:
                by_pos.setdefault(p, []).append((k, a))
        if idx == taint.op:
            for p in ([pos0] if pos0 is not None else list(by_pos)):
                found += by_pos.get(p, [])
            if pos0 is not None:
                found += by_pos.get(None, [])
        for p, tid in outs:
            if tid in ident:
                continue
            cand = by_pos.get(p) or by_pos.get(None) or [x for v in by_pos.values() for x in v]
            if cand:
                withkey = [c for c in cand if c[1][1] is not None]
                assoc[tid] = (withkey or cand)[0][1]
    name = d.get("name") or ""
    den_key = {"addcdiv": 2, "_foreach_addcdiv": 2, "div": 1, "_foreach_div": 1, "reciprocal": 0,
               "_foreach_reciprocal": 0}.get(name)
    param = next((a[0] for _k, a in found if a[0] and a[0] != "?"), None)
    state = next((a[1] for k, a in found if k == den_key and a[1] is not None), None) if den_key is not None \
        else None
    state = state or next((a[1] for _k, a in found if a[1] is not None and a[1] != "step"), None)
    info = OptimizerInfo(param=param, state=state, inputs=[
        {"arg": str(k), "param": a[0], "state": a[1]} for k, a in found][:10])
    if sinks.opt:
        info.nonfinite_after_step = [_Port.opt_name(n, k) for n, k, _ in sinks.opt][:10]
        if info.param is None:
            info.param = sinks.opt[0][0]
        if info.state is None:
            info.state = next((k for _n, k, _t in sinks.opt if k), None)
    for opt in optimizers:
        info.optimizer = type(opt).__name__
        g = opt.param_groups[0]
        for key in ("lr", "eps", "weight_decay", "betas", "momentum"):
            if key in g:
                v = g[key]
                if isinstance(v, torch.Tensor):
                    v = v.item()
                info.hyper[key] = [jnum(x) for x in v] if isinstance(v, (list, tuple)) else jnum(v)
        by_name = {names.param_ids[pid]: p for pid, p in names.params.items()}
        if param and param in by_name:
            pdt = by_name[param].dtype
            info.param_dtype = N.dtype_name(pdt)
            if "eps" in g and isinstance(g["eps"], (int, float)) and pdt.is_floating_point:
                info.eps_fact = N.eps_fact(float(g["eps"]), pdt)
        break
    return info


def _data_rows(t: Any, fu: dict, data_rows: Any, batch_size: int | None) -> tuple[list, list]:
    """(batch rows, dataset rows) of a batch tensor that held non-finite values before the step.

    The batch rows are rows of the user's batch: the tensor's own bad rows when it is a batch (its
    first dimension is the batch size, or the DataLoader delivered it), else the rows of the first op
    that read it when that op's output is batch-shaped (a dataset tensor indexed by the batch
    indices), else none. Dataset rows: from the DataLoader's sampler when the batch came from one,
    else from the index op that looked the rows up (``first_use.source_rows``)."""
    idx = None
    if data_rows is not None and isinstance(t, torch.Tensor):
        try:
            idx = data_rows(t)
        except Exception:
            idx = None
    if isinstance(t, torch.Tensor) and t.dim() >= 1 and (idx is not None or t.shape[0] == batch_size):
        rows = N.bad_rows(t, limit=20)
        src = [int(idx[r]) for r in rows if idx is not None and r < len(idx)]
        return rows, src or list(fu.get("source_rows") or [])
    first_dim = fu.get("out_dim0")
    if batch_size and first_dim == batch_size:
        return list(fu.get("samples") or []), list(fu.get("source_rows") or [])
    return [], list(fu.get("source_rows") or [])


def _batch_input_rows(inputs: list, data_rows: Any, source: list) -> tuple[list, list, Any]:
    """Bad rows of the model's first batch input that holds non-finite values (and their dataset rows)."""
    for t in inputs:
        if isinstance(t, torch.Tensor) and N.is_checkable(t):
            rows = N.bad_rows(t, limit=20)
            if rows:
                idx = data_rows(t) if data_rows is not None else None
                return rows, ([int(idx[r]) for r in rows if r < len(idx)] if idx else source), t
    return [], source, None


def batch_rows(rows: list, dim0: int | None, batch: int | None) -> tuple[list, str] | None:
    """Rows of a (possibly flattened) tensor as rows of the user's batch.

    ``dim0`` is the tensor's first dimension, ``batch`` the batch size. dim0 == batch: the rows are
    batch rows. dim0 == k * batch (batch x heads, batch x time flattened): a batch row b owns the
    rows b*k .. b*k+k-1 (batch-major, PyTorch's layout for attention heads and ``view(-1, ...)``)
    or b, b+batch, ... (head-major); the layout that explains the rows with fewer batch rows is
    taken, batch-major on ties. Anything else: None (the rows are not batch rows)."""
    if not rows or not batch or not dim0:
        return None
    if dim0 == batch:
        return sorted(set(rows)), "batch"
    if dim0 % batch or batch == 1:  # (a batch of 1, or no batch found: every row would map to row 0)
        return None
    k = dim0 // batch
    bm = sorted({r // k for r in rows})
    hm = sorted({r % batch for r in rows})
    if len(hm) < len(bm):
        return hm, f"rows of a {dim0}-row tensor ({k} x batch {batch}, head-major) mapped to batch rows"
    return bm, f"rows of a {dim0}-row tensor (batch {batch} x {k}, batch-major) mapped to batch rows"


def _user_rows(origin: dict, facts: dict, batch: int | None) -> None:
    """Replace flattened row indices (batch x heads, batch x time) by rows of the user's batch."""
    if not batch:
        return
    shape = origin.get("shape") or []
    raw = list(origin.get("samples") or [])
    m = batch_rows(raw, shape[0] if shape else None, batch)
    if m is not None:
        origin["samples"] = m[0]
        if m[1] != "batch":
            origin["tensor_rows"], origin["samples_note"] = raw, m[1]
    elif raw:
        origin["samples"], origin["tensor_rows"] = [], raw
    sm = facts.get("softmax_all_masked_rows")
    if isinstance(sm, dict) and sm.get("batch_rows") and sm.get("dim0"):
        m = batch_rows(sm["batch_rows"], sm["dim0"], batch)
        if m is not None and m[1] != "batch":
            sm["tensor_rows"], sm["batch_rows"], sm["rows_note"] = sm["batch_rows"], m[0], m[1]
        elif m is None:
            sm["tensor_rows"], sm["batch_rows"] = sm["batch_rows"], []
