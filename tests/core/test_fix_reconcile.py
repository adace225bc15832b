"""The numbered fixes follow what the replays showed (issues 22/23, core/experiments/reconcile.py): a fix whose
replay failed is not printed first (reworded to what passed, or marked and moved last), a fix that passed
is printed first, and a numeric fix no replay tested says so, in the JSON, the terminal and the HTML."""
from __future__ import annotations

import io
import json

from nanguard.cli.reportfile import report_type_error
from nanguard.core.diagnosis import fixes as X
from nanguard.core.events import Event, Report
from nanguard.core.experiments import Bench, Experiment, ExperimentConfig, investigate
from nanguard.core.experiments.reconcile import fix_kind, reconcile
from nanguard.core.experiments import tested as tested_mod
from nanguard.core.render.html_sections import fixes_section


def _lr(template="lower the learning rate from 0.1 to {about}", value="0.01", factor=None):
    """A learning-rate fix as the rules write it (structured: fixes.lr_sentence)."""
    return X.lr_sentence(template, value, factor)


def _bound(*texts, fw="pytorch"):
    """Fix sentences built with the builders (``texts``: callables run while speaking ``fw``), bound as the
    diagnosis binds them."""
    with X.speaking(fw):
        return X.bind([t() if callable(t) else t for t in texts])


LR = "lower the learning rate from 0.1 to about 0.01"


def _event(fixes, experiments, category="lr_too_high", origin=None, **evidence):
    cause = {"category": category, "summary": "s", "confidence": 0.8,
             "evidence": {"experiments": experiments, "experiments_cost": {"replays": 3}, **evidence}}
    ev = Event(step=9, phase="forward", origin=origin, cause=cause, fixes=list(fixes),
               localization={"reproduced": True})
    t = tested_mod.tested_fixes(experiments)
    if t:
        ev.cause["tested_fixes"] = t
    return ev


def _guard(op, guard):
    """A domain_guard replay of ``op`` that passed (its inputs kept inside the domain by ``guard``)."""
    return {"kind": "domain_guard", "change": f"the inputs of {op} kept inside its domain ({guard})", "finite": True,
            "replays": 1, "params": {"op": op, "guard": guard}}


def _lr_exp(lrs, finite, tried=None, factor=0.1):
    d = {"lr": lrs, "steps": 3, "losses": [2.0, 1.5]}
    if tried:
        d["tried"] = tried
    return {"kind": "lr_replay", "finite": finite, "replays": 3, "params": {"factor": factor, "from_step": 6},
            "details": d}


def test_an_lr_fix_is_reworded_to_the_rate_that_passed_and_printed_first():
    # the rule guessed 0.01; the replay found 0.01 still diverging and 0.001 finite
    exp = _lr_exp([0.001], True, tried=[{"factor": 0.1, "finite": False}, {"factor": 0.01, "finite": True}],
                  factor=0.01)
    ev = _event(["use betas=(0.9, 0.999)", _lr(),
                 "clip the gradient norm (torch.nn.utils.clip_grad_norm_) as a safety net, and add a warm-up"], [exp])
    reconcile(ev, "pytorch")
    assert ev.fixes[0] == "lower the learning rate from 0.1 to 0.001"
    assert ev.fixes[1] == "use betas=(0.9, 0.999)"
    assert ev.cause["tested_fixes"][0]["fix_index"] == 0
    assert "untested_fixes" not in ev.cause


def test_a_fix_the_replay_agrees_with_keeps_its_words():
    ev = _event([_lr(), "check the data"], [_lr_exp([0.01], True)])
    reconcile(ev, "pytorch")
    assert ev.fixes == ["lower the learning rate from 0.1 to about 0.01", "check the data"]


def test_a_warmup_fix_moves_its_factor_with_the_rate():
    exp = _lr_exp([0.0005], True, factor=0.005)
    ev = _event([_lr("lower the schedule's peak learning rate to {about} (multiply the base lr by {factor}), or "
                     "lengthen the warm-up", "0.01", "0.1")], [exp])
    reconcile(ev, "pytorch")
    assert ev.fixes[0].startswith("lower the schedule's peak learning rate to 0.0005 (multiply the base lr "
                                  "by 0.005)")


