"""Evidence facts for an origin op, computed while its inputs are alive: the same ``facts`` names as
the PyTorch recorder, so that ``nanguard.core.diagnosis`` reads them unchanged.

A gatherer is a function of a :class:`Probe` (the examined op) returning facts, or None.
``@gatherer("name")`` registers it: ``always=True`` ones run for every origin (float64/float32
re-runs, dtype info, producers, eps constants, overflow, where-trap), the others only when the
examined op's registry family (``nanguard.core.diagnosis.families``, by its ``tf_ops``) lists the
name in its ``evidence``: ``log_domain``, ``sqrt_domain``, ``trig_domain``, ``exp_input``,
``zero_denominator``, ``softmax_all_masked_rows`` and the generic ``domain`` (the inputs inside the
family's declared ``Domain``). A family that asks for a name no TensorFlow gatherer has (``std_var``:
TensorFlow has no std op) gets nothing for it.

The examined op is the origin op, or for a backward origin the forward op it differentiates, re-run
from its kept inputs (``examined: forward_op``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from ... import array_facts as F
from ...core.diagnosis import families
from ...core.locate.evidence import Gatherers, ProbeBase
from . import numerics as N
from . import ops as O
from .oplog import OpLog, is_eager, numel
from .provenance import Provenance, np_value
from .opcheck import check_fact, recompute, recompute32

__all__ = ["gatherer", "GATHERERS", "Probe", "facts", "where_trap", "producer_chain"]

GATHERERS = Gatherers()   # name -> (fn(probe) -> dict | None, always)
gatherer: Callable[..., Callable] = GATHERERS.register


class Probe(ProbeBase):
    """The origin op (``t_op`` with ``inputs``/``attrs``, its bad output ``t0``/``a0`` at ``pos0``) and the
    examined op (``e_op``, ``e_in``...: the kept forward op of a backward origin). ``facts`` holds what
    earlier gatherers found."""

    def __init__(self, log: OpLog, prov: Provenance, t_op: str, inputs: tuple, attrs: Any, outputs: tuple,
                 pos0: int, t0: Any, a0: np.ndarray, stage: str, fwd: Optional[int]) -> None:
        self.log, self.prov = log, prov
        self.t_op, self.inputs, self.attrs, self.n_out = t_op, inputs, attrs, len(outputs)
        self.pos0, self.t0, self.a0, self.stage, self.fwd = pos0, t0, a0, stage, fwd
        self.e_op, self.e_in, self.e_attrs, self.e_nout = t_op, inputs, attrs, self.n_out
        kept = self.examine(stage, fwd, log.keep)
        if kept is not None:
            self.e_op, self.e_in, self.e_attrs, self.e_nout = kept
        self.family = families.family_of(self.e_op)
        self.ftens = [x for x in self.e_in if is_eager(x) and x.dtype.is_floating]
        self.pick = pos0 if self.n_out > 1 else None

    def arg(self, i: int) -> Any:
        return self.e_in[i] if i < len(self.e_in) else None

    def arr(self, i: int) -> Optional[np.ndarray]:
        """The examined op's input ``i`` as a float array (None if not a float tensor)."""
        x = self.arg(i)
        a = np_value(x) if is_eager(x) else None
        return N.as_float(a) if a is not None and a.dtype.kind in "fV" else None


def facts(p: Probe) -> dict:
    """Run the gatherers for ``p`` (always-on ones, then those its family asks for); one that raises
    leaves ``<name>_error`` and the others still run."""
    return GATHERERS.run(p, catch=True)


# ---------------------------------------------------------------------------- producer chains
def producer_chain(log: OpLog, prov: Provenance, t: Any, depth: int = 3) -> list[int]:
    """Op indices that produced ``t``, walking up first inputs (innermost first)."""
    prod = prov.producer(t)
    return log.chain(prod[0] if prod is not None else None, depth)


def _looks_like_variance(log: OpLog, prov: Provenance, t: Any) -> bool:
    """The value comes from a standard deviation / variance: a Mean/Sum of squared deviations
    (``tf.math.reduce_std``, ``tf.nn.moments``, a hand-written ``mean((x - m) ** 2)``), possibly under a
    Sqrt and an added eps."""
    chain = [log.op_type[i] for i in producer_chain(log, prov, t, depth=6) if log.op_type[i] not in O.PASS_OPS]
    for k, name in enumerate(chain[:5]):
        if name in ("Mean", "Sum") and k + 1 < len(chain) and chain[k + 1] in ("SquaredDifference", "Square", "Pow"):
            return True
        if name not in _ON_A_VARIANCE:  # sum(exp(-g * sum((x - c) ** 2))): a sum of squares under an exp is no variance
            return False
    return False


