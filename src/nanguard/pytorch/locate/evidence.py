"""Evidence: the facts about an origin op, gathered while its tensors are alive.

A gatherer is a function of a :class:`Probe` (the examined op's call) that returns facts to merge into
``loc["facts"]``, or None. ``@gatherer("name")`` registers it: gatherers with ``always=True`` run for
every origin (re-runs in float64/float32, dtype info, producers, eps constants, overflow, kl_div,
where-trap), the others only for ops whose family (``nanguard.core.diagnosis.families``) lists the
name in its ``evidence``. They run in registration order, which is the key order of the facts.
The diagnosis rules read the facts by the same names, and a TensorFlow backend gathers the same
names, so rules work for both.
"""
from __future__ import annotations

import sys

import math
from typing import Any, Callable, Sequence

import torch

from ... import array_facts as AF
from ...core.diagnosis import families
from ...core.diagnosis.roles import EPS_PRODUCER, INDEX, REDUCE, VIEW
from ...core.locate.evidence import Gatherers, ProbeBase
from ...core.locate.result import mask_escape_detail, source_rows
from .. import numerics as N
from ..numerics import jnum
from .naming import Frames
from .oplog import OpLog
from .ops import Mutations, flat_tensors, opname
from .provenance import Origin, Provenance
from .opcheck import OpChecks

_CUSTOM = torch.autograd.function.BackwardCFunction
_MODULE_HOOK = "BackwardHookFunctionBackward"   # register_full_backward_hook's Function (torch/utils/hooks.py)

aten = torch.ops.aten

__all__ = ["gatherer", "GATHERERS", "Probe", "Evidence"]

_MAX_DETAILED = 64   # origins that get full input stats and facts

GATHERERS = Gatherers()   # name -> (fn(probe) -> dict | None, always)
gatherer: Callable[..., Callable] = GATHERERS.register


def count(mask: torch.Tensor) -> int:
    return int(N._scalar(aten.sum.default(mask)))


