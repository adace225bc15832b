"""Evidence facts for a JAX origin: the same ``facts`` names as the other backends' gatherers, so that
``nanguard.core.diagnosis`` reads them unchanged.

The probe holds the origin equation with its input values and, for a backward origin, the forward
equation it differentiates (``examined``: ``forward_op``). Gatherers registered ``always=True`` run for
every origin (the float64 / float32 re-runs of the equation, dtype facts, producers, eps constants,
overflow, where-trap); the others when the examined op's family lists them (``log_domain``,
``sqrt_domain``, ``trig_domain``, ``exp_input``, ``zero_denominator``, ``softmax_all_masked_rows``,
the generic ``domain``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, List, Optional

import numpy as np

from ... import array_facts as F
from ...core.diagnosis import families
from ...core.locate.evidence import Gatherers, ProbeBase
from . import numerics as N
from . import ops as O
from .replay import bind

__all__ = ["GATHERERS", "gatherer", "Probe", "facts", "recompute"]

GATHERERS = Gatherers()
gatherer: Callable[..., Callable] = GATHERERS.register


def recompute(eqn: Any, vals: List[Any], dtype: Any) -> List[np.ndarray]:
    """Bind ``eqn`` again with its floating inputs cast to ``dtype`` (float64 under ``jax.enable_x64``)."""
    import jax
    import jax.numpy as jnp
    with jax.enable_x64(True):
        cast = [jnp.asarray(N.host(v).astype(dtype)) if N.is_float(v) else v for v in vals]
        params = {}
        for key in ("new_dtype", "preferred_element_type"):
            v = eqn.params.get(key)
            if v is not None and np.dtype(v).kind == "f":
                params[key] = np.dtype(dtype)
        return [N.host(o) for o in bind(eqn, cast, params)]


def check_fact(eqn: Any, vals: List[Any], dtype: Any, pos: Optional[int]) -> dict:
    """{op, dtype, finite, max_abs} of the re-run (or {error})."""
    try:
        outs = recompute(eqn, vals, dtype)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    if pos is not None and 0 <= pos < len(outs):
        outs = [outs[pos]]
    outs = [o for o in outs if o is not None and o.dtype.kind == "f"]
    if not outs:
        return {"error": "no floating output"}
    fin = all(bool(np.isfinite(o).all()) for o in outs)
    mxs = [N.stats(o).get("max_abs") for o in outs]
    mx = max((m for m in mxs if isinstance(m, float)), default=None)
    return {"op": eqn.primitive.name, "dtype": np.dtype(dtype).name, "finite": fin, "max_abs": mx}


class Probe(ProbeBase):
    """The origin equation (``eqn``, input values ``ins``, bad output ``a0`` at ``pos``, dtype) and the
    examined one (``e_op``/``e_in``/``e_eqn``: the forward op of a backward origin when kept)."""

    def __init__(self, replay: Any, idx: int, eqn: Any, ins: List[Any], out: Any, pos: int, stage: str,
                 fwd: Optional[int], canon: str, fwd_canon: Optional[str]) -> None:
        self.rp, self.idx, self.eqn, self.ins, self.pos, self.stage, self.fwd = replay, idx, eqn, ins, pos, stage, fwd
        self.a0 = N.host(out)
        self.dtype = str(getattr(out, "dtype", ""))
        self.t_op = canon
        self.e_op, self.e_in, self.e_eqn = canon, ins, eqn
        keep = {fwd: (fwd_canon, replay.log.inputs[fwd], replay.log.eqns[fwd])} \
            if fwd is not None and fwd in replay.log.inputs else {}
        kept = self.examine(stage, fwd, keep)
        if kept is not None:
            self.e_op, self.e_in, self.e_eqn = kept
        self.family = families.family_of(self.e_op)

    def arr(self, i: int) -> Optional[np.ndarray]:
        """The examined op's input ``i`` as a float array (None if not floating)."""
        if i >= len(self.e_in) or not N.is_float(self.e_in[i]):
            return None
        return N.host(self.e_in[i])


def facts(p: Probe) -> dict:
    return GATHERERS.run(p, catch=True)


# ---------------------------------------------------------------------------- every origin
@gatherer("float64_check", always=True)
def _float64(p: Probe) -> dict:
    f = {"float64_check": check_fact(p.eqn, p.ins, np.float64, p.pos)}
    if p.e_eqn is not p.eqn:
        f["forward_float64_check"] = check_fact(p.e_eqn, p.e_in, np.float64, None)
        try:
            fo = recompute(p.e_eqn, p.e_in, np.float32)
            if fo and fo[0] is not None:
                f["forward_output"] = N.stats(fo[0])
        except Exception:
            pass
    return f