# what may stand between a variance and the division by it: its eps, root, scale, cast
_ON_A_VARIANCE = frozenset({"Sqrt", "Rsqrt", "AddV2", "Add", "Maximum", "Mul", "RealDiv", "Div", "Cast", "Mean",
                            "Sum"})


def _eps_constants(log: OpLog, prov: Provenance, tensors: list) -> list[dict]:
    """Small constants added (or clamped in) right before the op, against the dtype of the value."""
    out = []
    for t in tensors:
        if not is_eager(t) or not t.dtype.is_floating:
            continue
        dn = t.dtype.name
        for p in producer_chain(log, prov, t, depth=2):
            nm = log.op_type[p]
            if nm not in O.EPS_PRODUCERS:
                continue
            for _pos, c in log.op_scalars[p]:
                if c != 0 and abs(c) < 1e-2:
                    f = N.eps_fact(float(c), dn)
                    f["op"] = nm
                    out.append(f)
                elif c == 0 and nm in ("AddV2", "Add") and dn in N.LOW_PRECISION:
                    # x + 1e-8 in float16: the Python constant was converted to the dtype (0) before the add
                    f = N.eps_fact(0.0, dn)
                    f.update(op=nm, rounds_to_zero=True, stored_as_zero=True,
                             note=f"a constant added before the op is exactly 0 in {dn} (an eps that rounded to 0)")
                    out.append(f)
    return out[:10]


def where_trap(log: OpLog, fwd_idx: int) -> bool:
    """True when the forward op's output only reached selections (``tf.where``, clipping, gathers,
    through pass-through ops): the forward discarded the bad entries, but their zero gradient still
    flows into the op's backward, where 0 * inf or 0/0 gives NaN
    (:meth:`~nanguard.core.locate.oplog.OpGraph.where_trap`)."""
    return log.where_trap(fwd_idx)


# ---------------------------------------------------------------------------- generic gatherers (every origin)
@gatherer("float64_check", always=True)
def _float64(p: Probe) -> dict:
    """The origin op in float64 (still non-finite: a domain error; finite: the dtype ran out), and the
    examined forward op of a backward origin (its float64 re-run and its output statistics)."""
    f = {"float64_check": check_fact(p.t_op, p.inputs, p.attrs, p.n_out, tf.float64, p.pick)}
    if p.e_op is not p.t_op or p.e_in is not p.inputs:
        f["forward_float64_check"] = check_fact(p.e_op, p.e_in, p.e_attrs, p.e_nout, tf.float64, None)
        try:
            fo = recompute(p.e_op, p.e_in, p.e_attrs, p.e_nout, p.ftens[0].dtype) if p.ftens else []
            if fo:
                f["forward_output"] = N.tensor_stats(np_value(fo[0]), fo[0].dtype.name)
        except Exception:
            pass
    return f


@gatherer("float32_check", always=True)
def _float32(p: Probe) -> Optional[dict]:
    """float16/bfloat16 origins: the op in float32 directly, and with its low-precision producers
    recomputed in float32 (``chain_finite``: the whole chain is fine in float32)."""
    if p.t0.dtype.name not in N.LOW_PRECISION or p.stage == "backward":
        return None
    direct = check_fact(p.t_op, p.inputs, p.attrs, p.n_out, tf.float32, p.pick)
    chain_ops: list = []
    subst = {}
    for x in p.inputs:
        if is_eager(x) and x.dtype.is_floating and x.dtype.name in N.LOW_PRECISION:
            subst[id(x)] = recompute32(p.log, p.prov, x, 4, chain_ops)
    chain = check_fact(p.t_op, p.inputs, p.attrs, p.n_out, tf.float32, p.pick, subst)
    return {"float32_check": {"direct_finite": direct.get("finite"), "chain_finite": chain.get("finite"),
                              "chain_ops": chain_ops[:10], "max_abs": direct.get("max_abs")}}


@gatherer("dtype_info", always=True)
def _dtype_info(p: Probe) -> dict:
    return {"dtype_info": N.finfo_facts(p.t0.dtype.name)}


@gatherer("producers", always=True)
def _producers(p: Probe) -> dict:
    return {"producers": [[p.log.op_canon[i] for i in producer_chain(p.log, p.prov, a, depth=3)]
                          for a in p.ftens[:4]]}


@gatherer("eps_constants", always=True)
def _eps(p: Probe) -> Optional[dict]:
    eps = _eps_constants(p.log, p.prov, p.ftens)
    return {"eps_constants": eps} if eps else None


# ---------------------------------------------------------------------------- per-family gatherers
def _domain_of(p: Probe):
    return p.family.domain_for(O.canonical(p.e_op)) if p.family is not None else None


