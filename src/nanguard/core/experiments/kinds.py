"""The experiment kinds: what each changes, what it costs, which categories its outcome confirms or
refutes, and which recovery action a finite outcome verifies.

A cause is *confirmed* when removing it makes the failing step finite ("the NaN goes away when X"),
and *refuted* when an experiment shows the step fails the same without it (or is finite where the
cause says it could not be). Everything here is plain data over category names; the backend only
executes the change (``nanguard.pytorch.experiments`` for PyTorch).

=================  ===================================================  =====================================
kind               change                                                finite / non-finite
=================  ===================================================  =====================================
drop_samples       replay without some batch rows (given, or found by    finite: confirms a per-sample cause;
                   bisection)                                            non-finite: refutes bad_input_data
upcast_module      replay with one module (the origin's, then its        finite: confirms low precision, refutes
                   parents) in float32                                   an exact domain error (float16/bfloat16
                                                                         origins); non-finite for the whole
                                                                         model: refutes low precision
float64_step       replay the whole step in float64                      finite: confirms low precision, refutes
                                                                         an exact domain error (float16/bfloat16
                                                                         origins); non-finite: refutes low
                                                                         precision
origin_input_f64   replay with the origin op's inputs computed in        finite: the inputs were out of domain
                   float64 upstream                                      only by rounding (confirms underflow)
domain_guard       replay with the origin op's inputs kept inside its    finite: confirms the domain error is
                   domain (clamped; zero denominators -> 1)              the whole story
lr_replay          from an earlier snapshot, replay the steps up to the  finite: confirms lr_too_high (not
                   failing one with the learning rate lowered            while its loss still grows 10x:
                                                                         nothing); non-finite: refutes it
                                                                         (from a snapshot after the growth
                                                                         began: nothing)
clip_replay        the same, clipping the gradient norm                  finite: confirms gradient_explosion;
                                                                         non-finite: refutes it
determinism        replay the step twice, unchanged                      different results: nondeterminism
eager              replay a compiled step in eager mode                  eager finite, compiled not: a compiler
                                                                         issue (refutes the op-level cause)
=================  ===================================================  =====================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..diagnosis.confidence import EXACT
from .records import CONFIRMS, REFUTES, Experiment
from .tested import still_diverging

PRECISION = frozenset({"low_precision_overflow", "low_precision_underflow"})
# EXACT: failures that are non-finite whatever the precision (log(0), x/0, sqrt(<0), an all-masked row...)
DIVERGENCE = frozenset({"lr_too_high", "gradient_explosion"})
DATA = "bad_input_data"
# causes a few samples of the batch can trigger on their own
PER_SAMPLE = EXACT | {DATA, "exp_overflow"}


@dataclass(frozen=True)
class Kind:
    """One experiment kind. ``cost``: replays of one step (the planner's first estimate);
    ``verifies``: the recovery action a finite outcome proves; ``judge(category, experiment, ctx)``
    -> "confirms" / "refutes" / None. ``ctx``: ``{"low": origin dtype is float16/bfloat16}``."""

    name: str
    cost: float
    verifies: Optional[str]
    judge: Callable[[str, Experiment, dict], Optional[str]]
    describe: Callable[[dict], str]


def _drop(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    if e.finite:
        return CONFIRMS if cat in PER_SAMPLE else None
    return REFUTES if cat == DATA else None


def _upcast(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    if e.finite:
        if cat in PRECISION:
            return CONFIRMS
        return REFUTES if (cat in EXACT and ctx.get("low")) else None
    return REFUTES if (cat in PRECISION and e.params.get("whole_model") and not ctx.get("cast_backward")) else None


def _float64(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    # In a float32 model an exact-value category includes values that reach the edge of the domain by
    # float32 rounding (log(1 - sigmoid(x)) with sigmoid(x) == 1.0): float64 being finite says nothing
    # against it. Only a float16/bfloat16 origin has a precision category to prefer.
    if e.finite:
        if cat in PRECISION:
            return CONFIRMS
        return REFUTES if (cat in EXACT and ctx.get("low")) else None
    return REFUTES if cat in PRECISION else None


def _origin_f64(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    if e.finite:
        if cat == "low_precision_underflow":
            return CONFIRMS
        return REFUTES if (cat in EXACT and ctx.get("low")) else None
    return REFUTES if cat == "low_precision_underflow" else None


def _guard(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    return CONFIRMS if (e.finite and cat in EXACT) else None


def _lr(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    return _history(cat == "lr_too_high", e)


def _clip(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    return _history(cat == "gradient_explosion", e)


def _history(mine: bool, e: Experiment) -> Optional[str]:
    """A history replay's verdict on its own category: finite and no longer diverging confirms it; finite
    but with the loss still growing (``tested.still_diverging``) says nothing; non-finite refutes it."""
    if not mine:
        return None
    if e.finite:
        return None if still_diverging(e.details) else CONFIRMS
    return _refutes_history(e)


def _refutes_history(e: Experiment) -> Optional[str]:
    """A history replay that stayed non-finite refutes its cause, unless it started from a snapshot taken
    after the growth began (``after_onset``: weights already diverging, which no lower rate or clip
    brings back in a few steps): that decides nothing."""
    return None if e.params.get("after_onset") else REFUTES


def _determinism(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    return None  # a finding (identical or not), not a verdict on a category


def _eager(cat: str, e: Experiment, ctx: dict) -> Optional[str]:
    # eager finite where the compiled step is not: whatever the op-level cause, it is not the program's
    return REFUTES if (e.finite and e.details.get("compiled_finite") is False) else None


def _rows(p: dict) -> str:
    if p.get("bisect"):
        return "batch rows found by bisection"
    rows = p.get("rows") or []
    return f"batch row{'s' if len(rows) != 1 else ''} {list(rows)[:10]}"


KINDS: Dict[str, Kind] = {k.name: k for k in (
    Kind("drop_samples", 1.0, "drop_samples", _drop, lambda p: f"the step without {_rows(p)}"),
    Kind("upcast_module", 1.0, "upcast", _upcast,
         lambda p: f"module '{p.get('module')}' in float32" if p.get("module") else "the whole model in float32"),
    Kind("float64_step", 1.3, None, _float64, lambda p: "the whole step in float64"),
    Kind("origin_input_f64", 2.5, None, _origin_f64,
         lambda p: f"the inputs of {p.get('op', 'the origin op')} computed in float64 upstream"),
    Kind("domain_guard", 1.2, None, _guard,
         lambda p: f"the inputs of {p.get('op', 'the origin op')} kept inside its domain ({p.get('guard', '')})"),
    Kind("lr_replay", 2.0, "lr_backoff", _lr,
         lambda p: f"the learning rate x{p.get('factor')} from the snapshot of step {p.get('from_step')}, "
                   f"steps {p.get('from_step')}..{p.get('to_step')} replayed"),
    Kind("clip_replay", 2.0, "clip", _clip,
         lambda p: f"the gradient norm clipped at {p.get('max_norm'):.3g} from the snapshot of step "
                   f"{p.get('from_step')}, steps {p.get('from_step')}..{p.get('to_step')} replayed"
         if isinstance(p.get("max_norm"), (int, float)) else "the gradient norm clipped"),
    Kind("determinism", 2.0, None, _determinism, lambda p: "the same step replayed twice, unchanged"),
    Kind("eager", 2.0, None, _eager, lambda p: "the compiled step replayed in eager mode"),
)}


def judge(category: str, e: Experiment, ctx: Optional[dict] = None) -> Optional[str]:
    """Does experiment ``e`` confirm or refute ``category``? (None: it says nothing about it.)"""
    k = KINDS.get(e.kind)
    if k is None or not e.ran:
        return None
    v = k.judge(category, e, ctx or {})
    if v is not None:
        e.verdicts[category] = v
    return v


def describe(kind: str, params: dict) -> str:
    k = KINDS.get(kind)
    return k.describe(params) if k is not None else kind