def test_an_lr_fix_whose_replay_failed_is_marked_and_moved_after_the_others():
    exp = _lr_exp([0.01], False, tried=[{"factor": 0.1, "finite": False}, {"factor": 0.01, "finite": False}],
                  factor=0.01)
    exp["details"]["lr"] = [0.001]
    ev = _event([_lr(), "check the data loader"], [exp])
    reconcile(ev, "pytorch")
    assert ev.fixes[0] == "check the data loader"
    assert ev.fixes[1].startswith("lower the learning rate from 0.1 to about 0.01 (replay: lr 0.001 still "
                                  "non-finite)")
    assert ev.cause["tested_fixes"][0]["fix_index"] == 1


def test_a_clip_whose_replay_stayed_finite_but_kept_growing_says_still_diverging():
    # (the note said "clip at 0.0397 still non-finite" where the replay's steps were finite and the loss grew)
    exp = {"kind": "clip_replay", "finite": True, "replays": 8, "params": {"max_norm": 0.04, "from_step": 6},
           "details": {"steps": 8, "losses": [2.0, 9.0], "growing": True}}
    ev = _event(_bound(lambda: "clip the gradient norm: " + X.clip_grad_norm("0.04")), [exp])
    reconcile(ev, "pytorch")
    assert "still diverging" in ev.fixes[0] and "non-finite" not in ev.fixes[0], ev.fixes[0]


def test_the_upcast_fix_names_the_scope_that_passed_in_keras_words():
    # the Keras LSTM fp16 case: 'sequential/out' alone stays non-finite, the whole model in float32 is finite
    origin = {"op": "MatMul", "module": "sequential/out", "layer": "sequential/out", "module_type": "Dense",
              "dtype": "float16", "file": "t.py", "line": 9}
    exps = [{"kind": "upcast_module", "finite": False, "replays": 1, "params": {"module": "sequential/out"}},
            {"kind": "upcast_module", "finite": True, "replays": 1, "params": {"module": "", "whole_model": True}}]
    with X.speaking("tensorflow"):
        first = X.float32_layer(origin, "t.py:9")
    ev = _event([first, "use the \"mixed_bfloat16\" policy", "rescale the quantities"], exps,
                category="low_precision_overflow", origin=origin)
    reconcile(ev, "tensorflow")
    assert ev.fixes[0].startswith("run the whole model in float32: keras.mixed_precision.set_global_policy")
    assert "layer 'sequential/out' alone: replay still non-finite" in ev.fixes[0]
    assert "torch" not in ev.fixes[0]
    assert [t["fix_index"] for t in ev.cause["tested_fixes"] if t["passed"]] == [0]


def test_an_upcast_fix_whose_scope_and_every_wider_one_failed_is_marked():
    origin = {"op": "mm", "module": "enc.1", "module_type": "Linear", "dtype": "float16", "file": "t.py", "line": 3}
    exps = [{"kind": "upcast_module", "finite": False, "replays": 1, "params": {"module": "", "whole_model": True}}]
    ev = _event([X.float32_layer(origin, "t.py:3"), "normalise the inputs"], exps, category="other",
                origin=origin)
    reconcile(ev, "pytorch")
    assert ev.fixes[0] == "normalise the inputs"
    assert ev.fixes[1].endswith("(replay: the whole model in float32 still non-finite)")


def test_a_numeric_fix_no_replay_tested_is_listed_untested_with_why():
    ev = _event([_lr(), *_bound(lambda: "or clip the gradient norm before the update: " + X.clip_grad_norm("0.25")),
                 "check the data"], [],
                experiments_unavailable=["lr_replay", "clip_replay"])
    reconcile(ev, "pytorch")
    un = {u["fix_index"]: u for u in ev.cause["untested_fixes"]}
    assert set(un) == {0, 1} and un[0]["kind"] == "lr" and un[1]["kind"] == "clip"
    assert "no snapshot" in un[0]["why"]
    assert ev.fixes[0] == "lower the learning rate from 0.1 to about 0.01"  # the words are unchanged


