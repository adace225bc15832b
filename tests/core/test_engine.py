"""The failure pipeline (nanguard.core.engine) driven by a fake backend: no torch, no TensorFlow.

From detections to the report: which failure is diagnosed, which is a consequence or a recurrence of
the first, the order of events (a recovered event before the unrecovered one at the same step), the
folding of recurrences, the early warnings, and the status.
"""
from __future__ import annotations

import json

import pytest

from nanguard.core.engine import FailurePipeline, Localized, Ports, RunFacts, assemble_report, info_rows
from nanguard.core.events import Detection, Event


def _loc(op: str, api: str, line: int, *, limit_fact: dict) -> dict:
    """A recorder-shaped localization: ``op`` made a non-finite value from finite inputs at ``line``."""
    return {"reproduced": True, "phase": "forward", "preexisting": None, "optimizer": None, "n_ops": 40,
            "notes": [], "sink": {"kind": "loss", "names": []}, "facts": limit_fact,
            "origin": {"op": op, "api": api, "module": None, "module_type": None, "file": "/u/train.py",
                       "line": line, "function": "<module>", "dtype": "float32", "shape": [8, 4],
                       "stage": "forward", "samples": [2], "kind": "op",
                       "inputs": [{"dtype": "float32", "shape": [8, 4], "numel": 32, "min": 0.0, "max": 1.0,
                                   "zeros": 3, "negatives": 0, "nonfinite": 0, "arg": 0}],
                       "output": {"nan": 0, "posinf": 0, "neginf": 3}}}


LOG = _loc("aten.log.default", "torch.log", 42, limit_fact={
    "log_domain": {"le_limit": 3, "zeros": 3, "negatives": 0, "min": 0.0, "numel": 32, "limit": 0.0},
    "float64_check": {"finite": False}})
SQRT = _loc("aten.sqrt.default", "torch.sqrt", 57, limit_fact={
    "sqrt_domain": {"le_limit": 2, "zeros": 0, "negatives": 2, "min": -0.5, "numel": 32, "limit": 0.0},
    "float64_check": {"finite": False}})
CALM = [{"step": i, "loss": 1.0 - 0.01 * i, "grad_norm": 2.0, "group_grad_norms": [2.0], "param_norm": 10.0,
         "update_ratio": 0.01, "lr": [0.1], "loss_scale": None, "skipped": False} for i in range(12)]


class FakeBackend:
    """The ports a backend supplies, with a replay per step (None: the replay did not reproduce)."""

    def __init__(self, replays: dict, rerun: dict | None = None) -> None:
        self.replays, self.rerun = replays, rerun or {}
        self.reruns: list = []

    def localize(self, det: Detection):
        loc = self.replays.get(det.step)
        if loc is None:
            return Localized(method="replay", reproduced=False, reason="no non-finite value appeared")
        return Localized(method="replay", reproduced=True, localization=loc, seconds=0.01)

    def relocalize(self, det: Detection, first):
        self.reruns.append(det.step)
        loc = self.rerun.get(det.step)
        return None if loc is None else {"method": "rerun", "reproduced": True, "localization": loc,
                                         "fallback_from": {"method": first.method, "reason": first.reason}}

    def ports(self) -> Ports:
        return Ports(context=lambda: {"optimizer": "SGD", "lr": [0.1], "framework": "fake"},
                     relocalize=self.relocalize)


def _hist(step: int) -> list:
    return [h for h in CALM if h["step"] < step]


def _run(backend: FakeBackend, dets: list, *, localized_steps=(), policy_events=(), warnings=()):
    pipe = FailurePipeline(backend.ports())
    events = list(policy_events)
    for det in dets:
        loc = backend.localize(det) if det.step in localized_steps else None
        events.append(pipe.explain(det, _hist(det.step), loc, relocalize=True))
    return assemble_report(RunFacts(steps_watched=12, history=CALM, events=events, warnings=list(warnings),
                                    info=info_rows([Detection(1, "optimizer", {"scaler_skip": True},
                                                              info_only=True)])))


def test_first_failure_is_diagnosed_and_later_ones_are_consequences_recurrences_or_new():
    be = FakeBackend({5: LOG, 9: SQRT})
    dets = [Detection(5, "forward"), Detection(6, "params", {"nonfinite_params_after_update": ["w"]}),
            Detection(7, "optimizer", {"nonfinite_params_after_update": ["w"]}), Detection(8, "forward"),
            Detection(9, "forward")]
    r = _run(be, dets, localized_steps={5, 9})
    evs = r.events
    assert [e.step for e in evs] == [5, 6, 7, 8, 9]
    first = evs[0]
    assert first.cause["category"] == "log_domain" and first.recurrence_of is None
    assert first.origin["line"] == 42 and first.localization["reproduced"] is True
    # params / optimizer after the first failure: what warn mode let through (a consequence)
    assert evs[1].recurrence_of == 5 and evs[2].recurrence_of == 5
    assert "consequence" in evs[1].cause["summary"]
    # the same phase again, not replayed: a recurrence of the first, its diagnosis kept
    assert evs[3].recurrence_of == 5 and evs[3].cause["category"] == "log_domain"
    # replayed again with another origin: an event of its own
    assert evs[4].recurrence_of is None and evs[4].cause["category"] == "sqrt_domain"
    assert r.status == "nonfinite" and r.first is first
    assert be.reruns == []  # the first replay reproduced: no re-run
    assert r.scaler_skips == 1 and r.info[0]["step"] == 1
    json.dumps(r.as_dict(), allow_nan=False)