class Probe(ProbeBase):
    """The call whose semantics matter for an origin: the origin op itself, or the forward op of a
    backward origin whose inputs were kept. ``facts`` holds what earlier gatherers found."""

    def __init__(self, ev: "Evidence", func, name, args, kwargs, rel, t0, pos0, stage, fwd_idx) -> None:
        self.ev, self.log = ev, ev.log
        self.func, self.name, self.args, self.kwargs, self.rel = func, name, args, kwargs, rel
        self.t0, self.pos0, self.stage, self.fwd_idx = t0, pos0, stage, fwd_idx
        self.e_func, self.e_name, self.e_args, self.e_kwargs, self.e_pos = func, name, args, kwargs, pos0
        kept = self.examine(stage, fwd_idx, ev.log.keep)
        if kept is not None:
            self.e_func, self.e_args, self.e_kwargs = kept
            self.e_name, self.e_pos = opname(self.e_func), None
        self.family = families.family_of(self.e_name)
        self.ftens = [a for _k, _p, a in flat_tensors(self.e_args, self.e_kwargs) if a.dtype.is_floating_point]

    def pick(self, v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            p = self.e_pos
            return v[p] if p is not None and p < len(v) else None
        return v

    def arg(self, i: int, kw: str | None = None) -> Any:
        """The examined call's argument ``i`` (or keyword ``kw``), this output's element of a list."""
        if i < len(self.e_args):
            return self.pick(self.e_args[i])
        return self.pick(self.e_kwargs.get(kw)) if kw else None

    @property
    def x(self) -> Any:
        return self.arg(0, "self")


class Evidence:
    """Describes origins (op, line, module, inputs, facts) from the op log and the provenance."""

    def __init__(self, log: OpLog, prov: Provenance, frames: Frames, api_stack: list, mutations: Mutations) -> None:
        self.log, self.prov, self.frames, self.api_stack = log, prov, frames, api_stack
        self.opchecks = OpChecks(log, prov, mutations)

    # ------------------------------------------------------------------ origin description
    def first_use(self, func: Any, name: str, args: Sequence[Any], out: torch.Tensor, stage: str,
                  module: str | None) -> dict:
        """Where a pre-existing non-finite tensor first enters the step (sample rows, source rows)."""
        fr = self.frames.user_frame()
        d: dict[str, Any] = {"op": str(func), "stage": stage, "file": fr[0] if fr else None,
                             "line": fr[1] if fr else None, "function": fr[2] if fr else None,
                             "module": module, "samples": N.bad_rows(out), "source_rows": [],
                             "out_dim0": int(out.shape[0]) if out.dim() else None}
        try:
            if name in INDEX.ops and d["samples"]:
                index = None
                if name == "index" and len(args) > 1 and isinstance(args[1], (list, tuple)) and args[1]:
                    index = args[1][0]
                elif name == "index_select" and len(args) > 2 and args[1] == 0:
                    index = args[2]
                elif name in ("embedding", "take") and len(args) > 1:
                    index = args[1]
                if isinstance(index, torch.Tensor):
                    if index.dtype == torch.bool:
                        index = aten.select.int(aten.nonzero.default(index), 1, 0)
                    if not index.dtype.is_floating_point and index.dim() >= 1:
                        flat = index if index.dim() == 1 else aten.reshape.default(index, [index.shape[0], -1])[:, 0]
                        d["source_rows"] = source_rows(flat, d["samples"])
        except Exception as e:
            d["source_rows_error"] = str(e)[:100]
        return d

    def describe(self, o: Origin, func, name, args, kwargs, ins, scal, results, stage, module, api,
                 module_type) -> None:
        """Fill ``o.detail``: the op, its line and module, for a backward op its autograd node and
        forward op, the output counts, input statistics and the facts (first origins only)."""
        log = self.log
        bad = [(pos, t, nan, inf) for pos, t, nan, inf in results if nan or inf]
        pos0, t0 = bad[0][0], bad[0][1]
        fr, lib = self.frames.site_now()
        d: dict[str, Any] = {"op": str(func), "name": name, "api": api, "module": module, "stage": stage,
                             "file": fr[0] if fr else None, "line": fr[1] if fr else None,
                             "function": fr[2] if fr else None, "dtype": N.dtype_name(t0.dtype),
                             "shape": list(t0.shape), "positions": [p for p, *_ in bad if p is not None][:10],
                             "autograd_node": None, "module_type": module_type}
        fwd_idx = None
        if stage == "backward":
            try:
                node = torch._C._current_autograd_node()
            except Exception:
                node = None
            if node is not None and (not isinstance(node, _CUSTOM) or node.name() == _MODULE_HOOK) \
                    and self.frames.called_back(sys._getframe(1)):
                # a hook the user registered (on a tensor: run before the node of the op that made it; on a module:
                # torch's own Function around it): the op is the user's, at the hook's line, not a step of that
                # node's backward formula
                d["hook"] = node.name()
                node = None
            ffr = None
            if node is not None:
                d["autograd_node"] = node.name()
                custom = isinstance(node, _CUSTOM)  # a torch.autograd.Function: its backward is the user's code
                if custom:
                    d["custom_backward"] = True
                try:
                    md = node.metadata
                    fwd_idx = md.get("nanguard_fwd")
                    ffr = self.frames.from_traceback(md.get("traceback_"))
                except Exception:
                    pass
            if fwd_idx is not None and fwd_idx < len(log):
                d["forward_idx"] = fwd_idx
                if d.get("custom_backward"):  # named by the Function's call (its apply), not an op of its forward
                    ffr = log.applied_at.get(fwd_idx) or ffr
                d["forward_op"] = str(log.func[fwd_idx])
                d["forward_name"] = log.name[fwd_idx]
                d["forward_module"] = log.module[fwd_idx]
                if fwd_idx in log.root_type and not d.get("module_type"):
                    d["module_type"] = log.root_type[fwd_idx]  # a top-level module: which one
                d["forward_api"] = log.api[fwd_idx]
                if ffr is None:
                    ffr = log.frame[fwd_idx]
                lib = log.lib.get(fwd_idx)
            else:
                lib = None
            if ffr is not None:
                d["forward_file"], d["forward_line"], d["forward_function"] = ffr
        if lib is not None:  # the op ran inside an installed library called from the user's line
            d["library"] = {"file": lib[0], "line": lib[1], "function": lib[2]}
        d["output"] = N.nonfinite_counts(t0)
        d["samples"] = N.bad_rows(t0)
        mask = self.prov.take_escaped_mask()
        if mask is not None:
            d["mask_escape"] = mask_escape_detail(mask)
        o.detail = d
        if o.seq >= _MAX_DETAILED:
            return
        rel = [i for i in ins if pos0 is None or i[1] is None or i[1] == pos0]
        d["inputs"] = []
        for i in rel[:6]:
            st = N.tensor_stats(i[2])
            st["arg"] = i[0] if i[1] is None else f"{i[0]}[{i[1]}]"
            d["inputs"].append(st)
        d["scalars"] = [jnum(v) for _k, p, v in scal if pos0 is None or p is None or p == pos0][:6]
        try:
            own = d.get("custom_backward")  # the user's backward code: the op examined on its own inputs
            d["facts"] = self.facts(func, name, args, kwargs, rel, t0, pos0, "forward" if own else stage,
                                    None if own else fwd_idx)
        except Exception as e:
            d["facts"] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}

    def facts(self, func, name, args, kwargs, rel, t0, pos0, stage, fwd_idx) -> dict:
        """Run the gatherers that apply to the examined op (see the module docstring)."""
        return GATHERERS.run(Probe(self, func, name, args, kwargs, rel, t0, pos0, stage, fwd_idx))

    # ------------------------------------------------------------------ helpers for gatherers
    def producer_chain(self, t: Any, depth: int = 3) -> list[int]:
        return self.log.chain_from(self.prov.producer(t), depth)

    def eps_constants(self, tensors: list[torch.Tensor]) -> list[dict]:
        """Small constants added to (or clamped into) the inputs right before they reached the op."""
        out = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                continue
            for p in self.producer_chain(t, depth=2):
                nm = self.log.name[p]
                if nm in EPS_PRODUCER.ops:
                    for c in self.log.scalars[p]:
                        if isinstance(c, (int, float)) and not isinstance(c, bool) and c != 0 and abs(c) < 1e-2:
                            f = N.eps_fact(float(c), t.dtype)
                            f["op"] = str(self.log.func[p])
                            out.append(f)
        return out[:10]

    def kl_facts(self) -> dict | None:
        """The target of an enclosing F.kl_div call: log-probabilities given with log_target=False?"""
        for nm, a, k in reversed(self.api_stack):
            if nm.endswith("kl_div"):
                inp = a[0] if len(a) > 0 else k.get("input")
                tgt = a[1] if len(a) > 1 else k.get("target")
                log_target = k.get("log_target", a[5] if len(a) > 5 else False)
                if not isinstance(tgt, torch.Tensor):
                    return {"log_target": bool(log_target)}
                tg = tgt.detach()
                st = N.tensor_stats(tg)
                d = {"log_target": bool(log_target), "target_min": st.get("min"), "target_max": st.get("max"),
                     "target_negatives": st.get("negatives"), "target_all_le_0": st.get("max") is not None and
                     isinstance(st.get("max"), float) and st["max"] <= 0}
                try:
                    if tg.dim() >= 1 and tg.dtype.is_floating_point:
                        lse = aten.logsumexp.default(aten._to_copy.default(tg, dtype=torch.float64), [-1])
                        dev = N._scalar(aten.max.default(aten.abs.default(lse)))
                        d["target_rows_logsumexp_max_abs"] = jnum(dev)
                        ssum = aten.sum.dim_IntList(aten._to_copy.default(tg, dtype=torch.float64), [-1])
                        d["target_rows_sum_max_dev_from_1"] = jnum(
                            N._scalar(aten.max.default(aten.abs.default(aten.sub.Scalar(ssum, 1.0)))))
                        d["target_looks_like_log_probs"] = bool(d["target_all_le_0"] and abs(dev) < 1e-3)
                except Exception:
                    pass
                if isinstance(inp, torch.Tensor):
                    ist = N.tensor_stats(inp.detach())
                    d["input_min"], d["input_max"] = ist.get("min"), ist.get("max")
                return d
        return None

    def where_trap(self, fwd_idx: int) -> bool:
        """True when the forward op's output only reached where/masked_fill-like selections (through views):
        the forward discarded the bad entries, but their gradient (0 from the selection) still flows into
        the op's backward, where 0 * inf or 0/0 gives NaN (:meth:`~nanguard.core.locate.oplog.OpGraph.where_trap`)."""
        return self.log.where_trap(fwd_idx)


