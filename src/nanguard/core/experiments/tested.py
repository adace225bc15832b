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
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

STILL_GROWING = 10.0
LOSS_FLOOR = 1e-6


def still_diverging(details: Any) -> bool:
    """The replay's loss kept growing: its last loss > ``STILL_GROWING`` x its first (see the module
    docstring); False when the replay recorded no pair of finite losses."""
    loss = details.get("losses") if isinstance(details, dict) else None
    if not (isinstance(loss, (list, tuple)) and len(loss) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in loss)):
        return False
    a, b = float(loss[0]), float(loss[1])
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return b - a > (STILL_GROWING - 1.0) * max(abs(a), LOSS_FLOOR)


def passes(finite: Any, details: Any) -> bool:
    """A replay passed: every value finite and not :func:`still_diverging`."""
    return finite is True and not still_diverging(details)


def g(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)

_KINDS = ("lr_replay", "clip_replay", "domain_guard", "upcast_module")


def tested_fixes(experiments: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One entry per numeric fix a replay tried (see the module docstring); passed ones first, each
    group in the order they ran."""
    out = [t for t in (_entry(e) for e in experiments if e.get("kind") in _KINDS) if t is not None]
    return [t for t in out if t["passed"]] + [t for t in out if not t["passed"]]


def _entry(e: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    if e.get("finite") is None:  # could not run: nothing was tested
        return None
    p, d = e.get("params") or {}, e.get("details") or {}
    kind = e["kind"]
    if kind == "lr_replay":
        lrs, before = d.get("lr") or [], d.get("lr_from") or []
        fix = f"lr {', '.join(g(x) for x in lrs[:3])}" if lrs else f"lr x{g(p.get('factor'))}"
        if lrs and before:  # an early warning's candidate, tested before it is applied (recovery/tried.py)
            fix = f"lr {', '.join(g(x) for x in before[:3])} -> {', '.join(g(x) for x in lrs[:3])}"
        if d.get("schedule"):  # each replayed step ran at its own rate times the factor (a warm-up...)
            fix += f" (the schedule x{g(p.get('factor'))})"
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
    elif kind == "clip_replay" and isinstance(p.get("max_norm"), (int, float)):
        t["max_norm"] = p["max_norm"]
    elif kind == "upcast_module":
        t["module"] = p.get("module") or ""
    elif kind == "domain_guard" and p.get("op"):
        t["op"] = p["op"]
    if isinstance(loss, list) and len(loss) == 2 and (passed or growing):
        t["loss"] = list(loss)
        what += f", loss {g(loss[0])} -> {g(loss[1])}"
    if growing:
        t["still_diverging"] = True
    if d.get("tried"):
        t["tried"] = list(d["tried"])
        failed = [x for x in d["tried"] if x.get("finite") is False]
        if failed and passed:
            what += f" (x{g(failed[0]['factor'])} still diverged)"
    t["text"] = f"{fix}: {what}"
    return t