def test_fix_kinds_follow_the_builders():
    clip, f32 = _bound(lambda: "clip: " + X.clip_grad_norm("1.5"), lambda: X.float32_layer({"module": "dense_1"},
                                                                                               "t.py:3"), fw="tensorflow")
    assert fix_kind(clip) == "clip" and fix_kind(f32) == "dtype" and fix_kind(X.float32_model()) == "dtype"
    assert clip.value == 1.5 and f32.scope == "dense_1" and X.float32_model().scope == ""
    assert fix_kind(X.scale_step("10", "0.1", "1")) == "lr"
    mom, log = _bound(lambda: f"lower the momentum to 0.9 (effective step 1) or the learning rate to {X.lr_about('0.01')}",
                      lambda: X.call("log", X.clamp_min("x", "1e-12")))
    assert fix_kind(mom) == "lr" and mom.value == 0.01
    assert fix_kind(log) == "eps" and log == "torch.log(x.clamp(min=1e-12))"
    assert fix_kind("check the data loader for rows with NaN") is None
    assert fix_kind("add a warm-up, or clip the gradient norm (torch.nn.utils.clip_grad_norm_) as a safety net") \
        is None


def test_reconcile_is_idempotent():
    exp = _lr_exp([0.01], False)
    ev = _event([_lr(), "a"], [exp])
    reconcile(ev, "pytorch")
    once = (list(ev.fixes), json.dumps(ev.cause, sort_keys=True))
    reconcile(ev, "pytorch")
    assert (list(ev.fixes), json.dumps(ev.cause, sort_keys=True)) == once
    assert ev.fixes[-1].count("(replay:") == 1


class _LrBench(Bench):
    """A divergence with a snapshot two steps back: the planned cut diverges, x0.1 further passes."""

    def capabilities(self, origin):
        return {"batch_size": 8, "module_chain": [], "float64": False, "op_patch": False, "compiled": False,
                "snapshots": [7], "lrs": [0.1]}

    def step_seconds(self):
        return 1.0

    def run(self, spec, replays_left):
        if spec.kind == "lr_replay":
            f = spec.params["factor"]
            return Experiment("lr_replay", "lr", params=dict(spec.params, factor=f * 0.1), finite=True, replays=6,
                              details={"lr": [0.1 * f * 0.1], "steps": 3, "losses": [2.0, 1.0],
                                       "tried": [{"factor": f, "finite": False}, {"factor": f * 0.1, "finite": True}]})
        return Experiment(spec.kind, spec.kind, params=dict(spec.params), finite=False, replays=3)


def test_investigate_reconciles_the_fixes_and_the_report_says_so(tmp_path):
    """Through the investigation (the one place every backend's experiments end): the printed lr is the one
    that passed; the JSON validates; the terminal and the HTML mark what was and was not tested."""
    ev = Event(step=9, phase="forward", origin=None,
               cause={"category": "lr_too_high", "summary": "lr", "confidence": 0.6,
                      "evidence": {"lr": [0.1], "lr_backoff_factor": 0.1}},
               fixes=[_lr(), *_bound(lambda: f"use eps=1e-6 in {X.eps_kwarg('Adam', '1e-6')}")],
               localization={"reproduced": True})
    investigate(ev, _LrBench(), ExperimentConfig(budget_steps=8.0), recovering=True)
    assert ev.fixes[0] == "lower the learning rate from 0.1 to 0.001", ev.fixes
    assert ev.cause["untested_fixes"] == [{"fix_index": 1, "kind": "eps", "why": "no replay tries this value"}]
    r = Report(events=[ev])
    d = json.loads(json.dumps(r.as_dict(), default=str))
    assert report_type_error(d) is None
    from rich.console import Console
    from nanguard.core.render.terminal import render
    out = io.StringIO()
    render(Report.from_dict(d), console=Console(file=out, width=250))
    text = out.getvalue()
    assert text.index("tested: lr 0.001") < text.index("1. lower the learning rate from 0.1 to 0.001 (replay: passed)")
    assert "2. use eps=1e-6 in Adam(..., eps=1e-6) (not tested by replay" in text
    html = fixes_section(d["events"][0])
    assert "tested: lr 0.001" in html and "(not tested by replay: no replay tries this value)" in html