# ---------------------------------------------------------------------------- generic gatherers (every origin)
@gatherer("float64_check", always=True)
def _float64(p: Probe) -> dict:
    """The origin op in float64 (still non-finite: a domain error; finite: the dtype ran out), and the
    examined forward op of a backward origin (its float64 re-run and its output statistics)."""
    rr = p.ev.opchecks
    f = {"float64_check": rr.check_fact(p.func, p.args, p.kwargs, torch.float64, p.pos0)}
    if p.e_func is not p.func:
        f["forward_float64_check"] = rr.check_fact(p.e_func, p.e_args, p.e_kwargs, torch.float64, None)
        fo = rr.recompute(p.e_func, p.e_args, p.e_kwargs, p.ftens[0].dtype if p.ftens else p.t0.dtype, None) \
            if p.ftens else []
        if fo:
            f["forward_output"] = N.tensor_stats(fo[0])
    return f


@gatherer("float32_check", always=True)
def _float32(p: Probe) -> dict | None:
    if p.t0.dtype in N.LOW_PRECISION and p.stage != "backward":
        return {"float32_check": p.ev.opchecks.float32_chain(p.func, p.args, p.kwargs, p.pos0, p.rel)}
    return None


@gatherer("dtype_info", always=True)
def _dtype_info(p: Probe) -> dict:
    return {"dtype_info": N.finfo_facts(p.t0.dtype)}