def test_a_replay_with_the_same_cause_is_a_recurrence_and_runs_of_them_fold():
    be = FakeBackend({5: LOG, 6: LOG, 7: LOG})
    dets = [Detection(s, "forward") for s in (5, 6, 7)]
    r = _run(be, dets, localized_steps={5, 6, 7})
    assert [e.step for e in r.events] == [5, 6]
    folded = r.events[1]
    assert folded.recurrence_of == 5 and folded.count == 2 and folded.last_step == 7


def test_recurrences_of_another_phase_do_not_fold_together():
    be = FakeBackend({5: LOG})
    dets = [Detection(5, "forward"), Detection(6, "forward"), Detection(7, "params"), Detection(8, "params")]
    r = _run(be, dets, localized_steps={5})
    assert [(e.step, e.phase, e.count) for e in r.events] == [(5, "forward", None), (6, "forward", 1),
                                                                 (7, "params", 2)]


def test_the_first_failure_falls_back_to_the_backend_rerun_when_the_replay_did_not_reproduce():
    be = FakeBackend({}, rerun={5: LOG})
    r = _run(be, [Detection(5, "forward"), Detection(6, "forward")], localized_steps={5, 6})
    assert be.reruns == [5]  # only the first failure is re-run
    ev = r.events[0]
    assert ev.cause["category"] == "log_domain"
    assert ev.localization["method_kind"] == "rerun"
    assert ev.localization["fallback_from"]["reason"] == "no non-finite value appeared"
    assert r.events[1].recurrence_of == 5


def test_could_not_reproduce_is_said_and_no_origin_is_claimed():
    be = FakeBackend({})
    r = _run(be, [Detection(5, "forward")], localized_steps={5})
    ev = r.events[0]
    assert ev.origin is None and ev.localization["reproduced"] is False
    assert "could not reproduce" in ev.localization["method"]


def test_evaluation_failures_have_their_own_first_event():
    be = FakeBackend({5: LOG})
    r = _run(be, [Detection(3, "eval"), Detection(5, "forward"), Detection(6, "eval")], localized_steps={5})
    assert [(e.step, e.phase, e.recurrence_of) for e in r.events] == [(3, "eval", None), (5, "forward", None),
                                                                       (6, "eval", 3)]


def test_a_recovered_event_comes_before_the_unrecovered_one_at_the_same_step():
    recovered = Event(step=5, phase="forward", recovery={"ok": True, "action": "skip_step"})
    be = FakeBackend({5: LOG})
    r = _run(be, [Detection(5, "forward")], localized_steps={5}, policy_events=[recovered])
    assert [e.recovery is not None for e in r.events] == [True, False]
    assert r.status == "nonfinite"


@pytest.mark.parametrize("recoveries, warned, status", [
    ([{"ok": True}], False, "recovered"),
    ([{"ok": True}, {"ok": False}], False, "nonfinite"),
    ([], True, "warning"),
    ([], False, "clean"),
])
def test_status(recoveries, warned, status):
    events = [Event(step=i + 2, phase="forward", recovery=rec) for i, rec in enumerate(recoveries)]
    warnings = [Event(step=1, phase="forward", kind="warning")] if warned else []
    r = assemble_report(RunFacts(steps_watched=10, events=events, warnings=warnings))
    assert r.status == status
    if warned:
        assert r.as_dict()["events"][-1]["kind"] == "warning"


def test_the_assembler_is_idempotent_on_its_own_report():
    """A driver that re-assembles at each event (the Guard) gets the same events, not duplicates."""
    be = FakeBackend({5: LOG})
    pipe = FailurePipeline(be.ports())
    evs = [pipe.explain(Detection(s, "forward"), _hist(s), be.localize(Detection(s, "forward")))
           for s in (5, 6, 7)]
    w = Event(step=2, phase="forward", kind="warning")
    r = assemble_report(RunFacts(events=evs, warnings=[w]))
    again = assemble_report(RunFacts(events=[e for e in r.events if not e.is_warning], warnings=[w]), r)
    assert again is r and [e.step for e in r.events] == [5, 6, 2] and r.events[1].count == 2