def test_the_report_marks_the_numeric_fixes_of_a_warning_and_of_an_uninvestigated_failure_untested():
    from nanguard.core.engine import RunFacts, assemble_report
    warn = Event(step=1, phase="any", origin=None, kind="warning",
                 cause={"category": "lr_too_high", "summary": "early warning at step 1", "confidence": 0.6,
                        "evidence": {}},
                 fixes=[_lr(), "add a warm-up"])
    fail = Event(step=7, phase="forward", origin=None,
                 cause={"category": "log_domain", "summary": "log of 0", "confidence": 0.8, "evidence": {}},
                 fixes=_bound(lambda: X.call("log", X.clamp_min("x", "1e-12"))))
    r = assemble_report(RunFacts(events=[fail], warnings=[warn]))
    w = next(e for e in r.events if e.is_warning)
    assert w.cause["untested_fixes"] == [{"fix_index": 0, "kind": "lr", "why": "an early warning is not replayed: "
                                          "nothing is non-finite yet to test it against"}]
    f = next(e for e in r.events if not e.is_warning)
    assert f.cause["untested_fixes"][0]["why"] == "no replay ran on this failure"
    assert w.fixes[0] == "lower the learning rate from 0.1 to about 0.01"


def test_a_history_replay_from_weights_already_diverging_decides_nothing():
    """The growth began at step 3; the only snapshot the budget reaches is step 8: a lower rate from there
    staying non-finite neither refutes lr_too_high nor blocks the rollback's cut, and the fix is untested."""
    from nanguard.core.experiments import Situation, plan
    from nanguard.core.experiments.kinds import judge
    from nanguard.core.recovery.verify import verified_plan
    s = Situation("lr_too_high", step=9, caps={"snapshots": [8], "lrs": [0.1]}, evidence={"onset_step": 4})
    spec = next(sp for sp in plan("lr_too_high", s) if sp.kind == "lr_replay")
    assert spec.params["after_onset"] is True and spec.params["from_step"] == 8
    e = Experiment("lr_replay", "lr", params=dict(spec.params), finite=False, replays=3, details={"lr": [0.01]})
    assert judge("lr_too_high", e) is None
    ev = _event([_lr()], [e.as_dict()], onset_step=4)
    assert ev.cause["tested_fixes"][0]["inconclusive"] is True
    reconcile(ev, "pytorch")
    assert ev.fixes == ["lower the learning rate from 0.1 to about 0.01"]
    assert "after the growth began" in ev.cause["untested_fixes"][0]["why"]
    acts, proofs, notes = verified_plan(ev.cause, ["rollback", "lr_backoff"], ["rollback", "lr_backoff"], "forward")
    assert acts == ["rollback", "lr_backoff"] and "applied unverified" in notes[0]
    early = Situation("lr_too_high", step=9, caps={"snapshots": [2, 8], "lrs": [0.1]}, evidence={"onset_step": 4},
                      max_replay_steps=10)
    assert "after_onset" not in next(sp for sp in plan("lr_too_high", early) if sp.kind == "lr_replay").params


def test_every_fix_of_the_kind_that_passed_follows_it():
    exp = _lr_exp([0.001], True, factor=0.01)
    ev = _event([*_bound(lambda: "lower the momentum to 0.9 (effective step 1) or the learning rate to "
                         + X.lr_about("0.01")), "check the data",
                 *_bound(lambda: f"if it recurs, lower the learning rate (e.g. 0.1 -> {X.lr_to('0.01')})")], [exp])
    reconcile(ev, "pytorch")
    assert ev.fixes == ["lower the momentum to 0.9 (effective step 1) or the learning rate to 0.001",
                        "if it recurs, lower the learning rate (e.g. 0.1 -> 0.001)", "check the data"]
    assert "untested_fixes" not in ev.cause and ev.cause["tested_fixes"][0]["fix_index"] == 0