@gatherer("producers", always=True)
def _producers(p: Probe) -> dict:
    return {"producers": [[p.log.name[i] for i in p.ev.producer_chain(a, depth=3)] for a in p.ftens[:4]]}


@gatherer("eps_constants", always=True)
def _eps(p: Probe) -> dict | None:
    eps = p.ev.eps_constants(p.ftens)
    return {"eps_constants": eps} if eps else None


# ---------------------------------------------------------------------------- per-family gatherers
@gatherer("log_domain")
def _log_domain(p: Probe) -> dict | None:
    """Inputs at or below the log's limit (0; -1 for log1p), read from the family's declared domain."""
    dom = p.family.domain_for(p.e_name)
    src = p.arg(dom.arg, dom.kwarg)
    if not isinstance(src, torch.Tensor):
        return None
    lim = dom.limit
    d = {"le_limit": count(aten.le.Scalar(src, lim)), "limit": lim, "zeros": count(aten.eq.Scalar(src, 0)),
         "negatives": count(aten.lt.Scalar(src, 0)), "min": N.tensor_stats(src).get("min"), "numel": int(src.numel())}
    if p.stage == "forward" and torch.is_grad_enabled() and not src.requires_grad:
        d["no_grad_input"] = True  # in a training forward, nothing trainable made it: data (an exposure, a count)
    return {"log_domain": d}


@gatherer("sqrt_domain")
def _sqrt_domain(p: Probe) -> dict | None:
    x = p.x
    if not (isinstance(x, torch.Tensor) and x.dtype.is_floating_point):
        return None
    d = {"zeros": count(aten.eq.Scalar(x, 0)), "negatives": count(aten.lt.Scalar(x, 0)), "numel": int(x.numel())}
    if p.in_family("pow"):
        ex = p.arg(1, "exponent")
        if isinstance(ex, (int, float)):
            d["exponent"] = jnum(ex)
            d["fractional"] = float(ex) != int(float(ex)) if math.isfinite(float(ex)) else False
        elif isinstance(ex, torch.Tensor) and ex.dtype.is_floating_point:
            # element-wise exponents: a negative base under a non-integer exponent is NaN
            # (the sqrt-like domain), a zero base under a negative one is 1/0
            non_int = aten.ne.Tensor(ex, aten.floor.default(ex))
            d["neg_base_fractional_exp"] = count(aten.logical_and.default(aten.lt.Scalar(x, 0), non_int))
            d["zero_base_negative_exp"] = count(aten.logical_and.default(aten.eq.Scalar(x, 0), aten.lt.Scalar(ex, 0)))
            d["fractional"] = d["neg_base_fractional_exp"] > 0
            d["exponent_range"] = [N.tensor_stats(ex).get("min"), N.tensor_stats(ex).get("max")]
    if p.in_family("norm") and "forward_output" in p.facts:
        d["norm_zeros"] = p.facts["forward_output"].get("zeros")
    return {"sqrt_domain": d}


@gatherer("trig_domain")
def _trig_domain(p: Probe) -> dict | None:
    x = p.x
    if not isinstance(x, torch.Tensor):
        return None
    ax = aten.abs.default(x)
    # lt_1 was acosh's count before acosh got its own family ("domain" evidence); kept for the fact's shape
    return {"trig_domain": {"abs_ge_1": count(aten.ge.Scalar(ax, 1.0)), "abs_gt_1": count(aten.gt.Scalar(ax, 1.0)),
                            "lt_1": None, "max_abs": N.tensor_stats(x).get("max_abs"), "numel": int(x.numel())}}


