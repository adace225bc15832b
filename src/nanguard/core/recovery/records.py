"""The words of recovery: the one-line notice of each recovery and the run's summary line."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..text import counted_list, plural, plural_word


def notice(step: int, category: str, record: Dict[str, Any]) -> str:
    """``recovered at step 17: lr_too_high -> rollback+lr_backoff+skip_step, back to step 10, ...``"""
    done = record["actions"]
    extra = ""
    if "rollback" in done and done["rollback"].get("elements_only"):
        extra += (f", {plural(done['rollback']['elements_restored'], 'non-finite element')} restored from "
                  f"step {done['rollback']['to_step']}'s snapshot")
    elif "rollback" in done:
        extra += f", back to step {done['rollback']['to_step']}"
    if "raise_beta2" in done:
        b = done["raise_beta2"]
        passed = (b.get("tested_by") or {}).get("passed")
        extra += (f", beta2 {fmt_list(b.get('beta2_before') or [])} -> {fmt_list(b.get('beta2_after') or [])}"
                  + (" (replay: passed)" if passed else " (untested)" if passed is None else " (replay: not passed)"))
    if "lr_backoff" in done and not done["lr_backoff"].get("lr_before") and "update_scale_after" in done["lr_backoff"]:
        extra += f", update scaled x{done['lr_backoff']['factor']:.3g} (learning rate not readable)"
    elif "lr_backoff" in done:
        extra += f", lr {fmt_list(done['lr_backoff']['lr_before'])} -> {fmt_list(done['lr_backoff']['lr_after'])}"
    if "grad_scale" in done:
        extra += f", gradients x{done['grad_scale']['factor']:.3g} before each hand-written update (no optimizer lr)"
    if "clip" in done:
        extra += f", clip grad norm at {done['clip']['max_norm']:.3g}"
    if "upcast" in done:
        up = done["upcast"]
        extra += (f", module {up['module']!r} now float32" if up.get("module") is not None
                  else ", the loss code now float32 (its half-precision inputs cast, autocast off)")
    dropped = counted_list("row", done.get("drop_samples", {}).get("rows"))
    if "drop_samples" in done:
        extra += f", trained on the batch without {dropped or 'its bad rows'}"
    if "quarantine" in done and done["quarantine"].get("rows"):
        extra += f", quarantined {counted_list('row', done['quarantine']['rows'])}"
        if done["quarantine"].get("excluded"):
            extra += " (kept out of every later batch)"
        elif "drop_samples" in done:
            extra += " (dropped from this batch only: it may come back in a later batch and will be dropped again)"
        else:
            extra += " (not kept out of later batches: a batch that draws it again fails again)"
    if record.get("verified"):
        extra += f", {record['verified']}"
    if (done.get("rollback") or {}).get("escalated"):
        extra += ", the same failure again: the batch is not drawn again (RNG not rewound)"
    return (f"recovered at step {step}: {category} -> {record['action']}{extra} "
            f"(recovery {record['recovery_number']}{tries_text(record.get('tries_left'), 'rollback' in done)})")


def tries_text(left: Any, rolled_back: bool = True) -> str:
    """``; 1 more if the same failure comes back after this rollback, 9 more allowed in any 50 steps`` (the
    record's ``tries_left``). The repeat count is about a failure coming back after a rollback, so a recovery
    without one (a skip) does not state it; the budget is a sliding window, so it may go up again."""
    if not isinstance(left, dict):
        return ""
    same, budget, window = left.get("same_failure"), left.get("recoveries"), left.get("window")
    parts = []
    if isinstance(same, int) and rolled_back:
        parts.append(f"{same} more if the same failure comes back after this rollback" if same else
                     "it stops if the same failure comes back after this rollback")
    if isinstance(budget, int):
        parts.append(f"{budget} more allowed in any {window} steps" if isinstance(window, int) else
                     f"{budget} left in the budget")
    return ("; " + ", ".join(parts)) if parts else ""


def actions_tally(events: List[Any]) -> str:
    """`` (skip_step x2, rollback x1) at steps 4, 9`` for the recovered events."""
    acts: Dict[str, int] = {}
    for e in events:
        for a in (e.recovery or {}).get("action", "").split("+"):
            if a:
                acts[a] = acts.get(a, 0) + 1
    steps = [e.step for e in events]
    n = len(events)
    return ((f" ({', '.join(f'{a} x{c}' for a, c in acts.items())})" if acts else "")
            + (f" at {plural_word(n, 'step')} {', '.join(map(str, steps[:12]))}"
               f"{'...' if n > 12 else ''}" if steps else ""))


def fmt_list(xs: List[float]) -> str:
    return ", ".join(f"{x:.3g}" for x in xs[:4]) + ("..." if len(xs) > 4 else "")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def summary_line(policy: Any) -> Optional[str]:
    """The run's recovery summary line for a :class:`~nanguard.core.recovery.RecoveryPolicy` (None when
    recovery did nothing)."""
    done = sorted([*policy.events, *policy.acted], key=lambda e: e.step)  # failures and the warnings acted on
    if not done and not policy.stopped:
        return None
    n = len(done)
    s = f"recovery: {plural(n or 'no', 'recovery')}" + actions_tally(done)
    if policy.quarantined:
        s += f"; quarantined dataset {counted_list('row', policy.quarantined)}"
        if policy.row_filters:
            s += f" (taken out of {plural(len(policy.row_filters), 'later batch')})"
        else:
            qs = [((e.recovery or {}).get("actions") or {}).get("quarantine") or {} for e in policy.events]
            if not any(q.get("excluded") for q in qs):
                again = sum(1 for q in qs if q.get("same_as_step") is not None)
                s += " (not kept out of later batches" + (
                    f": came back {plural(again, 'time')}, recovered each time)" if again else ")")
    elif policy.quarantined_batch_rows:
        s += f"; bad batch {counted_list('row', sorted(set(policy.quarantined_batch_rows)))}"
    mods = [m for m in policy.upcast_modules if m is not None]
    if mods:
        s += f"; float32 {counted_list('module', mods)}"
    if len(mods) < len(policy.upcast_modules):  # (an op outside every module: the loss code)
        s += "; the loss code in float32"
    if policy.clip_norm is not None:
        s += f"; clipping at {policy.clip_norm:.3g}"
    if policy.loss_scaler is not None:
        s += f"; loss scale {policy.loss_scaler.scale:g}"
    kept = policy.all_snapshots()
    if kept:
        s += f"; {plural(len(kept), 'snapshot')} kept, {fmt_bytes(policy.snapshot_bytes())}"
    if policy.stopped:
        s += f"; then stopped at step {policy.stopped_step} (recovery would not help: see above)"
    return s