@gatherer("log_domain")
def _log_domain(p: Probe) -> Optional[dict]:
    """The log's argument (``Xlogy``'s second input) against the family's limit (0, or -1 for log1p)."""
    dom = _domain_of(p)
    if dom is None:
        return None
    sa = p.arr(dom.arg)
    return F.log_domain(sa, dom.limit) if sa is not None else None


@gatherer("sqrt_domain")
def _sqrt_domain(p: Probe) -> Optional[dict]:
    """Zeros and negatives under a root, a norm or a power (with the exponent)."""
    xf = p.arr(0)
    if xf is None:
        return None
    d = F.root_counts(xf)
    if p.in_family("pow"):
        x1 = p.arg(1)
        ex = np_value(x1) if is_eager(x1) else None
        d.update(F.pow_exponent(xf, N.as_float(ex) if ex is not None and ex.dtype.kind in "fV" else ex))
    if p.in_family("norm") and "forward_output" in p.facts:
        d["norm_zeros"] = p.facts["forward_output"].get("zeros")
    return {"sqrt_domain": d}


@gatherer("trig_domain")
def _trig_domain(p: Probe) -> Optional[dict]:
    xf = p.arr(0)
    return F.trig_domain(xf) if xf is not None else None


@gatherer("exp_input")
def _exp_input(p: Probe) -> Optional[dict]:
    """The exponent's max against log(dtype max): exp's input, or pow's element-wise exponents."""
    pow_ = p.in_family("pow")
    x, src_t = p.arg(0), (p.arg(1) if pow_ else p.arg(0))
    if not is_eager(x) or not is_eager(src_t) or (pow_ and numel(src_t) <= 1):
        return None
    return F.exp_input(_widened(np_value(src_t)), N.dtype_max(src_t.dtype.name))


@gatherer("zero_denominator")
def _zero_denominator(p: Probe) -> Optional[dict]:
    e_in = p.e_in
    if O.canonical(p.e_op) == "reciprocal":
        num, den = None, e_in[0] if e_in else None
    else:
        num = e_in[0] if e_in else None
        den = e_in[1] if len(e_in) > 1 else None
    da = np_value(den) if is_eager(den) else None
    if da is None:
        return {"zero_denominator": {}}
    na = np_value(num) if is_eager(num) else None
    d = F.denominator_counts(_widened(na), _widened(da))
    chain = producer_chain(p.log, p.prov, den, depth=3)
    names = [p.log.op_type[i] for i in chain]
    d["producer_chain"] = [p.log.op_canon[i] for i in chain][:6]
    d["producer_chain_tf"] = names[:6]
    real = [n for n in names if n not in O.PASS_OPS]
    d["from_reduction"] = bool(real) and real[0] in O.REDUCE_OPS
    d["from_std_var"] = _looks_like_variance(p.log, p.prov, den)
    return {"zero_denominator": d}


def _widened(a: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Floats read as numpy floats (bfloat16 and friends in float32); other arrays as they are."""
    return N.as_float(a) if a is not None and a.dtype.kind in "fV" else a


@gatherer("softmax_all_masked_rows")
def _softmax_rows(p: Probe) -> Optional[dict]:
    xf = p.arr(0)
    return F.masked_softmax_rows(xf) if xf is not None else None


@gatherer("domain")
def _domain(p: Probe) -> Optional[dict]:
    """Generic: the inputs inside the family's declared ``Domain`` (value and gradient sets)."""
    dom = _domain_of(p)
    src = p.arr(dom.arg) if dom is not None else None
    return F.domain(dom, src) if src is not None else None


# ---------------------------------------------------------------------------- generic gatherers (after the family's)
@gatherer("overflow", always=True)
def _overflow(p: Probe) -> Optional[dict]:
    """Infinities only, from finite inputs, that a wider dtype holds."""
    range_ok = (p.facts.get("float64_check") or {}).get("finite") or \
        (p.facts.get("float32_check") or {}).get("direct_finite")
    mx = (N.tensor_stats(np_value(i)).get("max_abs") for i in p.inputs if is_eager(i) and i.dtype.is_floating)
    return F.overflow(N.nonfinite_counts(p.a0), range_ok, mx, N.dtype_max(p.t0.dtype.name))


@gatherer("isolated_input", always=True)
def _isolated(p: Probe) -> Optional[dict]:
    """A forward op that ran out of range on finite inputs float64 holds: one input's size in a few batch rows."""
    if p.stage != "forward" or not (p.facts.get("float64_check") or {}).get("finite"):
        return None
    return F.isolated_rows((k, F.row_max_abs(N.as_float(np_value(i)))) for k, i in enumerate(p.inputs)
                           if is_eager(i) and i.dtype.is_floating)


@gatherer("where_trap", always=True)
def _where_trap(p: Probe) -> Optional[dict]:
    if p.stage == "backward" and p.fwd is not None:
        return {"where_trap": where_trap(p.log, p.fwd)}
    return None