@gatherer("exp_input")
def _exp_input(p: Probe) -> dict | None:
    """The exponent's max against log(dtype max): exp's input, or pow's element-wise exponents."""
    x = p.x
    pow_ = p.in_family("pow")
    if not isinstance(x, torch.Tensor) or (pow_ and not isinstance(p.arg(1, "exponent"), torch.Tensor)):
        return None
    src = p.arg(1, "exponent") if pow_ else x
    st = N.tensor_stats(src)
    return {"exp_input_max": st.get("max"), "exp_input_min": st.get("min"),
            "overflow_threshold": jnum(math.log(torch.finfo(src.dtype).max))}


@gatherer("zero_denominator")
def _zero_denominator(p: Probe) -> dict:
    e_name, e_args, pick = p.e_name, p.e_args, p.pick
    if e_name in ("reciprocal", "_foreach_reciprocal"):
        num, den = 1.0, pick(e_args[0]) if e_args else None
    elif e_name in ("addcdiv", "_foreach_addcdiv"):
        num = pick(e_args[1]) if len(e_args) > 1 else None
        den = pick(e_args[2]) if len(e_args) > 2 else None
    else:
        num = pick(e_args[0]) if e_args else None
        den = pick(e_args[1]) if len(e_args) > 1 else None
    d: dict[str, Any] = {}
    if isinstance(den, (int, float)):
        d["scalar_denominator"] = jnum(den)
        d["zeros"] = int(den == 0)
        return {"zero_denominator": d}
    if not isinstance(den, torch.Tensor):
        return {"zero_denominator": d}
    dz = aten.eq.Scalar(den, 0)
    d["zeros"] = count(dz)
    d["numel"] = int(den.numel())
    if isinstance(num, torch.Tensor):
        try:
            nz = aten.eq.Scalar(num, 0)
            both = aten.logical_and.default(dz, nz)
            d["zero_over_zero"] = count(both)
            d["nonzero_over_zero"] = count(aten.logical_and.default(dz, aten.logical_not.default(nz)))
        except Exception:
            pass
    names = [p.log.name[i] for i in p.ev.producer_chain(den, depth=3)]
    d["producer_chain"] = names[:6]
    real = [n for n in names if n not in VIEW.ops]
    d["from_reduction"] = bool(real) and real[0] in REDUCE.ops
    d["from_std_var"] = any(n in families.ops_of("stdvar") for n in real[:3])
    d["min"] = N.tensor_stats(den).get("min")
    try:  # whole numbers, at least one >= 1: a count (bincount(...).float(), a sum of a mask) whatever made it
        if den.is_floating_point() and den.numel() >= 2:
            fin = den[aten.isfinite.default(den)]
            d["whole"] = bool(fin.numel() and bool(aten.eq.Tensor(fin, aten.round.default(fin)).all())
                              and float(fin.max()) >= 1)
    except Exception:
        pass
    return {"zero_denominator": d}


@gatherer("softmax_all_masked_rows")
def _softmax_rows(p: Probe) -> dict | None:
    x, dim = p.x, p.arg(1, "dim")
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int):
        return None
    allm = aten.all.dim(aten.eq.Scalar(x, float("-inf")), dim)
    return {"softmax_all_masked_rows": {
        "count": count(allm), "batch_rows": N.mask_rows(allm, limit=64), "rows_total": int(allm.numel()),
        "dim0": int(allm.shape[0]) if allm.dim() else None,
        "rows_with_neginf": count(aten.any.dim(aten.eq.Scalar(x, float("-inf")), dim))}}


@gatherer("attn_mask_rows")
def _attention_rows(p: Probe) -> dict | None:
    """Fused attention with NaN out: queries whose attn_mask blocks every key."""
    if not N.nonfinite_counts(p.t0)["nan"]:
        return None
    mask = p.e_kwargs.get("attn_mask")
    if mask is None:
        mask = next((a for a in p.e_args[3:5] if isinstance(a, torch.Tensor)), None)
    if not isinstance(mask, torch.Tensor) or mask.dim() < 1:
        return None
    blocked = aten.logical_not.default(mask) if mask.dtype == torch.bool else aten.eq.Scalar(mask, float("-inf"))
    allm = aten.all.dim(blocked, -1)
    return {"softmax_all_masked_rows": {"count": count(allm), "batch_rows": N.mask_rows(allm, limit=64),
                                        "rows_total": int(allm.numel()), "from": "attn_mask",
                                        "dim0": int(allm.shape[0]) if allm.dim() else None}}


