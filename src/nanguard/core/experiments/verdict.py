"""What the experiments make of a cause: the report fields and the confidence.

* confirmed (the step is finite once the cause is removed): ``cause.confirmed_by``, the summary says
  so, and the confidence is at least :data:`CONFIRMED`;
* refuted: the category goes to ``cause.ruled_out`` (with the experiment and why) and the next
  candidate stands in; a candidate that no experiment confirmed keeps the diagnosis' confidence,
  lowered by :data:`AFTER_REFUTED` (the first guess was wrong once);
* neither: the diagnosis' own (calibrated) confidence.

Calibration (measured on the scenario suites with ``python -m benchmarks.calibration``, table in
docs/EXPERIMENTS.md): every confirmed cause was right, which is what :data:`CONFIRMED` says.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .kinds import DIVERGENCE, PER_SAMPLE, PRECISION
from .reconcile import reconcile
from .records import Experiment, confirmed_record
from .tested import tested_fixes

CONFIRMED = 0.97
AFTER_REFUTED = 0.7

# the recovery action whose use a category's proof verifies (the policy applies it only if verified)
NEEDS_PROOF: Dict[str, str] = {**{c: "upcast" for c in PRECISION}, "lr_too_high": "lr_backoff",
                               "gradient_explosion": "clip"}
NEEDS_PROOF.update({c: "drop_samples" for c in PER_SAMPLE if c not in NEEDS_PROOF})
assert not (set(NEEDS_PROOF) - PRECISION - DIVERGENCE - PER_SAMPLE)


def finalize(event: Any, experiments: List[Experiment], confirmed: Optional[Experiment],
             ruled_out: List[Dict[str, Any]], cost: Dict[str, Any], original: Optional[str],
             implied: bool = False, framework: Optional[str] = None) -> None:
    """Write the experiments' outcome into ``event.cause`` (in place), and reconcile ``event.fixes`` with
    the fixes the replays tested (:mod:`.reconcile`, in ``framework``'s words). ``implied``: the cause was
    written from the confirming experiment (its summary already says what the replay showed)."""
    cause = event.cause if isinstance(event.cause, dict) else {}
    event.cause = cause
    ev = cause.setdefault("evidence", {})
    ev["experiments"] = [e.as_dict() for e in experiments]
    ev["experiments_cost"] = cost
    if ruled_out:
        cause["ruled_out"] = ruled_out
    conf = float(cause.get("confidence") or 0.0)
    if confirmed is not None:
        cause["confirmed_by"] = confirmed_record(confirmed)
        cause["confidence"] = round(max(conf, CONFIRMED), 3)
        if not implied:
            cause["summary"] = f"{cause.get('summary', '')}. Confirmed by replay: with {confirmed.change} the " \
                               f"step is finite"
        rows = confirmed.details.get("rows") if confirmed.kind == "drop_samples" else None
        if rows:
            ev["bad_samples"] = {"batch_rows": rows, **({"dataset_indices": confirmed.details["dataset_indices"]}
                                                  if confirmed.details.get("dataset_indices") else {})}
    elif ruled_out:
        cause["confidence"] = round(min(conf, AFTER_REFUTED), 3)
    if ruled_out and cause.get("category") != original:
        how = "by the same replay" if (implied and confirmed is not None and ruled_out[0]["by"] == confirmed.kind) \
            else f"{ruled_out[0]['why']}"
        cause["summary"] = f"{cause.get('summary', '')} (first candidate {original} ruled out {how})" \
            if how.startswith("by") else f"{cause.get('summary', '')} (first candidate {original} ruled out: {how})"
    det = next((e for e in experiments if e.kind == "determinism" and e.ran), None)
    if det is not None:
        finding = determinism_finding(det, compiled=framework == "tensorflow" and bool(
            getattr(event, "cause", None) and (event.cause.get("evidence") or {}).get("masked_in_replay")))
        ev["determinism"] = finding
        cause["summary"] = f"{cause.get('summary', '')}. {finding}"
    tested = tested_fixes(ev["experiments"])
    if tested:
        cause["tested_fixes"] = tested
    reconcile(event, framework)
    if experiments:
        n_ok = sum(1 for e in experiments if e.finite)
        ev["experiments_note"] = (f"{len(experiments)} counterfactual replay(s), {n_ok} finite, "
                                  f"{cost.get('seconds')} s")


def determinism_finding(e: Experiment, compiled: bool = False) -> str:
    """What two unchanged replays of the failing step say (the failure itself was seen once). ``compiled``: the
    failing step ran as a graph and the replays op by op, and one of their ops made a value a later op dropped."""
    d = e.details
    if compiled and d.get("identical") and d.get("first_finite"):
        return ("The same step replayed twice op by op is finite both times, identically: the step that failed "
                "ran as a compiled graph, whose kernels kept the non-finite value the eager ops dropped (not a "
                "transient)")
    if not d.get("identical"):
        return ("The same step replayed twice from the same state, data and RNG gave different results: "
                "something outside them varies (nondeterministic kernels, another thread or process writing "
                "the inputs, or a hardware fault)")
    if d.get("first_finite"):
        return ("The same step replayed twice from the same state, data and RNG is finite both times: the "
                "failure did not come from them (a transient: another process, a hardware fault, or state the "
                "replay does not restore)")
    return "The same step replayed twice is non-finite both times, identically: the failure is deterministic"
