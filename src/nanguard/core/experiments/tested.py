"""Fixes that were tested: the numeric fixes a report suggests (a learning rate, a clip value, an eps or
a domain clamp, a dtype), each with what its replay from the snapshot gave, a fix that passed first.

Built from the experiments that ran on the failure (``cause.evidence.experiments``: plain dicts), so
nothing is run twice: ``lr_replay`` (the learning rate), ``clip_replay`` (a gradient-norm clip),
``domain_guard`` (an eps/clamp on the origin op's input), ``upcast_module`` (a module in float32).
Each entry of ``cause.tested_fixes`` (report schema ``nanguard.report/1``, an optional field: readers
of older reports see none)::

    {"fix": "lr 0.004", "kind": "lr_replay", "passed": true, "steps": 20,
     "loss": [2.3, 1.1], "text": "lr 0.004: 20 steps finite, loss 2.3 -> 1.1", "lr": [0.004]}

The value each entry tried (optional fields, for :mod:`.reconcile`, which words the numbered fixes
after them): ``lr`` (the learning rates replayed, per parameter group), ``max_norm`` (the clip),
``module`` (the module put in float32; ``""``: the whole model), ``op`` (the guarded op);
``inconclusive``: a failed history replay that started after the growth began (it tests nothing); and,
once reconciled, ``fix_index``: the position in ``event.fixes`` of the fix this replay tested.

What "passed" means (:func:`passes`): every replayed value stayed finite **and** the replay did not keep
diverging: for a history replay with losses (``details.losses``: its first and last step's), the last
loss is at most ``STILL_GROWING`` = 10x the first (no lower than ``LOSS_FLOOR`` = 1e-6, the spike
detector's start floor). A replay that stayed finite while its loss went on growing (measured: 4e34
at the end of an lr replay from a snapshot taken after the onset) is "still diverging", not passed;
it decides nothing about its cause either (``kinds``: no verdict), and no recovery action is verified
by it.

An early warning's candidate (:mod:`nanguard.core.recovery.tried`) must show more: not what the warning
warned of. :func:`warning_check` adds to its details ``growing`` (the loss still rises: the mean of its
last losses above ``GROWTH_TOL`` more than the mean of its first ones; a replay of distinct batches must
also have a least-squares trend rising by as much, so minibatch noise alone is not growth) and, for the dead rule,
``dead`` (every replayed gradient norm at most ``DEAD_GRAD`` x the first steps': a dead network's replay
passes anything, so it tests nothing), and for a learning-rate cut ``stalled`` (the same batches' mean
loss moved by at most ``STALL_TOL`` of it: a rate so small that nothing trains passes anything too). :func:`still_diverging` honours ``growing``, so a replay's verdict
is the same wherever it is read.
"""
from __future__ import annotations

import math
from statistics import fmean
from typing import Any, Dict, List, Optional, Sequence

STILL_GROWING = 10.0
LOSS_FLOOR = 1e-6
GROWTH_TOL = 0.1   # a warning's replay: the mean of the last losses at most 1.1x the first ones'
DEAD_GRAD = 0.1    # ... and (dead rule) not every gradient norm <= 0.1x the first steps' (spike.dead_grad)
STALL_TOL = 1e-3   # ... and (a learning-rate cut) the loss on the same batches moved by more than 0.1%


# How far a learning-rate replay goes down when the planned cut (at most x1e-4 for a first cut) still diverges:
# x0.1 more, not below this. A schedule that jumped from 0.05 to 3e4 needs x1e-5 (3e4 -> 0.3 trains, 3 diverges).
DEEPEST_LR_FACTOR = 1e-6


def still_diverging(details: Any) -> bool:
    """The replay's loss kept growing: its last loss > ``STILL_GROWING`` x its first (see the module
    docstring); False when the replay recorded no pair of finite losses."""
    if isinstance(details, dict) and details.get("growing") is True:  # a warning's replay (warning_check)
        return True
    loss = details.get("losses") if isinstance(details, dict) else None
    if not (isinstance(loss, (list, tuple)) and len(loss) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in loss)):
        return False
    a, b = float(loss[0]), float(loss[1])
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return b - a > (STILL_GROWING - 1.0) * max(abs(a), LOSS_FLOOR)