@gatherer("std_var")
def _std_var(p: Probe) -> dict | None:
    """n elements per reduction against the correction (n - correction <= 0 is NaN)."""
    x, args, kwargs = p.x, p.e_args, p.e_kwargs
    if not isinstance(x, torch.Tensor):
        return None
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    corr = kwargs.get("correction", None)
    unbiased = None
    if len(args) > 2 and isinstance(args[2], bool):
        unbiased = args[2]
    if "unbiased" in kwargs:
        unbiased = kwargs["unbiased"]
    if corr is None:
        corr = 1 if unbiased is None or unbiased else 0
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        n = int(x.numel())
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        n = 1
        for d in dims:
            n *= int(x.shape[d]) if x.dim() else 1
    corr = float(corr)
    return {"std_var": {"n": n, "correction": jnum(corr), "n_minus_correction": jnum(n - corr),
                        "degenerate": n - corr <= 0}}


_CMP = {"le": aten.le.Scalar, "lt": aten.lt.Scalar, "ge": aten.ge.Scalar, "gt": aten.gt.Scalar}


@gatherer("domain")
def _domain(p: Probe) -> dict | None:
    """Generic: the inputs inside the family's declared ``Domain`` (value and gradient sets)."""
    dom = p.family.domain_for(p.e_name) if p.family is not None else None
    src = p.arg(dom.arg, dom.kwarg) if dom is not None else None
    if not isinstance(src, torch.Tensor) or not src.dtype.is_floating_point:
        return None
    v = aten.abs.default(src) if dom.abs else src
    st = N.tensor_stats(src)
    return {"domain": {"condition": dom.text(), "grad_condition": dom.text(grad=True), "arg": dom.kwarg,
                       "inside": count(_CMP[dom.cmp](v, dom.limit)),
                       "grad_inside": count(_CMP[dom.grad_cmp or dom.cmp](v, dom.limit)),
                       "numel": int(src.numel()), "min": st.get("min"), "max": st.get("max")}}


# ---------------------------------------------------------------------------- generic gatherers (after the family's)
@gatherer("overflow", always=True)
def _overflow(p: Probe) -> dict | None:
    """Infinities only, from finite inputs, that float64 (or float32 for low precision) would hold."""
    outc = N.nonfinite_counts(p.t0)
    f = p.facts
    range_ok = f["float64_check"].get("finite") or (f.get("float32_check") or {}).get("direct_finite")
    if (outc["posinf"] or outc["neginf"]) and not outc["nan"] and range_ok:
        return {"overflow": {"dtype_max": jnum(torch.finfo(p.t0.dtype).max),
                             "input_max_abs": max([s for s in (N.tensor_stats(i[2]).get("max_abs") for i in p.rel
                                                               if i[2].dtype.is_floating_point)
                                                   if isinstance(s, float)], default=None)}}
    return None


@gatherer("isolated_input", always=True)
def _isolated(p: Probe) -> dict | None:
    """A forward op that ran out of range on finite inputs float64 holds: one input's size in a few batch rows."""
    if p.stage != "forward" or not (p.facts.get("float64_check") or {}).get("finite"):
        return None
    rows = []
    for k, pos, t, *_ in p.rel:
        if t.dtype.is_floating_point and t.dim() and t.shape[0] >= 4 and t.numel() and t.layout == torch.strided \
                and t.device.type != "meta":
            m = aten.amax.default(aten.abs.default(aten.reshape.default(t.detach(), [t.shape[0], -1])), [1])
            rows.append((k if pos is None else f"{k}[{pos}]",
                         aten._to_copy.default(m, dtype=torch.float64, device="cpu").numpy()))
    return AF.isolated_rows(rows)


@gatherer("kl_div", always=True)
def _kl(p: Probe) -> dict | None:
    kl = p.ev.kl_facts()
    return {"kl_div": kl} if kl else None


@gatherer("where_trap", always=True)
def _where_trap(p: Probe) -> dict | None:
    if p.stage == "backward" and p.fwd_idx is not None:
        return {"where_trap": p.ev.where_trap(p.fwd_idx)}
    return None