def test_a_division_guard_that_passed_marks_the_denominator_fix_and_says_why_the_other_was_not_tried():
    """A domain_guard of a division (zero denominators -> 1) tests the fix worded by its denominator; the
    where-mask fix it did not try says that the replay tested another change (not "could not run")."""
    guard, mask = _bound(lambda: "guard the denominator at t.py:3: divide by " + X.clamp_min("count", "1"),
                         lambda: "or mask the empty entries: " + X.clamp_min("count", "1"))
    exp = {"kind": "domain_guard", "change": "the inputs of div kept inside its domain (zero denominators replaced "
           "by 1)", "finite": True, "replays": 1, "params": {"op": "div", "guard": "zero denominators replaced by 1"}}
    ev = _event([mask, guard], [exp], category="div_by_zero")
    reconcile(ev, "pytorch")
    assert ev.fixes[0].startswith("guard the denominator") and ev.cause["tested_fixes"][0]["fix_index"] == 0
    un = ev.cause["untested_fixes"]
    assert [u["fix_index"] for u in un] == [1] and "tested another change" in un[0]["why"], un


def test_a_power_guard_that_passed_marks_the_fix_written_as_x_to_the_p():
    """A fix for a power is written ``x.clamp(min=eps) ** p``, not ``torch.pow(``: the replay that clamped
    the base tests it (it was listed untested, "the replay tested another change")."""
    fix, = _bound(lambda: f"keep the base away from 0 at t.py:3: {X.clamp_min('x', '1e-6')} ** p (or (x + 1e-6) ** p)")
    exp = _guard("pow", "base clamped to >= eps")
    ev = _event([fix], [exp], category="sqrt_domain")
    reconcile(ev, "pytorch")
    assert "untested_fixes" not in ev.cause and ev.cause["tested_fixes"][0]["fix_index"] == 0


def test_an_alternative_fix_moved_first_by_its_replay_loses_its_or():
    """'1. or clamp the root's argument: ...' read as a dangling alternative once its replay moved it first."""
    first, alt = _bound(lambda: "clamp the cosine before the root at t.py:3: cosine.clamp(-1 + 1e-7, 1 - 1e-7)",
                        lambda: f"or clamp the root's argument: {X.call('sqrt', X.clamp_min('x', '1e-7'))}")
    exp = _guard("sqrt", "clamped to >= eps")
    ev = _event([first, alt], [exp], category="sqrt_domain")
    reconcile(ev, "pytorch")
    assert ev.fixes[0].startswith("clamp the root's argument: torch.sqrt(") and ev.fixes[1].startswith("clamp the cosine")


def test_a_floor_under_a_log_that_passed_stays_behind_the_logits_form():
    """log(softmax) of logits made huge by raw 0..255 pixels (a Lightning digits classifier): the floor's replay
    passed, which confirms log(0); it moved "clamp the argument" above "use torch.log_softmax", the fix that
    removes the zero at its source (one step finite with the floor did not make the run learn)."""
    logits, floor = _bound(lambda: "use torch.log_softmax (or F.cross_entropy on the logits) instead of log(softmax)",
                           lambda: f"clamp the argument away from 0 at t.py:3: {X.call('log', X.clamp_min('x', '1e-12'))}")
    exp = _guard("log", "clamped to >= eps")
    ev = _event([logits, floor], [exp], category="log_domain")
    reconcile(ev, "pytorch")
    assert ev.fixes[0].startswith("use torch.log_softmax") and ev.fixes[1].startswith("clamp the argument")
    assert ev.cause["tested_fixes"][0]["fix_index"] == 1


def test_a_floor_under_a_log_that_passed_stays_behind_a_value_positive_by_construction():
    """SAC's temperature trained directly (not its log): Adam took it below 0 and log(alpha) is NaN. The floor's
    one-step replay passed, and moved 'clamp the argument' above 'predict its log and exponentiate', though a clamp
    holds the negative alpha at the floor with no gradient: the fix at the source stays first."""
    source, floor = _bound(lambda: "make the value the log reads positive by construction: F.softplus(z) + 1e-6 of the "
                           "raw output, or predict its log and exponentiate",
                           lambda: f"clamp the argument away from 0 at t.py:3: {X.call('log', X.clamp_min('x', '1e-12'))}")
    ev = _event([floor, source], [_guard("log", "clamped to >= eps")], category="log_domain")
    reconcile(ev, "pytorch")  # (the floor first only where the rule put it first)
    assert ev.fixes[0].startswith("clamp the argument")
    ev = _event([source, floor], [_guard("log", "clamped to >= eps")], category="log_domain")
    reconcile(ev, "pytorch")
    assert ev.fixes[0].startswith("make the value the log reads") and ev.fixes[1].startswith("clamp the argument")