@gatherer("float32_check", always=True)
def _float32(p: Probe) -> Optional[dict]:
    """The origin op re-run in float32 on its low-precision inputs (``direct_finite``), and again on its
    inputs recomputed in float32 from their low-precision producers (up to 4 ops back, where the replay
    kept their inputs): ``chain_finite`` says the producers' rounding made the value (``1 - sigmoid(z)``
    that is exactly 0 in bfloat16 and 1e-3 in float32 before a log)."""
    if p.dtype not in N.LOW_PRECISION or p.stage == "backward":
        return None
    direct = check_fact(p.eqn, p.ins, np.float32, p.pos)
    chain_ops: List[str] = []
    prods = p.rp.log.inprod[p.idx] if 0 <= p.idx < len(p.rp.log.inprod) else ()
    ins = [_recompute32(p.rp.log, v, prods[i] if i < len(prods) else -1, 4, chain_ops) for i, v in enumerate(p.ins)]
    chain = check_fact(p.eqn, ins, np.float32, p.pos) if chain_ops else {}
    return {"float32_check": {"direct_finite": direct.get("finite"), "chain_finite": chain.get("finite"),
                              "chain_ops": chain_ops[:10], "max_abs": direct.get("max_abs")}}


def _recompute32(log: Any, val: Any, op: int, depth: int, chain_ops: List[str]) -> Any:
    """``val`` (an output of op ``op``) in float32, recomputed from its producers while they are
    low-precision ops whose inputs the replay kept; a float32 cast of ``val`` where the chain stops."""
    if not N.is_float(val) or str(val.dtype) not in N.LOW_PRECISION:
        return val
    x32 = N.host(val).astype(np.float32)
    if depth <= 0 or op < 0 or op not in log.inputs:
        return x32
    prods = log.inprod[op]
    ins = [_recompute32(log, v, prods[i] if i < len(prods) else -1, depth - (log.names[op] not in log.pass_ops),
                        chain_ops) for i, v in enumerate(log.inputs[op])]
    try:
        outs = recompute(log.eqns[op], ins, np.float32)
    except Exception:
        return x32
    match = [o for o in outs if o is not None and o.shape == x32.shape]
    if len(match) != 1:
        return x32
    chain_ops.append(log.canon[op])
    return match[0]


@gatherer("dtype_info", always=True)
def _dtype_info(p: Probe) -> dict:
    return {"dtype_info": N.finfo_facts(p.dtype)}


def _producer_chains(p: Probe, depth: int = 3) -> List[List[int]]:
    log = p.rp.log
    idx = p.fwd if p.e_eqn is not p.eqn and p.fwd is not None else p.idx
    return [log.chain(q, depth) for q in log.inprod[idx][:4] if q >= 0]


@gatherer("producers", always=True)
def _producers(p: Probe) -> dict:
    log = p.rp.log  # jax.nn.softmax is exp / sum(exp) in the log: named as the op it is, for the rules
    return {"producers": [["_softmax" if O.softmax_output(log, i) else log.canon[i] for i in ch]
                          for ch in _producer_chains(p)]}


@gatherer("eps_constants", always=True)
def _eps(p: Probe) -> Optional[dict]:
    """Small constants added (or clamped in) right before the op, against the op's dtype."""
    log, out = p.rp.log, []
    for ch in _producer_chains(p, 2):
        for i in ch:
            if log.names[i] not in O.EPS_PRODUCERS or i not in log.eqns:
                continue
            from jax._src.core import Literal
            for v in log.eqns[i].invars:
                if isinstance(v, Literal) and np.size(v.val) == 1:
                    c = float(np.asarray(v.val))
                    if c != 0 and abs(c) < 1e-2:
                        out.append({**N.eps_fact(c, p.dtype), "op": log.canon[i]})
                    elif c == 0 and log.names[i] in ("add", "sub"):
                        out += [{**N.eps_fact(w, p.dtype), "op": log.canon[i], "written": True}
                                for w in _rounded_away(log.frame[i], p.dtype)]
    return {"eps_constants": out[:10]} if out else None


def _rounded_away(frame: Any, dtype: str) -> List[float]:
    """The small constants written on the user's line of an ``x + 0`` equation that the dtype rounds to 0.

    JAX converts a Python scalar to the array's dtype when it traces ``p + 1e-8``: in float16 the jaxpr
    holds ``add p 0.0``, the constant already gone. The line's source (read, parsed, never run) still
    has it; only a written non-zero float that is 0 in ``dtype`` is taken."""
    if frame is None or dtype not in N.LOW_PRECISION:
        return []
    import ast
    import linecache
    text = linecache.getline(frame[0], frame[1]).strip()
    try:
        tree = ast.parse(text.rstrip(":") if text.endswith(":") else text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, float) and 0 < abs(node.value) < 1e-2:
            if N.eps_fact(node.value, dtype).get("rounds_to_zero") and node.value not in out:
                out.append(node.value)
    return out


# ---------------------------------------------------------------------------- per family
def _domain_arg(p: Probe) -> tuple:
    """The examined op's declared ``Domain`` and its argument as a float array ((None, None): none)."""
    dom = p.family.domain_for(p.e_op) if p.family is not None else None
    return (dom, p.arr(dom.arg)) if dom is not None else (None, None)


