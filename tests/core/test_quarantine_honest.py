"""Quarantine where the backend cannot keep rows out of later batches (Keras ``fit`` on arrays: no
``exclude_rows``): the recovery line, the record and the summary say the row was only dropped from its
batch and may come back, never that it is kept out of every later batch. No framework."""
from __future__ import annotations

from nanguard.core.events import Event
from nanguard.core.recovery.records import notice, summary_line
from nanguard.core.recovery import RecoveryPolicy

from test_quarantine_exclude import Excluding, _bad_row_event


def _again(step):
    ev = _bad_row_event(step=step)
    ev.cause["evidence"]["same_as_step"] = 14
    return ev


def test_a_row_not_kept_out_is_said_to_come_back():
    acts = Excluding(can=False)
    p = RecoveryPolicy(quiet=True)
    rec = p.on_failure(_bad_row_event(), step=14, actions=acts, history=[])
    q = rec["actions"]["quarantine"]
    assert q["rows"] == [100] and q["kept_out"] is False and "not kept out" in q["note"]
    line = notice(14, "bad_input_data", rec)
    assert "quarantined row 100 (" in line and "kept out of every later batch" not in line
    assert "not kept out of later batches" in line or "may come back" in line
    p.on_failure(_again(30), step=30, actions=acts, history=[])
    s = summary_line(p)
    assert "quarantined dataset row 100 (not kept out of later batches: came back 1 time" in s, s


def test_a_drop_samples_record_says_dropped_from_this_batch_only():
    rec = {"action": "drop_samples", "recovery_number": 1, "tries_left": 1,
           "actions": {"drop_samples": {"rows": [49]}, "quarantine": {"rows": [300], "kept_out": False}}}
    line = notice(9, "variance_zero", rec)
    assert "quarantined row 300 (dropped from this batch only: it may come back" in line, line


def test_a_row_kept_out_keeps_its_claim():
    p = RecoveryPolicy(quiet=True)
    rec = p.on_failure(_bad_row_event(), step=14, actions=Excluding(), history=[])
    assert "kept_out" not in rec["actions"]["quarantine"]
    assert "(kept out of every later batch)" in notice(14, "bad_input_data", rec)
    assert "not kept out" not in summary_line(p)


def test_a_recurrence_with_its_own_proven_row_quarantines_that_row():
    """Two empty records of a dataset (rows 100 and 125): a later failure whose own drop-samples replay
    proved row 125 names row 125, not the first failure's row 100 again."""
    acts = Excluding(can=False)
    p = RecoveryPolicy(quiet=True)
    p.on_failure(_bad_row_event(), step=14, actions=acts, history=[])
    ev = _again(30)
    ev.cause["evidence"]["experiments"] = [{"kind": "drop_samples", "finite": True, "params": {"rows": [5]},
                                            "details": {"rows": [5], "dataset_indices": [125]}}]
    rec = p.on_failure(ev, step=30, actions=acts, history=[])
    q = rec["actions"]["quarantine"]
    assert q["rows"] == [125] and "same_as_step" not in q, q
    assert p.quarantined == [100, 125]
    p.on_failure(_again(40), step=40, actions=acts, history=[])  # row 100 again
    s = summary_line(p)
    assert "rows 100, 125" in s and "came back 1 time" in s, s


def test_a_recurrence_not_relocalized_claims_no_samples():
    # (a random batch's recurrence was noted "assumed to be the same bad sample(s)": it holds other rows)
    acts = Excluding(can=False)
    p = RecoveryPolicy(quiet=True)
    p.on_failure(_bad_row_event(), step=14, actions=acts, history=[])
    ev = _bad_row_event(step=30, proven=False)
    ev.cause["evidence"]["same_as_step"] = 14
    ev.localization, ev.origin = {"reproduced": False}, {}
    rec = p.on_failure(ev, step=30, actions=acts, history=[])
    q = (rec or {}).get("actions", {}).get("quarantine") or {}
    assert q.get("same_as_step") == 14 and "samples are not known" in q.get("note", ""), q
    assert "rows" not in q
