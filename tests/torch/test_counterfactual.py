"""Counterfactual experiments on the failing step (``Guard(experiments=...)``): every kind driven by real
training steps, the refute-then-confirm flow, the state left untouched, and recovery that only applies
what a replay verified.

Truths are decided by construction: an empty bag gives 0/0 in exactly one row, a float16 block
overflows on a value float32 holds, a softmax in float16 rounds probabilities to 0 three ops before
a log, a learning rate above 2/L diverges a linear regression.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard
from nanguard.core.experiments import ExperimentConfig, Spec
from nanguard.pytorch.experiments import GuardStep, TorchBench
from nanguard.pytorch.experiments.samples import batch_size_of, bisect_rows, select_rows
from nanguard.pytorch.recover.snapshot import Snapshot
from nanguard.pytorch.rng import capture_rng


# --------------------------------------------------------------------------- real training setups

def _load_setups():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "cf_scenarios" / "setups.py"
    spec = importlib.util.spec_from_file_location("cf_setups", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_S = _load_setups()
entity_setup, fp16_setup, underflow_setup, regression_setup = \
    _S.entity_setup, _S.fp16_setup, _S.underflow_setup, _S.regression_setup


def run_guard(setup, steps, tmp_path, **kw):
    model, opt, loss_fn, batch = setup[:4]
    kw.setdefault("bundle", None)
    kw.setdefault("html", None)
    kw.setdefault("quiet", True)
    g = nanguard.Guard(model, opt, report=str(tmp_path / "r.json"), **kw)
    err = None
    try:
        for i in range(steps):
            g.step(batch(i), loss_fn)
    except nanguard.NonFiniteError as e:
        err = e
    g.close()
    return g, json.loads((tmp_path / "r.json").read_text()), err


def state_of(model, opt):
    return (copy.deepcopy({k: v.clone() for k, v in model.state_dict().items()}),
            {n: (p.dtype, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
            copy.deepcopy(opt.state_dict()), torch.get_rng_state())


def bits_equal(a, b):
    """Bit for bit (NaN included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def assert_same(a, b):
    for k in a[0]:
        assert bits_equal(a[0][k], b[0][k]), k
    for n in a[1]:
        assert a[1][n][0] == b[1][n][0], n
        ga, gb = a[1][n][1], b[1][n][1]
        assert (ga is None) == (gb is None) and (ga is None or bits_equal(ga, gb)), n
    assert json.dumps(str(a[2])) == json.dumps(str(b[2]))
    assert torch.equal(a[3], b[3])


def failing_bench(setup, step, **kw):
    """The bench of ``step`` after a real backward on it (gradients non-finite, as at a failure)."""
    model, opt, loss_fn, batch = setup[:4]
    rng = capture_rng(plain=False)
    b = batch(step)
    opt.zero_grad()
    loss_fn(b).backward()
    gs = GuardStep(model, [opt], None, [b], loss_fn, rng, step, kw.pop("indices", None))
    return TorchBench(gs, [model], step_seconds=kw.pop("step_seconds", 0.05), **kw), gs


def experiments(report, i=0):
    return report["events"][i]["cause"]["evidence"].get("experiments") or []


# --------------------------------------------------------------------------- samples

def test_batch_rows_helpers():
    b = {"x": torch.arange(12.).reshape(6, 2), "y": torch.arange(6), "n": 3, "m": torch.ones(2, 6)}
    assert batch_size_of(b) == 6
    s = select_rows(b, [1, 4], 6)
    assert s["x"].tolist() == [[2., 3.], [8., 9.]] and s["y"].tolist() == [1, 4] and s["n"] == 3
    assert s["m"].shape == (2, 6)  # its first dimension is not the batch's
    bad = {5, 9}
    rows, tests, _ = bisect_rows(lambda keep: bool(bad & set(keep)), 16, 40)
    assert rows == [5, 9] and tests <= 16
    rows, _, note = bisect_rows(lambda keep: len(keep) == 16, 16, 40)  # only the whole batch fails
    assert rows is None and "together" in note
    rows, _, note = bisect_rows(lambda keep: True, 16, 3)
    assert rows is None and "budget" in note


def test_drop_samples_confirms_a_per_sample_division_and_names_dataset_rows(tmp_path):
    setup = entity_setup()
    empty = setup[4]
    g, r, err = run_guard(setup, 35, tmp_path)
    ev = r["events"][0]
    assert ev["step"] == 11 and empty[11] and not any(empty[:11])
    cause = ev["cause"]
    assert cause["category"] == "div_by_zero"
    assert cause["confirmed_by"]["kind"] == "drop_samples"
    exp = experiments(r)[0]
    assert exp["kind"] == "drop_samples" and exp["finite"] is True and exp["details"]["rows"] == empty[11]
    assert exp["seconds"] >= 0 and exp["replays"] == 1
    idx = setup[3](11)["indices"]
    assert cause["evidence"]["bad_samples"] == {"batch_rows": empty[11],
                                            "dataset_indices": [int(idx[i]) for i in empty[11]]}
    assert cause["confidence"] >= 0.95 and "Confirmed by replay" in cause["summary"]
    cost = cause["evidence"]["experiments_cost"]
    assert cost["seconds"] > 0 and cost["budget_steps"] == 3.0


def test_drop_samples_bisects_when_the_origin_rows_are_not_batch_rows(tmp_path):
    """The origin is on a (batch * time, features) view: its rows are not batch rows, so bisection finds
    the sample whose whole sequence is padding (0/0 in its per-token normalisation)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(24, 5, 6)
    mask = torch.ones(24, 5)
    mask[13] = 0.0  # an empty sequence

    def loss_fn(b):
        xb, mb = b
        tok = (xb * mb[..., None]).reshape(-1, 6)
        w = mb.reshape(-1, 1) / mb.sum(1).repeat_interleave(5).reshape(-1, 1)
        return (model(tok) * w).sum() / xb.shape[0]

    bench, gs = failing_bench((model, opt, loss_fn, lambda i: (x, mask)), 0)
    spec = Spec("drop_samples", {"bisect": True})
    e = bench.run(spec, replays_left=60.0)
    assert e.finite is True and e.details["rows"] == [13], e
    assert e.replays >= 3 and "sub-batch" in e.details["bisection"]


# --------------------------------------------------------------------------- precision

def test_upcast_module_confirms_a_float16_overflow_and_leaves_the_state_untouched(tmp_path):
    setup = fp16_setup()
    g, r, err = run_guard(setup, 5, tmp_path)
    ev = r["events"][0]
    assert ev["step"] == 3 and ev["origin"]["module"] == "block"
    cause = ev["cause"]
    assert cause["category"] == "low_precision_overflow"
    assert cause["confirmed_by"]["kind"] == "upcast_module"
    assert cause["confirmed_by"]["params"]["module"] == "block"
    # the experiment changed nothing: the model is still float16 and trains on
    model = setup[0]
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert not hasattr(model.block, "_nanguard_upcast") and "forward" not in model.block.__dict__


@pytest.mark.parametrize("kind", ["upcast_module", "float64_step", "determinism", "drop_samples", "domain_guard",
                                  "origin_input_f64"])
def test_every_single_step_experiment_restores_the_state(kind):
    setup = fp16_setup()
    model, opt = setup[0], setup[1]
    for i in range(3):  # some optimizer state first
        opt.zero_grad()
        setup[2](setup[3](i)).backward()
        opt.step()
    bench, gs = failing_bench(setup, 3, origin={"file": __file__, "line": 0})
    before = state_of(model, opt)
    params = {"upcast_module": {"module": "block", "whole_model": False}, "drop_samples": {"rows": [1, 2]},
              "domain_guard": {"op": "log"}, "origin_input_f64": {"op": "mul"}}.get(kind, {})
    e = bench.run(Spec(kind, params), replays_left=60.0)
    assert e.kind == kind and e.seconds > 0
    assert_same(before, state_of(model, opt))


def test_refuted_domain_error_then_confirmed_underflow(tmp_path):
    """The rules see log(0) in float16 with no eps and a float32 re-run of the two ops before it that is
    just as zero: log_domain. The whole step in float64 is finite, which an exact log(0) could not be:
    log_domain is ruled out and the float16 underflow is confirmed by the same replay."""
    setup = underflow_setup()
    g, r, err = run_guard(setup, 6, tmp_path)
    ev = r["events"][0]
    cause = ev["cause"]
    assert ev["origin"]["op"].startswith("aten.log") and ev["origin"]["module"] == "2"
    assert cause["ruled_out"][0]["category"] == "log_domain"
    assert cause["ruled_out"][0]["by"] == "float64_step" and cause["ruled_out"][0]["finite"] is True
    assert cause["category"] == "low_precision_underflow"
    assert cause["confirmed_by"]["kind"] == "float64_step"
    assert cause["evidence"]["first_candidate"]["category"] == "log_domain"
    assert "ruled out" in cause["summary"] and ev["fixes"]


def test_without_experiments_the_same_failure_stays_the_rules_guess(tmp_path):
    setup = underflow_setup()
    g, r, err = run_guard(setup, 6, tmp_path, experiments=None)
    cause = r["events"][0]["cause"]
    assert cause["category"] == "log_domain"
    assert "confirmed_by" not in cause and "experiments" not in cause["evidence"]


def test_origin_input_f64_shows_the_negative_variance_was_made_by_rounding_upstream():
    """A float16 hand-written std, E[x^2] - E[x]^2, on features with a large mean and a small spread:
    float16 cancellation makes the variance negative and sqrt NaN. With the input of sqrt computed in
    float64 upstream (and sqrt itself, forward and backward, from that value) the step is finite."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = (100 + 0.3 * torch.randn(32, 16)).half()
    y = torch.randn(32, 1)

    def loss_fn(b):
        h = b[0]
        var = (h * h).mean(-1, keepdim=True) - h.mean(-1, keepdim=True) ** 2
        z = (h[:, :4] - h.mean(-1, keepdim=True)) / torch.sqrt(var)
        return F.mse_loss(model(z).float(), b[1])

    bench, gs = failing_bench((model, opt, loss_fn, lambda i: (x, y)), 0)
    assert gs.run().finite is False
    e = bench.run(Spec("origin_input_f64", {"op": "sqrt"}), replays_left=60.0)
    assert e.finite is True and e.details["calls_substituted"] == 1, e
    assert bench.run(Spec("origin_input_f64", {"op": "mul"}), 60.0).error  # two-input ops: not this experiment


def test_domain_guard_confirms_a_float32_log_of_a_saturated_sigmoid():
    """log(1 - sigmoid(z)) by hand: for z > ~17 sigmoid is exactly 1.0 in float32 and the log is -inf.
    With the log's input kept >= eps at that line the step is finite: the domain error is the whole story."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.1, -0.1]]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 3) * torch.tensor([40.0, 1.0, 1.0])
    y = (x[:, :1] < 0).float()  # labels opposite to the saturated logits

    def loss_fn(b):
        p = torch.sigmoid(model(b[0]))
        return -(b[1] * torch.log(p) + (1 - b[1]) * torch.log(1 - p)).mean()

    bench, gs = failing_bench((model, opt, loss_fn, lambda i: (x, y)), 0)
    assert gs.run().finite is False
    bench.origin = {"file": __file__, "line": loss_fn.__code__.co_firstlineno + 2}
    e = bench.run(Spec("domain_guard", {"op": "log"}), 60.0)
    assert e.finite is True and e.details["calls_guarded"] >= 1, e
    assert "clamped" in e.change
    bench.origin = {"file": __file__, "line": loss_fn.__code__.co_firstlineno + 1}  # not the log's line
    assert bench.run(Spec("domain_guard", {"op": "log"}), 60.0).error


# --------------------------------------------------------------------------- history replays

@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_lr_replay_confirms_a_learning_rate_above_the_limit_and_recovery_applies_it(tmp_path):
    # on_spike="warn": the early warning would otherwise roll back before anything is non-finite
    g, r, err = run_guard(regression_setup(), 200, tmp_path, recover="auto", on_spike="warn")
    assert r["status"] == "recovered"
    ev = r["events"][0]
    cause = ev["cause"]
    assert cause["category"] == "lr_too_high" and cause["confirmed_by"]["kind"] == "lr_replay"
    p = cause["confirmed_by"]["params"]
    assert p["factor"] <= 0.1 and p["from_step"] < ev["step"] == p["to_step"]
    rec = ev["recovery"]
    assert "lr_backoff" in rec["action"] and rec["verified"] == "verified by replay before applying"
    assert rec["actions"]["verified"]["lr_backoff"]["experiment"] == "lr_replay"


def test_clip_replay_and_lr_replay_from_a_snapshot_restore_everything():
    setup = regression_setup(lr=0.004)
    model, opt, loss_fn, batch = setup
    snaps, kept, failed = [], {}, False
    for i in range(200):
        snaps = (snaps + [Snapshot(i, [model], [opt])])[-2:]
        kept[i] = GuardStep(model, [opt], None, [batch(i)], loss_fn, capture_rng(plain=False), i)
        opt.zero_grad()
        loss = loss_fn(batch(i))
        loss.backward()
        if not math.isfinite(loss.item()):
            failed = True
            break
        opt.step()
    assert failed
    n = i
    bench = TorchBench(kept[n], [model], step_seconds=0.01, kept=kept, snapshots=snaps)
    assert n - 1 in bench.capabilities({})["snapshots"]
    before = state_of(model, opt)
    plain = bench.run(Spec("lr_replay", {"factor": 1.0, "from_step": n - 1, "to_step": n}), 60.0)
    assert plain.finite is False and plain.details["failed_at"] == n  # the control: same lr, same failure
    low = bench.run(Spec("lr_replay", {"factor": 0.1, "from_step": n - 1, "to_step": n}), 60.0)
    clip = bench.run(Spec("clip_replay", {"max_norm": 1.0, "from_step": n - 1, "to_step": n}), 60.0)
    assert low.finite is True and clip.finite is True and low.replays == 2
    assert_same(before, state_of(model, opt))
    assert opt.param_groups[0]["lr"] == 0.004


# --------------------------------------------------------------------------- determinism, compile

def test_determinism_tells_identical_replays_from_different_ones():
    setup = entity_setup()
    bench, gs = failing_bench(setup, 11)
    e = bench.run(Spec("determinism"), 60.0)
    assert e.details["identical"] is True and e.replays == 2 and e.finite is False
    calls = []

    def flaky(b):  # a step that reads state outside the RNG: the two replays differ
        calls.append(1)
        return setup[2](b) * (1 + 1e-3 * len(calls))

    bench2 = TorchBench(GuardStep(setup[0], [setup[1]], None, [setup[3](3)], flaky, capture_rng(plain=False), 3),
                        [setup[0]], step_seconds=0.05)
    e2 = bench2.run(Spec("determinism"), 60.0)
    assert e2.details["identical"] is False and e2.finite is True


def test_eager_replay_of_a_compiled_step_exposes_a_compiler_issue(tmp_path):
    """A compiled model whose (deliberately broken) backend returns NaN: the eager replay is finite, so the
    op-level cause is refuted and a compiler issue reported."""
    if not hasattr(torch, "compile") or not hasattr(torch.compiler, "set_stance"):
        pytest.skip("no torch.compile / set_stance")

    def broken_backend(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            return [o * float("nan") if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out] \
                if isinstance(out, (list, tuple)) else out * float("nan")
        return run

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = torch.compile(net, backend=broken_backend)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    bench, gs = failing_bench((model, opt, lambda b: F.mse_loss(model(b[0]), b[1]), lambda i: (x, y)), 0)
    assert bench.capabilities({})["compiled"]
    e = bench.run(Spec("eager"), 60.0)
    assert e.details["compiled_finite"] is False and e.finite is True, e
    # the compiled replay runs before the op-level one (after a dispatch mode, torch.compile runs that code
    # eagerly)
    torch._dynamo.reset()
    g = nanguard.Guard(model, opt, report=str(tmp_path / "r.json"), bundle=None, html=None, quiet=True)
    with pytest.raises(nanguard.NonFiniteError) as ei:
        g.step((x, y), lambda b: F.mse_loss(model(b[0]), b[1]))
    cause = ei.value.event.cause
    assert cause["category"] == "other" and "compiler" in cause["summary"]
    assert cause["confirmed_by"]["kind"] == "eager" and cause["confidence"] >= 0.95


# --------------------------------------------------------------------------- budget and configuration

def test_budget_and_configuration(tmp_path):
    assert ExperimentConfig.from_spec("off").enabled is False
    assert ExperimentConfig.from_spec(None).enabled is False
    assert ExperimentConfig.from_spec(5).budget_steps == 5.0
    assert ExperimentConfig.from_spec("drop_samples,eager").kinds == ("drop_samples", "eager")
    with pytest.raises(ValueError):
        ExperimentConfig.from_spec("no_such_kind")
    # a tiny budget: the experiment is planned, not run, and the report says why
    g, r, err = run_guard(entity_setup(), 35, tmp_path, experiments={"budget_steps": 1e-6})
    cost = r["events"][0]["cause"]["evidence"]["experiments_cost"]
    assert experiments(r) == [] and cost["not_run_for_budget"] == ["drop_samples"]
    # only some kinds
    g, r, err = run_guard(fp16_setup(), 5, tmp_path, experiments=["float64_step"])
    kinds = {e["kind"] for e in experiments(r)}
    assert kinds == {"float64_step"} and r["events"][0]["cause"]["confirmed_by"]["kind"] == "float64_step"


# --------------------------------------------------------------------------- recovery uses the proof

def _applied_and_proven(report):
    """Every training-changing action a recovery applied, with the experiment that verified it."""
    from nanguard.core.recovery.verify import PROOF_KIND
    out = []
    for ev in report["events"]:
        rec = ev.get("recovery") or {}
        exps = ev["cause"]["evidence"].get("experiments")
        for a in rec.get("action", "").split("+"):
            if a in PROOF_KIND:
                proof = [e for e in exps or [] if e["kind"] == PROOF_KIND[a] and e["finite"] is True]
                out.append((a, bool(proof), rec.get("verified")))
    return out


@pytest.mark.parametrize("name", ["entity", "fp16", "underflow", "regression"])
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_recovery_applies_no_action_its_replay_did_not_verify(name, tmp_path):
    setup, steps = {"entity": (entity_setup(), 35), "fp16": (fp16_setup(), 5), "underflow": (underflow_setup(), 6),
                    "regression": (regression_setup(), 200)}[name]
    # a generous budget: on a loaded machine the verifying replay must not be left out for time
    # failures only (on_spike="warn"): an early warning's rollback acts before anything is non-finite, with no
    # failing step to replay (README, "Recovery")
    g, r, err = run_guard(setup, steps, tmp_path, recover="auto", experiments={"budget_steps": 50}, on_spike="warn")
    applied = _applied_and_proven(r)
    assert applied, r["events"][0].get("recovery")
    assert all(proven and verified for _a, proven, verified in applied), applied


def test_an_unverified_action_is_not_applied(tmp_path):
    """Only float64 replays allowed: nothing can verify the upcast of a module, so recovery skips the step
    (and says why) instead of changing the model's dtype."""
    setup = fp16_setup()
    g, r, err = run_guard(setup, 5, tmp_path, recover="auto", experiments=["float64_step"])
    rec = r["events"][0]["recovery"]
    assert rec["action"] == "skip_step"
    assert any("upcast not applied" in n for n in rec["actions"]["notes"])
    assert all(p.dtype == torch.float16 for p in setup[0].parameters())


def test_per_sample_failures_recover_by_dropping_rows_within_the_bad_data_budget(tmp_path):
    setup = entity_setup()
    empty = setup[4]
    g, r, err = run_guard(setup, 35, tmp_path, recover="auto")
    assert err is None and r["status"] == "recovered"
    bad_steps = [s for s in range(35) if empty[s]]
    assert [e["step"] for e in r["events"]] == bad_steps
    for ev in r["events"]:
        rec = ev["recovery"]
        assert rec["action"] == "drop_samples"
        assert rec["actions"]["drop_samples"]["rows"] == empty[ev["step"]]
        assert rec["actions"]["drop_samples"]["kept_rows"] == 8 - len(empty[ev["step"]])
    assert g.policy.budget.sample_steps == bad_steps and g.policy.budget.recovery_steps == g.policy.budget.data_steps == []


def test_a_failure_the_replays_do_not_reproduce_is_reported_as_transient(tmp_path):
    """The loss is NaN once (as from a flipped bit): the op-level replay does not reproduce it, and two
    unchanged replays are finite and identical, which the report says."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {"n": 0}

    def loss_fn(b):
        calls["n"] += 1
        loss = F.mse_loss(model(b[0]), b[1])
        return loss * float("nan") if calls["n"] == 3 else loss

    g = nanguard.Guard(model, opt, report=str(tmp_path / "r.json"), bundle=None, html=None, quiet=True)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with pytest.raises(nanguard.NonFiniteError) as ei:
        for _ in range(5):
            g.step((x, y), loss_fn)
    ev = ei.value.event
    assert ev.step == 2 and ev.localization["reproduced"] is False
    det = [e for e in ev.cause["evidence"]["experiments"] if e["kind"] == "determinism"][0]
    assert det["details"] == {"first_finite": True, "second_finite": True, "identical": True}
    assert "transient" in ev.cause["summary"] and "confirmed_by" not in ev.cause


# --------------------------------------------------------------------------- nanguard run (step tape)

ZERO_CODE_NAN_ROW = """
import torch
torch.manual_seed(0)
X = torch.randn(256, 6)
Y = X.sum(1, keepdim=True)
X[70, 2] = float("nan")
ds = torch.utils.data.TensorDataset(X, Y)
dl = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=False)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in dl:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_zero_code_run_confirms_a_bad_row_on_the_step_replay(tmp_path):
    """``nanguard run``: the failing step is replayed in-process from the step tape (issue 17) and the
    experiments run on it (``TapeStep``); the bad sample is named by batch row and dataset row."""
    pytest.importorskip("nanguard.pytorch.stepreplay")
    import subprocess
    import sys
    script = tmp_path / "train.py"
    script.write_text(ZERO_CODE_NAN_ROW)
    rep = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "nanguard", "run", "--report", str(rep), "--no-bundle", "--no-html",
                    str(script)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    ev = json.loads(rep.read_text())["events"][0]
    assert ev["step"] == 2 and ev["cause"]["category"] == "bad_input_data"
    assert ev["cause"]["confirmed_by"]["kind"] == "drop_samples"
    assert ev["cause"]["confirmed_by"]["params"]["rows"] == [6]
    assert ev["cause"]["evidence"]["bad_samples"] == {"batch_rows": [6], "dataset_indices": [70]}
