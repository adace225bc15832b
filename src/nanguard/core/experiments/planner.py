"""Which experiments test a hypothesis (a cause category), cheapest first.

The planner reads plain data: the diagnosed event (category, origin, phase, whether the replay
reproduced the failure) and what the backend's replayable step can do (:class:`Situation`,
``caps``). Each spec carries its cost in replays of one step; the investigation
(:mod:`.investigate`) runs them in that order within its time budget and stops at the first that
confirms or refutes the hypothesis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..diagnosis.text import LOW_DTYPES, opshort
from ..recovery.estimates import backoff_factor, clip_max_norm, peak_target, rollback_bound
from .kinds import DATA, DIVERGENCE, EXACT, PER_SAMPLE, PRECISION
from .records import Spec

# ops whose inputs the backend can keep inside their domain (``domain_guard``), by examined op name
GUARDED_OPS = frozenset({"log", "log2", "log10", "log1p", "sqrt", "rsqrt", "acos", "asin", "atanh", "acosh",
                         "arccos", "arcsin", "arctanh", "arccosh", "div", "true_divide", "reciprocal", "divide",
                         "_softmax", "_log_softmax", "softmax", "log_softmax", "pow"})

# how ``domain_guard`` keeps each op's inputs inside its domain, in words
GUARD_TEXT = {"log": "clamped to >= eps", "log2": "clamped to >= eps", "log10": "clamped to >= eps",
              "sqrt": "clamped to >= eps", "rsqrt": "clamped to >= eps", "log1p": "clamped to > -1",
              "acos": "clamped into (-1, 1)", "asin": "clamped into (-1, 1)", "atanh": "clamped into (-1, 1)",
              "acosh": "clamped to > 1", "div": "zero denominators replaced by 1",
              "true_divide": "zero denominators replaced by 1", "divide": "zero denominators replaced by 1",
              "reciprocal": "zeros replaced by 1", "pow": "base clamped to >= eps",
              "_softmax": "all -inf rows replaced by 0", "softmax": "all -inf rows replaced by 0",
              "_log_softmax": "all -inf rows replaced by 0", "log_softmax": "all -inf rows replaced by 0",
              "integer_pow": "zero bases replaced by eps"}

# one-input ops whose input the backend can replace by its float64 value (``origin_input_f64``)
UNARY_OPS = frozenset({"log", "log2", "log10", "log1p", "sqrt", "rsqrt", "acos", "arccos", "asin", "arcsin", "atanh",
                       "arctanh", "acosh", "arccosh", "reciprocal"})


@dataclass
class Situation:
    """What the planner knows. ``caps`` (from the backend's step):

    * ``batch_size``: rows of the batch (None: rows cannot be dropped);
    * ``module_chain``: module paths from the origin's module up to the root model (``""``);
    * ``float64``, ``op_patch`` (origin_input_f64 / domain_guard), ``compiled``: bools;
    * ``snapshots``: steps with a kept snapshot and the batches of every step since
      (history replays); ``lrs``: current learning rates.
    """

    category: str
    origin: Dict[str, Any] = field(default_factory=dict)
    phase: str = "forward"
    reproduced: bool = True
    step: int = 0
    caps: Dict[str, Any] = field(default_factory=dict)
    history: Sequence[dict] = ()
    evidence: Dict[str, Any] = field(default_factory=dict)
    max_replay_steps: float = 3.0   # how many steps a history replay may take (the budget, in steps)
    clip_quantile: float = 0.25
    lr_factor: float = 0.1

    @property
    def low(self) -> bool:
        return (self.origin.get("dtype") or "") in LOW_DTYPES

    @property
    def examined_op(self) -> str:
        o = self.origin
        op = o.get("forward_op") if (o.get("stage") == "backward" and o.get("forward_op")) else o.get("op")
        return opshort(op)


def origin_rows(s: Situation) -> Optional[List[int]]:
    """Batch rows the localization named (rows of the origin's output along the batch dimension), when
    they are a strict subset of the batch; None when they cannot be mapped to batch rows."""
    b = s.caps.get("batch_size")
    rows = [r for r in (s.origin.get("samples") or []) if isinstance(r, int)]
    shape = s.origin.get("shape")
    iso = s.evidence.get("isolated_input")
    if not rows and isinstance(iso, dict):  # the few rows an op's finite input is huge in (rows of that input)
        rows, shape = [r for r in iso.get("rows") or [] if isinstance(r, int)], [iso.get("rows_total")]
    if not b or not rows or len(rows) >= b or len(rows) >= 10:  # 10: the recorder's limit, maybe more
        return None
    if shape and shape[0] != b:
        return None
    return rows if all(0 <= r < b for r in rows) else None


def plan(category: str, s: Situation) -> List[Spec]:
    """The experiments that can confirm or refute ``category``, cheapest first."""
    caps = s.caps
    specs: List[Spec] = []
    if caps.get("compiled"):
        specs.append(Spec("eager", {}, category, 2.0))
    if not s.reproduced:
        specs.append(Spec("determinism", {}, category, 2.0))
        return _order(specs)
    if category in PRECISION or (s.low and category in EXACT | {"exp_overflow", "other"}):
        specs += _precision_specs(category, s)
    # an outlier batch of an earlier step (the history's diagnosis): the failing step's own rows are not
    # what it blames, so dropping them tests nothing
    earlier = isinstance(s.evidence.get("outlier_step"), int) and s.evidence["outlier_step"] < s.step
    # a cause no category names whose origin sits in a few batch rows (a CTC target no alignment fits): dropping
    # them tells whether the failure is those samples' (the recovery then keeps them out)
    sampled = category == "other" and origin_rows(s) is not None
    if (category in PER_SAMPLE or sampled) and not earlier and caps.get("batch_size", 0) and caps["batch_size"] >= 2:
        rows = origin_rows(s)
        if rows is not None:
            specs.append(Spec("drop_samples", {"rows": rows}, category, 0.9))
        elif category == DATA or s.origin.get("samples"):
            specs.append(Spec("drop_samples", {"bisect": True}, category,
                              1.0 + 0.5 * math.log2(max(caps["batch_size"], 2))))
    if category in EXACT and caps.get("op_patch") and s.examined_op in GUARDED_OPS:
        # float16/bfloat16: the precision experiments go first (a guard would also "fix" an underflow)
        specs.append(Spec("domain_guard", {"op": s.examined_op}, category, 1.5 if s.low else 1.2))
    if category in DIVERGENCE:
        specs += _history_specs(category, s)
    return _order(specs)


def _precision_specs(category: str, s: Situation) -> List[Spec]:
    caps = s.caps
    chain = list(caps.get("module_chain") or [])
    out: List[Spec] = []
    if category in PRECISION:  # look for the smallest module that fixes it (the recovery's upcast)
        for i, m in enumerate(chain):
            out.append(Spec("upcast_module", {"module": m, "whole_model": i == len(chain) - 1}, category,
                            1.0 + 0.01 * i))
        if not chain and caps.get("op_patch") and category == "low_precision_underflow" and \
                s.examined_op in UNARY_OPS:
            out.append(Spec("origin_input_f64", {"op": s.examined_op}, category, 2.5))
    if caps.get("float64"):
        out.append(Spec("float64_step", {}, category, 1.3))
    return out


def _history_specs(category: str, s: Situation) -> List[Spec]:
    """lr_replay / clip_replay from the nearest snapshot whose replay fits the budget."""
    caps = s.caps
    snaps = caps.get("snapshots") or []
    # from before the growth began (the state recovery rolls back to) when the budget reaches it; else the
    # nearest: a snapshot after the update that began the growth holds weights already diverging, and a
    # replay from it that stays non-finite does not show that the change fails from before the growth, so
    # it decides nothing (kinds.py)
    bound = rollback_bound({"evidence": s.evidence})
    start = nearest_snapshot([t for t in snaps if bound is None or t <= bound], s.step, s.max_replay_steps)
    if start is None:
        start = nearest_snapshot(snaps, s.step, s.max_replay_steps)
    if start is None:
        return []
    n = s.step - start + 1.5  # + saving, restoring and checking the state
    late = {"after_onset": True} if bound is not None and start > bound else {}
    out: List[Spec] = []
    lr = Spec("lr_replay", {"factor": lr_factor(s), "from_step": start, "to_step": s.step, "deeper": True, **late},
              category, n)
    clip = Spec("clip_replay", {"max_norm": clip_norm(s), "from_step": start, "to_step": s.step, **late}, category,
                n + 0.01)
    out += [lr, clip] if category == "lr_too_high" else [clip, lr]
    return out


def nearest_snapshot(snapshots: Sequence[int], step: int, max_steps: float) -> Optional[int]:
    """The latest snapshot strictly before ``step`` from which replaying up to ``step`` takes at most
    ``max_steps`` steps (the replay must include at least one update with the change)."""
    ok = [t for t in snapshots if t < step and step - t + 1.5 <= max(max_steps, 2.5)]
    return max(ok) if ok else None


def lr_factor(s: Situation) -> float:
    """The learning-rate cut to test: the recovery's (``backoff_factor``), or under a warm-up the rate its
    new peak will sit at (``peak_target``), so the replay tests the highest rate the schedule will reach."""
    cause, lrs = {"evidence": s.evidence}, s.caps.get("lrs") or []
    f = backoff_factor(s.lr_factor, cause, lrs)
    return float(peak_target(f, cause, lrs, s.caps.get("lr_peaks") or lrs))


def clip_norm(s: Situation) -> float:
    return float(clip_max_norm(s.history, quantile=s.clip_quantile))


def _order(specs: List[Spec]) -> List[Spec]:
    seen, out = set(), []
    for sp in sorted(specs, key=lambda x: x.cost):  # stable: equal costs keep their order
        if sp.key() not in seen:
            seen.add(sp.key())
            out.append(sp)
    return out