def passes(finite: Any, details: Any) -> bool:
    """A replay passed: every value finite, not :func:`still_diverging` and not ``dead``."""
    return finite is True and not still_diverging(details) and not (
        isinstance(details, dict) and (details.get("dead") or details.get("stalled")))


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def warning_check(losses: Sequence[Any], grad_norms: Sequence[Any] = (), period: int = 0,
                  grad_ref: Optional[float] = None, stall: bool = False) -> Dict[str, Any]:
    """What an early warning's replay shows of what the warning warned of (fields for its ``details``).

    ``losses``: each replayed step's; ``period``: how many distinct steps were cycled (the same batches
    come back every ``period`` steps). The first k and the last k losses are compared by their means:
    k a whole number of cycles when two fit (the same batches on both sides), else a third of the steps
    (distinct batches: then the least-squares fit must rise by as much over the replay too). ``loss_means`` [first, last],
    ``compared`` k, ``growing`` when the last mean exceeds the first by more than ``GROWTH_TOL`` of it.
    ``grad_ref`` (the dead rule's first-steps gradient norm): ``dead`` when every replayed gradient norm
    is at most ``DEAD_GRAD`` x it, with ``grad_norm_max``. ``stall`` (a learning-rate cut): ``stalled`` when
    the same batches' means moved by at most ``STALL_TOL`` of the first."""
    out: Dict[str, Any] = {}
    ls = [float(x) for x in losses if _num(x)]
    n = len(ls)
    if n >= 2:
        p = int(period or 0)
        same = 0 < p and 2 * p <= n
        k = p * (n // (2 * p)) if same else max(1, n // 3)
        a, b = fmean(ls[:k]), fmean(ls[-k:])  # k >= 1
        out.update(loss_means=[a, b], compared=k)
        rising = b - a > GROWTH_TOL * max(abs(a), LOSS_FLOOR)
        if rising and not same:  # distinct batches: the fitted trend must rise too
            xm = (n - 1) / 2.0
            ym = sum(ls) / n
            slope = sum((i - xm) * (y - ym) for i, y in enumerate(ls)) / sum((i - xm) ** 2 for i in range(n))
            rising = slope * (n - 1) > GROWTH_TOL * max(abs(a), LOSS_FLOOR)
        if rising:
            out["growing"] = True
        elif stall and same and abs(b - a) <= STALL_TOL * max(abs(a), LOSS_FLOOR):
            out["stalled"] = True
    gs = [float(x) for x in grad_norms if _num(x)]
    if grad_ref is not None and _num(grad_ref) and grad_ref > 0 and gs and len(gs) == len(list(grad_norms)):
        out["grad_norm_max"] = max(gs)
        if max(gs) <= DEAD_GRAD * grad_ref:
            out["dead"] = True
    return out


def g(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _rates(xs: Sequence[Any]) -> str:
    """The rates of several param groups or optimizers: one value when they are all the same."""
    return g(xs[0]) if len(set(map(g, xs))) == 1 else ", ".join(g(x) for x in xs[:3])


_KINDS = ("lr_replay", "clip_replay", "domain_guard", "upcast_module")


def tested_fixes(experiments: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One entry per numeric fix a replay tried (see the module docstring); passed ones first, each
    group in the order they ran."""
    out = [t for t in (_entry(e) for e in experiments if e.get("kind") in _KINDS) if t is not None]
    return [t for t in out if t["passed"]] + [t for t in out if not t["passed"]]


def _entry(e: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    if e.get("finite") is None or (e.get("details") or {}).get("dead"):  # could not run, or a dead replay:
        return None                                                       # nothing was tested
    p, d = e.get("params") or {}, e.get("details") or {}
    kind = e["kind"]
    if kind == "lr_replay":
        lrs, before = d.get("lr") or [], d.get("lr_from") or []
        fix = f"lr {_rates(lrs)}" if lrs else f"lr x{g(p.get('factor'))}"
        if lrs and before:  # an early warning's candidate, tested before it is applied (recovery/tried.py)
            fix = f"lr {_rates(before)} -> {_rates(lrs)}"
        if d.get("schedule"):  # each replayed step ran at its own rate times the factor (a warm-up...)
            fix += f" (the schedule x{g(p.get('factor'))})"
        if isinstance(p.get("keep"), dict) and before:  # the rate now kept, a spike rolled back (rate_spike)
            fix = f"lr {_rates(before)} kept, the rate {g(p['keep'].get('lr'))} of {_steps(p['keep'])} rolled back"
    elif kind == "clip_replay":
        fix = f"clip grad norm at {g(p.get('max_norm'))}"
    elif kind == "domain_guard":
        fix = f"{p.get('op', 'the origin op')}: {p.get('guard') or 'inputs kept in its domain'}"
    else:
        fix = f"module '{p.get('module')}' in float32" if p.get("module") else "the whole model in float32"
    growing = e.get("finite") is True and still_diverging(d)
    passed = passes(e.get("finite"), d)
    steps = d.get("steps") if isinstance(d.get("steps"), int) else max(int(e.get("replays") or 1), 1)
    if kind in ("domain_guard", "upcast_module"):
        steps = 1  # one replay of the failing step
    what = f"{steps} step{'s' if steps != 1 else ''} finite" if passed else \
        ("still non-finite" + (f" at step {d['failed_at']}" if d.get("failed_at") is not None else ""))
    if e.get("finite") is True and d.get("stalled"):
        what = f"stalled: {steps} steps finite, but the loss did not move (a rate too small to train)"
    if growing:
        what = f"still diverging: {steps} step{'s' if steps != 1 else ''} finite, but the loss kept growing"
    late = not passed and bool(p.get("after_onset"))  # from weights already diverging: no verdict on the fix
    if late:
        what += f" from the snapshot of step {p.get('from_step')}, after the growth began (inconclusive)"
    loss = d.get("losses")
    t: Dict[str, Any] = {"fix": fix, "kind": kind, "passed": passed, "steps": steps}
    if late:
        t["inconclusive"] = True
    if kind == "lr_replay" and d.get("lr"):
        t["lr"] = list(d["lr"])
        if isinstance(p.get("keep"), dict):
            t["spike"] = dict(p["keep"])
    elif kind == "clip_replay" and isinstance(p.get("max_norm"), (int, float)):
        t["max_norm"] = p["max_norm"]
    elif kind == "upcast_module":
        t["module"] = p.get("module") or ""
    elif kind == "domain_guard" and p.get("op"):
        t["op"] = p["op"]
    if isinstance(loss, list) and len(loss) == 2 and (passed or growing or d.get("stalled")):
        t["loss"] = list(loss)
        what += f", loss {g(loss[0])} -> {g(loss[1])}"
        m, k = d.get("loss_means"), d.get("compared")
        if (d.get("growing") or d.get("stalled")) and isinstance(m, list) and len(m) == 2 and k:
            what += f" (mean of the last {k}: {g(m[1])}, of the first {k}: {g(m[0])})"
    if growing:
        t["still_diverging"] = True
    if d.get("tried"):
        t["tried"] = list(d["tried"])
        failed = [x for x in d["tried"] if x.get("finite") is False]
        if failed and passed:
            what += f" (x{g(failed[0]['factor'])} still diverged)"
    t["text"] = f"{fix}: {what}"
    return t


def _steps(spike: Dict[str, Any]) -> str:
    st = [s for s in spike.get("steps") or [] if isinstance(s, int)]
    return f"step {st[0]}" if len(st) == 1 else f"steps {st[0]}..{st[-1]}" if st else "the spike"


def _times(r: Any) -> str:
    """A ratio as "1e4" (>= 1000) or "25"."""
    if not (isinstance(r, (int, float)) and math.isfinite(r)):
        return str(r)
    if r < 1000:
        return f"{r:.2g}"
    m, e = f"{r:.0e}".split("e")
    return f"{m}e{int(e)}"


def spike_fix(spike: Dict[str, Any]) -> str:
    """The fix for a learning-rate spike in the schedule (:mod:`nanguard.core.recovery.rate_spike`) whose
    replay at the rate now passed: the schedule's entry, not the rate."""
    where = _steps(spike)
    one = where.startswith("step ")
    b, n = spike.get("before"), spike.get("now")
    same = _num(b) and _num(n) and b > 0 and n > 0 and abs(math.log(b / n)) <= math.log(1.05)
    around = (f"the rate before and after it ({g(n)})" if same else f"the rate before it ({g(b)}) and now ({g(n)})")
    return (f"fix the schedule's {'entry' if one else 'entries'} for {where}: the rate of {where} was "
            f"{g(spike.get('lr'))}, {_times(spike.get('ratio'))}x {around}, a rate that trains (rolled back past the "
            f"spike and kept)")
