"""The framework-neutral side of the counterfactual experiments (``nanguard.core.experiments``) and of the
verified recovery (``nanguard.core.recovery.verify``), on plain records and a scripted bench, without torch:
the planner's order, the verdict table, the investigation loop (budget, refute then next candidate),
the calibration table, and the policy that applies only what a replay verified and counts per-sample
failures against the bad-data budget (the TensorFlow backend drives the same policy)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from nanguard.core.events import Event
from nanguard.core.experiments import Bench, Experiment, ExperimentConfig, Situation, investigate, judge, plan
from nanguard.core.experiments.calibration import calibration_table, share_right_at
from nanguard.core.recovery import RecoveryPolicy
from nanguard.core.recovery.verify import per_sample, verified_plan

from test_recovery_policy import FakeActions


def test_core_experiments_import_no_framework():
    code = ("import sys, nanguard.core.experiments, nanguard.core.recovery.verify; "
            "print(any(m in sys.modules for m in ('torch', 'tensorflow', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------- planner

def caps(**kw):
    c = {"batch_size": 32, "module_chain": ["enc.block", "enc", ""], "float64": True, "op_patch": True,
         "compiled": False, "snapshots": [], "lrs": [0.1]}
    c.update(kw)
    return c


def test_plan_precision_looks_for_the_smallest_module_first():
    s = Situation("low_precision_overflow", {"dtype": "float16", "op": "aten.mul.Tensor"}, caps=caps())
    kinds = [(sp.kind, sp.params.get("module")) for sp in plan("low_precision_overflow", s)]
    assert kinds[:3] == [("upcast_module", "enc.block"), ("upcast_module", "enc"), ("upcast_module", "")]
    assert ("float64_step", None) in kinds


def test_plan_exact_category_in_float16_tests_precision_before_the_domain_guard():
    o = {"dtype": "float16", "op": "aten.log.default", "samples": [3], "shape": [32, 8]}
    specs = plan("log_domain", Situation("log_domain", o, caps=caps()))
    kinds = [sp.kind for sp in specs]
    assert kinds.index("float64_step") < kinds.index("domain_guard")
    assert specs[0].kind == "drop_samples" and specs[0].params == {"rows": [3]}


def test_plan_rows_only_when_the_origin_rows_are_batch_rows():
    s = Situation("div_by_zero", {"dtype": "float32", "op": "aten.div.Tensor", "samples": [5], "shape": [8, 3]},
                  caps=caps(batch_size=8))
    assert plan("div_by_zero", s)[0].params == {"rows": [5]}
    s.origin["shape"] = [24, 3]  # a (batch * time) view: bisect instead
    specs = plan("div_by_zero", s)
    assert [sp.params for sp in specs if sp.kind == "drop_samples"] == [{"bisect": True}]


def test_plan_drops_the_named_rows_of_a_cause_no_category_names():
    """A CTC loss that is +inf for one batch row (no alignment fits its target: "other") was skipped, and the
    sample came back every epoch; the replay without that row proves it per-sample (the recovery drops it)."""
    o = {"dtype": "float32", "op": "CTCLoss", "samples": [5], "shape": [16]}
    specs = plan("other", Situation("other", o, caps=caps(batch_size=16)))
    assert [(x.kind, x.params) for x in specs] == [("drop_samples", {"rows": [5]})]
    assert plan("other", Situation("other", dict(o, samples=[]), caps=caps(batch_size=16))) == []


def test_plan_history_replays_fit_the_budget_and_not_reproduced_means_determinism():
    s = Situation("lr_too_high", {}, step=60, caps=caps(snapshots=[50, 58, 59]), max_replay_steps=3)
    specs = plan("lr_too_high", s)
    assert [sp.kind for sp in specs] == ["lr_replay", "clip_replay"]
    assert specs[0].params["from_step"] == 59 and specs[0].params["factor"] == pytest.approx(0.1)
    s = Situation("other", {}, reproduced=False, caps=caps(compiled=True))
    assert [sp.kind for sp in plan("other", s)] == ["eager", "determinism"]


# --------------------------------------------------------------------------- verdicts

@pytest.mark.parametrize("kind,params,finite,low,cat,verdict", [
    ("drop_samples", {"rows": [1]}, True, False, "div_by_zero", "confirms"),
    ("drop_samples", {"rows": [1]}, False, False, "bad_input_data", "refutes"),
    ("drop_samples", {"rows": [1]}, True, False, "low_precision_overflow", None),
    ("upcast_module", {"module": "a", "whole_model": False}, True, True, "low_precision_overflow", "confirms"),
    ("upcast_module", {"module": "a", "whole_model": False}, False, True, "low_precision_overflow", None),
    ("upcast_module", {"module": "", "whole_model": True}, False, True, "low_precision_overflow", "refutes"),
    ("float64_step", {}, True, True, "log_domain", "refutes"),
    ("float64_step", {}, True, False, "log_domain", None),  # float32: rounding to the domain's edge is log_domain
    ("float64_step", {}, False, True, "low_precision_underflow", "refutes"),
    ("domain_guard", {"op": "log"}, True, False, "log_domain", "confirms"),
    ("lr_replay", {}, False, False, "lr_too_high", "refutes"),
    ("clip_replay", {}, True, False, "gradient_explosion", "confirms"),
])
def test_verdicts(kind, params, finite, low, cat, verdict):
    e = Experiment(kind, "x", params=params, finite=finite)
    assert judge(cat, e, {"low": low}) == verdict
    assert judge(cat, Experiment(kind, "x", params=params, finite=None, error="could not run")) is None


# --------------------------------------------------------------------------- the investigation

class ScriptedBench(Bench):
    """Outcomes by kind; each run takes ``cost`` replays (and seconds) of a 1 s step."""

    def __init__(self, outcomes, caps_=None, cost=1.0):
        self.outcomes, self.caps_, self.cost, self.ran = outcomes, caps_ or caps(), cost, []

    def capabilities(self, origin):
        return self.caps_

    def step_seconds(self):
        return 1.0

    def run(self, spec, seconds_left):
        self.ran.append(spec.kind)
        fin = self.outcomes.get(spec.kind)
        return Experiment(spec.kind, spec.kind, params=dict(spec.params), finite=fin, seconds=self.cost,
                          replays=1, work=self.cost, details={"rows": spec.params.get("rows")} if spec.kind == "drop_samples" else {})


def fp16_log_event():
    origin = {"op": "aten.log.default", "dtype": "float16", "module": "enc.block", "file": "t.py", "line": 3,
              "output": {"nan": 0, "posinf": 0, "neginf": 4}, "inputs": [{"zeros": 4, "numel": 64}],
              "samples": [0, 1, 2, 3], "shape": [4, 16]}
    return Event(step=7, phase="forward", origin=origin,
                 cause={"category": "log_domain", "summary": "log of 0", "confidence": 0.8, "evidence": {}},
                 fixes=["clamp"], localization={"reproduced": True, "method": "replayed"})


def test_refuted_cause_is_replaced_by_what_the_replay_proves():
    ev = fp16_log_event()
    bench = ScriptedBench({"float64_step": True, "domain_guard": True},
                          caps(batch_size=4))  # every row bad: no drop experiment
    out = investigate(ev, bench, ExperimentConfig())
    assert bench.ran == ["float64_step"]  # stopped at the first decisive one
    assert ev.cause["category"] == "low_precision_underflow" and ev.cause["confirmed_by"]["kind"] == "float64_step"
    assert ev.cause["ruled_out"][0]["category"] == "log_domain" and ev.cause["confidence"] >= 0.95
    assert out["ruled_out"] == ["log_domain"] and ev.fixes and ev.fixes != ["clamp"]


def test_refuted_cause_then_the_rediagnosed_candidate_is_tested():
    ev = Event(step=3, phase="data", origin={"samples": [2], "shape": [8, 4]},
               cause={"category": "bad_input_data", "summary": "NaN row", "confidence": 0.95, "evidence": {}},
               localization={"reproduced": True})
    asked = []

    def rediagnose(excluded):
        asked.append(list(excluded))
        return {"category": "div_by_zero", "summary": "x/0", "confidence": 0.9, "evidence": {}}, ["guard it"]

    bench = ScriptedBench({"drop_samples": False, "domain_guard": True}, caps(batch_size=8))
    ev.origin.update(op="aten.div.Tensor", dtype="float32")
    investigate(ev, bench, ExperimentConfig(), rediagnose=rediagnose)
    assert asked == [["bad_input_data"]]
    assert ev.cause["category"] == "div_by_zero" and ev.cause["confirmed_by"]["kind"] == "domain_guard"
    assert ev.cause["ruled_out"][0]["by"] == "drop_samples" and ev.fixes == ["guard it"]


def test_budget_stops_before_an_experiment_that_does_not_fit():
    ev = fp16_log_event()
    bench = ScriptedBench({"float64_step": False, "domain_guard": True}, caps(batch_size=4), cost=2.5)
    investigate(ev, bench, ExperimentConfig(budget_steps=3))
    assert bench.ran == ["float64_step"]  # 2.5 replays spent, the guard (1.5) does not fit in 3
    cost = ev.cause["evidence"]["experiments_cost"]
    assert cost["not_run_for_budget"] == ["domain_guard"] and cost["step_multiple"] == 2.5
    assert "confirmed_by" not in ev.cause and ev.cause["category"] == "log_domain"


def test_recovery_verification_runs_the_proof_of_the_action():
    ev = fp16_log_event()
    bench = ScriptedBench({"float64_step": True, "upcast_module": True}, caps(batch_size=4))
    investigate(ev, bench, ExperimentConfig(), recovering=True)
    assert bench.ran == ["float64_step", "upcast_module"]
    exps = ev.cause["evidence"]["experiments"]
    acts, proofs, notes = verified_plan(ev.cause, ["upcast", "loss_scale"], ["upcast", "loss_scale", "skip_step"],
                                        "forward")
    assert acts == ["upcast", "loss_scale"] and proofs["upcast"]["params"]["module"] == "enc.block"
    assert exps[1]["finite"] is True


# --------------------------------------------------------------------------- verified recovery, budget

def event_with(cat, experiments=None, origin=None, phase="forward"):
    ev = {"category": cat, "summary": "", "confidence": 0.9, "evidence": {}}
    if experiments is not None:
        ev["evidence"]["experiments"] = experiments
        ev["evidence"]["experiments_cost"] = {"seconds": 0.1}
    return Event(step=5, phase=phase, origin=origin, cause=ev)


def test_policy_applies_only_verified_training_changes():
    pol = RecoveryPolicy(quiet=True)
    acts = FakeActions()
    rec = pol.on_failure(event_with("low_precision_overflow", []), step=5, actions=acts, history=[])
    assert rec["action"] == "skip_step" and "upcast not applied" in rec["actions"]["notes"][0]
    proof = {"kind": "upcast_module", "finite": True, "params": {"module": "head"}, "change": "m"}
    rec = pol.on_failure(event_with("low_precision_overflow", [proof]), step=9, actions=acts, history=[])
    assert rec["action"].startswith("upcast") and rec["verified"] == "verified by replay before applying"
    assert ("upcast", "head") in acts.calls
    # no experiment could run at all (no replayable step): the table as before, not claimed verified
    rec = pol.on_failure(event_with("low_precision_overflow"), step=20, actions=acts, history=[])
    assert "verified" not in rec


def test_per_sample_failures_count_against_the_bad_data_budget():
    """13 empty-bag batches in 50 steps (the Keras bag scenario): over the general budget (10 in 100), within
    the bad-data one."""
    pol = RecoveryPolicy(quiet=True)
    acts = FakeActions()
    origin = {"samples": [42], "shape": [48, 16], "op": "div"}
    for step in (5, 11, 13, 14, 19, 22, 24, 26, 33, 36, 39, 43, 45):
        ev = event_with("div_by_zero", origin=origin)
        ev.step = step
        assert per_sample(ev)
        assert pol.on_failure(ev, step=step, actions=acts, history=[]) is not None, pol.stopped
    assert len(pol.budget.sample_steps) == 13 and pol.budget.recovery_steps == pol.budget.data_steps == []
    # a failure in every row is not per-sample: the general budget
    assert not per_sample(event_with("div_by_zero", origin={"samples": list(range(10)), "shape": [10, 4]}))
    assert not per_sample(event_with("low_precision_overflow", origin=origin))


def test_per_sample_failures_in_most_batches_stop_the_skipping():
    """A computation that fails on a few samples of most batches (an exp whose weights grew: the Poisson GLM
    at too high a rate) is no rare bad row: at the 16th skip within 20 steps recovery stops, and says why."""
    pol = RecoveryPolicy(quiet=True)
    acts = FakeActions()
    origin = {"samples": [7], "shape": [128, 1], "op": "exp"}
    recs = []
    for step in [s for s in range(28, 70) if s % 8 != 7]:  # 7 failing steps in every 8, never 8 in a row
        ev = event_with("exp_overflow", origin=origin)
        ev.step = step
        recs.append(pol.on_failure(ev, step=step, actions=acts, history=[]))
        if recs[-1] is None:
            break
    assert all(r is not None and r["action"] == "skip_step" for r in recs[:-1]) and len(recs) <= 20
    assert recs[0]["tries_left"]["recoveries"] == 14  # skips of failing samples left in the window
    assert recs[-1] is None and "recurred on a few samples at 15 of the last 20 steps" in pol.stopped


def test_calibration_table():
    rows = [{"confidence": 0.97, "right": True}, {"confidence": 0.92, "right": False},
            {"confidence": 0.85, "right": True}, {"confidence": 0.3, "right": False}]
    t = calibration_table(rows)
    assert [b["bucket"] for b in t] == [[0.0, 0.5], [0.8, 0.9], [0.9, 0.95], [0.95, 1.0]]
    assert share_right_at(rows) == {"threshold": 0.9, "n": 2, "right": 1, "share": 0.5}


def test_per_sample_failures_in_a_quarter_of_the_batches_stop_the_skipping():
    """Sparse but persistent (an ordinal model's crossed cut-points fail on its rare class in 71 of 180 steps,
    never dense enough for 15 of 20): a computation failing on samples of a quarter of the last 100 steps
    fails on ordinary inputs; dropping them all trained on what was left."""
    pol = RecoveryPolicy(quiet=True)
    acts = FakeActions()
    origin = {"samples": [3], "shape": [64, 4], "op": "log"}
    recs = []
    for step in range(20, 200, 3):
        ev = event_with("log_domain", origin=origin)
        ev.step = step
        recs.append(pol.on_failure(ev, step=step, actions=acts, history=[]))
        if recs[-1] is None:
            break
    assert recs[-1] is None and len(recs) == 26, len(recs)
    assert "recurred on a few samples at 25 of the last 100 steps (limit 25)" in pol.stopped
    assert (recs[-2]["tries_left"]["recoveries"], recs[-2]["tries_left"]["window"]) == (0, 100)