@gatherer("log_domain")
def _log_domain(p: Probe) -> Optional[dict]:
    dom, sa = _domain_arg(p)
    if sa is None:
        return None
    return F.log_domain(sa, dom.limit)


@gatherer("sqrt_domain")
def _sqrt_domain(p: Probe) -> Optional[dict]:
    xf = p.arr(0)
    if xf is None:
        return None
    d = F.root_counts(xf)
    if p.in_family("pow"):
        y = p.e_eqn.params.get("y") if p.e_eqn is not None else None   # integer_pow's exponent
        d.update(F.pow_exponent(xf, np.asarray(float(y)) if y is not None else p.arr(1)))
    if "forward_output" in p.facts:
        d["norm_zeros"] = p.facts["forward_output"].get("zeros")
    return {"sqrt_domain": d}


@gatherer("trig_domain")
def _trig_domain(p: Probe) -> Optional[dict]:
    xf = p.arr(0)
    return F.trig_domain(xf) if xf is not None else None


@gatherer("exp_input")
def _exp_input(p: Probe) -> Optional[dict]:
    src = p.arr(1) if p.in_family("pow") else p.arr(0)
    if src is None or (p.in_family("pow") and src.size <= 1):
        return None
    return F.exp_input(src, N.dtype_max(str(src.dtype)))


@gatherer("zero_denominator")
def _zero_denominator(p: Probe) -> Optional[dict]:
    num, den = p.arr(0), p.arr(1)
    if den is None:
        return {"zero_denominator": {}}
    d = F.denominator_counts(num, den)
    log = p.rp.log
    idx = p.fwd if p.e_eqn is not p.eqn and p.fwd is not None else p.idx
    q = log.inprod[idx][1] if len(log.inprod[idx]) > 1 else -1
    chain = log.chain(q, 3) if q >= 0 else []
    d["producer_chain"] = [log.canon[i] for i in chain][:6]
    real = [log.names[i] for i in chain if log.names[i] not in O.PASS]
    d["from_reduction"] = bool(real) and real[0] in O.REDUCE
    # jnp.var / jnp.std are jitted library functions: the division of jnp.var (by n - ddof) runs inside
    # one, and a denominator jnp.std made was produced inside one
    d["from_std_var"] = any(set(log.calls[i]) & O.STD_VAR_CALLS for i in [idx] + chain)
    return {"zero_denominator": d}


@gatherer("softmax_all_masked_rows")
def _softmax_rows(p: Probe) -> Optional[dict]:
    xf = p.arr(0)
    return F.masked_softmax_rows(xf) if xf is not None else None


@gatherer("domain")
def _domain(p: Probe) -> Optional[dict]:
    dom, src = _domain_arg(p)
    return F.domain(dom, src) if src is not None else None


# ---------------------------------------------------------------------------- after the family's
@gatherer("overflow", always=True)
def _overflow(p: Probe) -> Optional[dict]:
    """Infinities only, from finite inputs, that a wider dtype holds."""
    range_ok = (p.facts.get("float64_check") or {}).get("finite") or \
        (p.facts.get("float32_check") or {}).get("direct_finite")
    mx = (F.finite_range(N.host(v)).get("max_abs") for v in p.ins if N.is_float(v))
    return F.overflow(N.counts(p.a0), range_ok, mx, N.dtype_max(p.dtype))


@gatherer("isolated_input", always=True)
def _isolated(p: Probe) -> Optional[dict]:
    """A forward op that ran out of range on finite inputs float64 holds: one input's size in a few batch rows."""
    if p.stage != "forward" or not (p.facts.get("float64_check") or {}).get("finite"):
        return None
    return F.isolated_rows((k, F.row_max_abs(N.host(v)))
                           for k, v in enumerate(p.ins) if N.is_float(v))


@gatherer("kl_div", always=True)
def _kl_div(p: Probe) -> Optional[dict]:
    """The target of an enclosing ``optax.kl_divergence`` (probabilities expected): the examined ``log`` is
    the log of the targets there (``kl_divergence_with_log_targets`` takes log-probabilities)."""
    eqn = p.e_eqn
    tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
    if tb is None or p.e_op != "log":
        return None
    sep = os.sep
    calls = [f.function_name for f in tb.frames if f"{sep}optax{sep}" in f.file_name]
    if "kl_divergence_with_log_targets" in calls:
        return {"kl_div": {"log_target": True}}
    tg = p.arr(0) if "kl_divergence" in calls else None
    return {"kl_div": F.kl_target(tg, log_target=False)} if tg is not None else None


@gatherer("where_trap", always=True)
def _where_trap(p: Probe) -> Optional[dict]:
    if p.stage == "backward" and p.fwd is not None:
        return {"where_trap": p.rp.log.where_trap(p.fwd)}
    return None
