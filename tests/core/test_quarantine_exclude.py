"""Quarantine: dataset rows a drop-samples replay proved bad are handed to the backend to keep out of
every later batch (``RecoveryActions.exclude_rows``); rows only localized, never proven, are not. No torch."""
from __future__ import annotations

from nanguard.core.events import Event
from nanguard.core.recovery import RecoveryPolicy
from nanguard.core.recovery.records import summary_line

from test_recovery_policy import FakeActions


class Excluding(FakeActions):
    def __init__(self, can=True, **kw):
        super().__init__(**kw)
        self.can, self.excluded = can, []

    def exclude_rows(self, rows):
        if not self.can:
            return None
        self.excluded.append(list(rows))
        return {"rows": list(rows), "how": "test"}


def _bad_row_event(step=14, proven=True):
    exps = [{"kind": "drop_samples", "finite": proven, "params": {"rows": [27]},
             "details": {"rows": [27], "dataset_indices": [100]}}]
    cause = {"category": "bad_input_data", "summary": "s", "confidence": 0.9, "evidence": {"experiments": exps}}
    return Event(step=step, phase="forward", origin={"samples": [27], "source_rows": [100]}, cause=cause,
                 fixes=["check the data"])


def test_a_proven_row_is_excluded_and_the_record_says_so():
    acts = Excluding()
    p = RecoveryPolicy(quiet=True)
    rec = p.on_failure(_bad_row_event(), step=14, actions=acts, history=[])
    assert acts.excluded == [[100]]
    assert rec["actions"]["quarantine"]["excluded"]["rows"] == [100]
    p.row_filters += [{"step": 26, "rows": [100]}, {"step": 34, "rows": [100]}]  # what the backend counts
    assert "quarantined dataset row 100 (taken out of 2 later batches)" in summary_line(p)


def test_an_unproven_row_or_a_backend_that_cannot_is_only_recorded():
    acts = Excluding()
    rec = RecoveryPolicy(quiet=True).on_failure(_bad_row_event(proven=False), step=14, actions=acts, history=[])
    assert acts.excluded == [] and "excluded" not in rec["actions"]["quarantine"]
    assert rec["actions"]["quarantine"]["rows"] == [100]
    acts = Excluding(can=False)
    rec = RecoveryPolicy(quiet=True).on_failure(_bad_row_event(), step=14, actions=acts, history=[])
    assert "excluded" not in rec["actions"]["quarantine"]