def test_localized_round_trip_keeps_backend_keys():
    d = {"method": "replay-tape", "reproduced": 1, "localization": {"x": 1}, "eager": True, "compiled": "yes"}
    run = Localized.coerce(d)
    assert run.reproduced is True and run.eager and run.extra == {"compiled": "yes"}
    assert Localized.coerce(run.as_dict()) == run
    with pytest.raises(TypeError):
        Localized.coerce(["not", "a", "dict"])


def test_every_driver_s_report_says_a_run_that_diverged_again_after_its_recovery_was_not_recovered():
    # the JAX driver (and the Guard, and zero-code) called a run "recovered" whose loss went on from 2.6
    # to 1e26 after its one recovery; only the TensorFlow driver checked: the check is in the assembler now
    def ev(step, kind, ok):
        return Event(step=step, phase="forward", origin={}, kind=kind,
                     cause={"category": "lr_too_high", "summary": "s", "confidence": 0.6}, fixes=[],
                     recovery={"action": "rollback+lr_backoff", "ok": True} if ok else None)
    fail, late = ev(12, "failure", True), ev(13, "warning", False)
    # x100 a step up to the failure at 12, rolled back to 0, then x100 a step again from the lowered rate
    history = [{"step": i, "loss": 2.6 * 100.0 ** (i if i < 12 else i - 12)} for i in range(32)]
    rep = assemble_report(RunFacts(history=history, events=[fail], warnings=[ev(1, "warning", False), late]))
    assert rep.status == "nonfinite" and fail.recovery["ok"] is False
    assert "kept diverging" in fail.recovery["kept_diverging"] and "(steps 13)" in fail.recovery["kept_diverging"]
    back = [{"step": i, "loss": 2.6} for i in range(32)]  # the same events, the loss back where it was: recovered
    fail2 = ev(12, "failure", True)
    rep2 = assemble_report(RunFacts(history=back, events=[fail2], warnings=[ev(13, "warning", False)]))
    assert rep2.status == "recovered" and fail2.recovery["ok"] is True


def test_a_run_that_skipped_every_step_from_its_first_failure_to_its_end_is_not_recovered():
    """LBFGS on one full batch holding a NaN row: steps 0..7 all skipped, the test loss never moved, and the report
    said "recovered". A run that trained after its skips is still recovered."""
    def ev(step):
        return Event(step=step, phase="data", origin={}, kind="failure",
                     cause={"category": "bad_input_data", "summary": "s", "confidence": 0.9}, fixes=[],
                     recovery={"action": "skip_step", "ok": True})
    evs = [ev(s) for s in range(8)]
    rep = assemble_report(RunFacts(steps_watched=8, events=evs))
    assert rep.status == "nonfinite" and "no update was applied" in evs[-1].recovery["nothing_trained"]
    from nanguard.core.render.terminal import summary_line
    assert "; not recovered: every step from 0" in summary_line(rep)
    evs2 = [ev(s) for s in range(8)]
    assert assemble_report(RunFacts(steps_watched=9, events=evs2)).status == "recovered"


def test_a_cut_list_of_batch_rows_says_so():
    """The recorders name at most 10 rows: 25 bad windows read "5, 6, ... 14" as if that were all of them."""
    from nanguard.core.text import sample_rows
    assert sample_rows(list(range(5, 15))) == "5, 6, 7, 8, 9, 10, 11, 12, 13, 14 (the first 10; there may be more)"
    assert sample_rows([3, 7]) == "3, 7"


def test_rows_of_an_optimizer_stage_origin_are_the_parameter_s():
    """An update's non-finite output rows are rows of the parameter: they read "batch rows 0, 1, ... 9"."""
    from nanguard.core.text import rows_label
    assert rows_label({"stage": "optimizer"}) == "parameter rows" and rows_label({"stage": "forward"}) == "batch rows"


def test_a_max_grad_norm_at_the_scripts_clip_says_so():
    """The recorded norms are read after the script's clip (HF Trainer's max_grad_norm=1.0): "max grad norm 1"
    read as if the gradients were small."""
    from nanguard.core.events import Report
    from nanguard.core.render.terminal import summary_line
    rep = Report(steps_watched=10, max_grad_norm=1.0,
                 history=[{"step": i, "grad_norm": 1.0 if i % 2 else 0.4} for i in range(10)])
    assert "max grad norm 1 (the clip's max_norm: 50% of the steps shown sit at it)" in summary_line(rep)
    rep.history = [{"step": i, "grad_norm": 0.1 * (i + 1)} for i in range(10)]  # no ceiling
    assert "max grad norm 1, " in summary_line(rep)


def test_rows_of_a_hand_written_update_are_the_parameters():
    """A hand-written Adam under no_grad: its op's stage is "forward", the failure's phase "optimizer"; the rows
    of its (5, 32) weight were shown as "batch rows 0, 1, 2, 3, 4"."""
    from nanguard.core.text import rows_label
    assert rows_label({"stage": "forward"}, "optimizer") == "parameter rows"
    assert rows_label({"stage": "optimizer"}) == "parameter rows"
    assert rows_label({"stage": "forward"}, "forward") == "batch rows"
