"""Describing an origin: its op, layer and line, for a backward op the forward op it differentiates,
its input and output statistics and its evidence facts; and where a pre-existing non-finite value
first enters the step (the batch rows, the dataset rows of a gather)."""
from __future__ import annotations

from typing import Any, Optional

from ...core.locate.result import mask_escape_detail, source_rows
from . import evidence as E
from . import numerics as N
from . import ops as O
from .numerics import jnum
from .oplog import OpLog
from .provenance import Origin, Provenance, dtype_name, np_value

__all__ = ["Describer"]

_MAX_DETAILED = 64   # origins that get full input stats and facts


class Describer:
    def __init__(self, log: OpLog, prov: Provenance, detail_limit: int = _MAX_DETAILED) -> None:
        self.log, self.prov, self.detail_limit = log, prov, int(detail_limit)

    def first_use(self, t_op: str, inputs: Any, out: Any, a: Any, stage: str, loc: Any,
                  pre: Optional[Origin] = None) -> dict:
        """Where a pre-existing non-finite tensor first enters the step (sample rows, source rows)."""
        if a is None:
            a = np_value(out)
        gather = t_op in O.GATHER_OPS
        if not gather and pre is not None and pre.tref is not None and pre.tref() is not None:
            rows = N.bad_rows(np_value(pre.tref()))     # the batch itself: its rows are the sample rows
        else:
            rows = N.bad_rows(a) if a is not None else []   # a gather's output rows are the batch rows
        d: dict[str, Any] = {"op": O.canonical(t_op), "tf_op": t_op, "stage": stage,
                             "file": loc.file if loc else None, "line": loc.line if loc else None,
                             "function": loc.function if loc else None, "module": loc.module if loc else None,
                             "layer": loc.layer if loc else None, "samples": rows, "source_rows": []}
        try:
            if gather and d["samples"] and len(inputs) > 1:
                index = np_value(inputs[1])
                if index is not None and index.dtype.kind in "iu" and index.ndim >= 1:
                    flat = index if index.ndim == 1 else index.reshape(index.shape[0], -1)[:, 0]
                    d["source_rows"] = source_rows(flat, d["samples"])
        except Exception as e:
            d["source_rows_error"] = str(e)[:100]
        return d

    def origin(self, o: Origin, t_op: str, idx: int, inputs: tuple, attrs: Any, outputs: tuple, ins: list,
               results: list, stage: str, fwd: Optional[int], loc: Any, own: Optional[tuple] = None) -> None:
        """Fill ``o.detail`` for a new origin made by op ``idx``. ``own``: the (file, line, function) of
        the ``tf.custom_gradient`` function the backward op ran in (its line is the origin's; the op is
        examined on its own inputs, as a forward op)."""
        log = self.log
        bad = [(pos, t, nan, inf, a) for pos, t, nan, inf, a in results if nan or inf]
        pos0, t0, _n, _i, a0 = bad[0]
        d: dict[str, Any] = {"op": O.canonical(t_op), "tf_op": t_op, "name": t_op, "api": t_op, "stage": stage,
                             "dtype": dtype_name(t0.dtype), "shape": [int(s) for s in a0.shape],
                             "positions": [p for p, *_ in bad][:10] if len(outputs) > 1 else [],
                             "autograd_node": None, "file": None, "line": None, "function": None,
                             "module": None, "layer": None, "module_type": None}
        if loc is not None:
            d.update(loc.as_dict())
        if own is not None:
            d["file"], d["line"], d["function"] = own
            d["custom_backward"] = True
        if stage == "backward":
            has_fwd = fwd is not None and fwd < len(log)
            d["autograd_node"] = f"{log.op_type[fwd]}Grad" if has_fwd else "tape"
            d["backward_op"] = t_op
            if has_fwd:
                d["forward_idx"] = fwd
                d["forward_op"] = log.op_canon[fwd]
                d["forward_tf_op"] = log.op_type[fwd]
                d["forward_api"] = log.op_type[fwd]
                fl = log.op_loc[fwd]
                if fl is not None:
                    d["forward_file"], d["forward_line"], d["forward_function"] = fl.file, fl.line, fl.function
                    d["forward_module"], d["forward_layer"] = fl.module, fl.layer
                    d["forward_module_type"], d["forward_line_source"] = fl.module_type, fl.line_source
                    d["forward_layer_stack"] = list(fl.layer_stack)
        d["output"] = N.nonfinite_counts(a0)
        d["samples"] = N.bad_rows(a0)
        mask = self.prov.take_escaped_mask()
        if mask is not None:
            d["mask_escape"] = mask_escape_detail(mask)
        o.detail = d
        if o.seq >= self.detail_limit:
            return
        d["inputs"] = []
        for i in ins[:6]:
            a = np_value(i[1])
            if a is None:
                continue
            st = N.tensor_stats(a, dtype_name(i[1].dtype))
            st["arg"] = i[0]
            d["inputs"].append(st)
        d["scalars"] = [jnum(v) for _p, v in (log.op_scalars[idx] if idx < len(log.op_scalars) else ())]
        try:
            d["facts"] = E.facts(E.Probe(log, self.prov, t_op, inputs, attrs, outputs, pos0, t0, a0,
                                         "forward" if own else stage, None if own else fwd))
        except Exception as e:
            d["facts"] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}

    def var_write(self, o: Origin, t_op: str, idx: int, ins: list, new: Any, stage: str, var: Any) -> None:
        """Fill ``o.detail`` for an origin born in a variable write (the update made it non-finite)."""
        loc = self.log.loc(idx)
        d = {"op": O.canonical(t_op), "tf_op": t_op, "name": t_op, "api": t_op, "stage": stage,
             "dtype": str(new.dtype), "shape": [int(s) for s in new.shape], "output": N.nonfinite_counts(new),
             "samples": N.bad_rows(new), "variable": var.name if var is not None else None,
             "inputs": [dict(N.tensor_stats(np_value(i[1]), dtype_name(i[1].dtype)), arg=i[0]) for i in ins[:6]],
             "facts": {}}
        if loc is not None:
            d.update(loc.as_dict())
        o.detail = d
