"""No recovery loops: the same failure coming back after the same recovery escalates, and every
recovery record says how many tries are left.

A rollback replays the steps after its snapshot; with the RNG rewound, a script that draws its
batches from the RNG draws the same batches again, so a failure made by one batch (a heavy-tailed
one, a bad row) comes back at the same point of the replay, and the same rollback would follow,
again and again. A failure (or an early warning) of the same category within the steps a rollback
replayed (plus two) is the *same failure*; the n-th time in a row it comes back:

1. first repeat: escalate. The rollback does not rewind the RNG this time (the batch that made it
   is not drawn again: the batch is dropped), and a step-size cut repeated within its window cuts
   further (:func:`~nanguard.core.recovery.estimates.backoff_factor`);
2. past ``max_tries`` recoveries of it: stop, with the reason (for an early warning: no more
   rollbacks, the warning stands and the step is applied).

Plain numbers only; the policy (:mod:`.policy`) asks :meth:`Repeats.count` before it acts and
:meth:`Repeats.note` after.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence


class Repeats:
    """The last rollback's failure and how many times in a row it came back (see the module docstring)."""

    def __init__(self, max_tries: int = 2) -> None:
        if max_tries < 1:
            raise ValueError(f"max_tries must be >= 1, got {max_tries}")
        self.max_tries = max_tries
        self.last: Optional[Dict[str, Any]] = None

    def count(self, step: int, category: str, kind: str) -> int:
        """How many recoveries in a row the same failure has had (0: a new failure). ``kind``:
        "failure" or "warning" (each is matched with its own kind)."""
        last = self.last
        if last is None or last["category"] != category or last["kind"] != kind:
            return 0
        return last["count"] if 0 < step - last["step"] <= last["span"] + 2 else 0

    def escalate(self, count: int) -> bool:
        """A repeat: this recovery must differ from the last one (the batch is not drawn again)."""
        return 0 < count < self.max_tries

    def exhausted(self, count: int) -> bool:
        return count >= self.max_tries

    def tries_left(self, count: int) -> int:
        """Recoveries of this same failure left after this one."""
        return max(self.max_tries - count - 1, 0)

    def note(self, step: int, category: str, kind: str, record: Dict[str, Any], count: int) -> None:
        """After a recovery of this failure: a rollback arms the detection of a repeat (the steps it
        replays); a recovery without one clears it (the steps that follow are new ones)."""
        rb = (record.get("actions") or {}).get("rollback") or {}
        if not isinstance(rb.get("to_step"), int) or rb.get("elements_only") or rb["to_step"] >= step:
            self.last = None  # (back to the failing step's own start: nothing is replayed, the next steps are new)
            return
        self.last = {"step": step, "span": max(step - rb["to_step"], 0), "category": category, "kind": kind,
                     "count": count + 1, "action": record.get("action")}

    def why_stop(self, step: int, category: str, count: int) -> str:
        last = self.last or {}
        return (f"the same {category} came back at step {step}, at the same point of the replay, after "
                f"{count} recover{'y' if count == 1 else 'ies'} ({last.get('action')}, the last one without "
                f"drawing the same batch again): recovery is not fixing it, so it stops here rather than loop")


# the skip-only categories finite weights grown too far reach: exp past its range, a probability saturated to
# exactly 0 or 1 under a log, an atanh/asin argument pushed to +-1 (not bad data, nor a failure of unknown mechanism)
WEIGHT_MADE = ("exp_overflow", "log_domain", "trig_domain")


def skip_failed(last: Optional[tuple], step: int, category: str, acts: Any, history: Sequence[dict] = ()) -> bool:
    """A plain skip that did not help: the failure (of ``WEIGHT_MADE``, not per-sample) came back on the very next
    update of the same optimizer (:func:`next_update`), on a new batch, and a skip leaves the weights as they were,
    so the weights make it, not the batch (an update before the skip took them where the op fails: exp past its
    range, a log of a collapsed value, a temperature trained below 0). ``last``: the policy's last recovery,
    ``(step, record)``; ``acts``: what the table calls for now."""
    if last is None or not next_update(history, last[0], step) or category not in WEIGHT_MADE \
            or set(acts) - {"skip_step"}:
        return False
    rec = last[1] or {}
    return rec.get("action") == "skip_step" and rec.get("category") == category and "quarantine" not in (
        rec.get("actions") or {})


def next_update(history: Sequence[dict], before: int, step: int) -> bool:
    """``step`` is the next update after ``before`` of the optimizer that made it: the next step, or (each optimizer
    update a step: SAC's critic, actor and temperature) the steps between are all other optimizers' updates."""
    if step - before == 1:
        return True
    if step <= before:
        return False
    rows = [r for r in history if isinstance(r, dict) and isinstance(r.get("step"), int) and before <= r["step"] < step]
    own = [r.get("optimizer") for r in rows if r["step"] == before]
    between = [r.get("optimizer") for r in rows if r["step"] > before]
    return bool(own) and own[0] is not None and len(between) == step - before - 1 and \
        all(o is not None and o != own[0] for o in between)


def weights_note(category: str, step: int, before: Optional[int] = None) -> str:
    """What a recovery record says of a :func:`skip_failed` escalation (``before``: the skipped step)."""
    before = step - 1 if before is None else before
    return (f"the same {category} came back at step {step} on a new batch after step {before}'s skip, which left "
            "the weights as they were: the weights make it, so the run goes back to before the update that made "
            "them and the learning rate is cut (replayed first)")


def samples_failed(sample_steps: Any, last: Optional[tuple], step: int, category: str) -> Optional[int]:
    """Per-sample recoveries that did not help: the failure (of ``WEIGHT_MADE``) was taken out of 3 of the last 4
    batches by dropping their worst samples, new ones each time (exp past its range on the largest scores of a
    ranker whose score scale keeps growing): the weights make it, not the rows. The first step of that series
    (the rollback goes to before it), else None."""
    rec = (last or (None, None))[1] or {}
    recent = [s for s in (sample_steps or ()) if step - 4 <= s < step]
    if category not in WEIGHT_MADE or len(recent) < 3 or rec.get("category") != category:
        return None
    return min(recent)


def samples_note(category: str, step: int, first: int) -> str:
    """What a recovery record says of a :func:`samples_failed` escalation."""
    return (f"the same {category} came back at step {step} on new samples of batch after batch since step {first}, "
            "each time with other rows dropped: the weights make it, not the rows, so the run goes back to before "
            f"step {first} and the learning rate is cut (replayed first)")
