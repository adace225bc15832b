"""``nanguard run``: zero-code detection of unmodified scripts, exit statuses, the report.

Scripts are written to ``tmp_path`` and run in-process through
:func:`nanguard.cli.run.run_script` (a few end-to-end cases use a subprocess).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import nanguard.pytorch.detect.gather
from nanguard.cli.main import main
from nanguard.cli.run import run_script
from nanguard.core.exitcodes import EXIT_NONFINITE, EXIT_USAGE
from nanguard.core.events import SCHEMA, Report, write_json_atomic

from ngtest import (EXPECTED_PHASE, INJECT, assert_same_state, load_report, loop_script, run_ng,
                      run_plain, write)


def _stdout_losses(out: str):
    return [float(l.split("loss=")[1]) for l in out.splitlines() if l.startswith("step=")]


# --------------------------------------------------------------------------- phases

@pytest.mark.parametrize("bad", [0, 3])
@pytest.mark.parametrize("case", sorted(INJECT))
def test_phase_and_step_of_first_nonfinite(tmp_path, case, bad):
    script = write(tmp_path, loop_script(**INJECT[case]))
    code, rep = run_ng(tmp_path, script, [bad])
    assert code == EXIT_NONFINITE
    assert rep["schema"] == SCHEMA
    assert rep["status"] == "nonfinite"
    assert rep["counting"] == "optimizer"
    ev = rep["events"][0]
    assert ev["step"] == bad
    assert ev["phase"] == EXPECTED_PHASE[case]
    # It stopped at the first failure: no step after it was watched, and the
    # optimizer-made NaN is reported at the step that made it (one check later).
    assert rep["steps_watched"] == bad + (1 if case == "optimizer_inf" else 0)
    det = ev["detected"]
    if case.startswith("params"):
        assert det["nonfinite_params"] == ["fc1.weight" if case == "params_nan" else "fc2.bias"]
    elif case == "buffer_nan":
        assert det["nonfinite_params"] == ["shift"]
    elif case.startswith("backward"):
        assert det["nonfinite_grads"] == ["fc1.weight"]
        assert isinstance(det["loss"], float)  # the loss was finite
    elif case.startswith("data"):
        assert det["nonfinite_in"] == ["Net input"]
    elif case == "optimizer_inf":
        assert "fc1.weight" in det["nonfinite_params_after_update"]


def test_optimizer_nonfinite_at_last_step_is_read_at_the_end(tmp_path):
    script = write(tmp_path, loop_script(**INJECT["optimizer_inf"]))
    code, rep = run_ng(tmp_path, script, [5])  # the last of 6 steps
    assert code == 0  # nanguard did not stop it: the script's own status
    assert rep["status"] == "nonfinite"
    assert [(e["step"], e["phase"]) for e in rep["events"]] == [(5, "optimizer")]
    assert rep["steps_watched"] == 6


def test_adam_float16_eps_underflow_is_an_optimizer_phase(tmp_path):
    script = write(tmp_path, """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).half()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8 is 0 in float16
        for step in range(5):
            x = torch.randn(8, 4).half()
            x[:, 0] = 0  # feature 0 is always zero: its weight's gradient is exactly 0 -> 0/(0+eps)
            loss = (model(x).float() ** 2).mean()
            opt.zero_grad()
            loss.backward()
            if step == 0:
                assert torch.isfinite(model.weight.grad).all()  # finite gradients: the update is to blame
            opt.step()
        """)
    code, rep = run_ng(tmp_path, script)
    assert code == EXIT_NONFINITE
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (0, "optimizer")
    assert "weight" in ev["detected"]["nonfinite_params_after_update"]


def test_nan_at_a_late_step_of_a_long_run(tmp_path):
    script = write(tmp_path, loop_script(steps=40, **INJECT["data_nan"]))
    code, rep = run_ng(tmp_path, script, [37])
    assert code == EXIT_NONFINITE
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (37, "data")
    assert [h["step"] for h in rep["history"]] == list(range(37))


# --------------------------------------------------------------------------- eval

@pytest.mark.parametrize("how", ["eval_mode", "no_grad", "both"])
def test_eval_output_nonfinite(tmp_path, how):
    ctx = {"eval_mode": ("model.eval()", "if True:"), "no_grad": ("pass", "with torch.no_grad():"),
           "both": ("model.eval()", "with torch.no_grad():")}[how]
    after = f"{ctx[0]}\n{ctx[1]}\n    pred = model(torch.full((2, 4), float('nan')))\n"
    script = write(tmp_path, loop_script(after=after))
    code, rep = run_ng(tmp_path, script)
    assert code == 0  # evaluation events do not stop the run
    assert rep["status"] == "nonfinite"
    assert rep["steps_watched"] == 6
    assert len(rep["events"]) == 1
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (6, "eval")
    assert ev["detected"]["output_nan"] == 2


def test_finite_eval_is_clean(tmp_path):
    after = "model.eval()\nwith torch.no_grad():\n    pred = model(torch.randn(5, 4))\n"
    script = write(tmp_path, loop_script(after=after))
    code, rep = run_ng(tmp_path, script)
    assert (code, rep["status"], rep["events"]) == (0, "clean", [])
    assert "guard_disabled" not in rep


# --------------------------------------------------------------------------- healthy run

def test_healthy_run_report_and_output(tmp_path, capsys):
    script = write(tmp_path, loop_script())
    report = tmp_path / "out" / "report.json"  # folder created on demand
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = run_script(script, [], report_path=str(report), localize=False)
    assert not [w for w in caught if "nanguard" in str(w.message)]
    out, err = capsys.readouterr()
    assert code == 0
    # exactly one start line and one summary line; nothing per step
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 2, err
    assert lines[0].startswith("nanguard: watching train.py")
    assert lines[1].startswith("nanguard: clean: watched 6 steps")
    losses = _stdout_losses(out)
    assert len(losses) == 6 and "done" in out
    text = report.read_text()
    assert "NaN" not in text and "Infinity" not in text
    rep = load_report(report)
    assert rep["schema"] == SCHEMA and rep["status"] == "clean"
    assert rep["events"] == [] and rep["counting"] == "optimizer"
    assert rep["steps_watched"] == 6 and rep["scaler_skips"] == 0
    hist = rep["history"]
    assert [h["step"] for h in hist] == list(range(6))
    assert [h["loss"] for h in hist] == losses  # the very float32 values the script saw
    assert all(h["lr"] == [0.05] and not h["skipped"] for h in hist)
    assert rep["max_grad_norm"] == max(h["grad_norm"] for h in hist) > 0
    assert not list(tmp_path.glob("**/.nanguard-*"))  # atomic write left no temp file


def test_nonfinite_report_is_strict_json(tmp_path, capsys):
    script = write(tmp_path, loop_script(**INJECT["forward_nan"]))
    code = run_script(script, ["2"], report_path=str(tmp_path / "r.json"), localize=False)
    assert code == EXIT_NONFINITE
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    rep = load_report(tmp_path / "r.json")
    assert rep["events"][0]["detected"]["loss"] == "nan"
    err = capsys.readouterr().err
    assert "step" in err and "forward" in err  # the terminal report names step and phase
    assert "first failure at step 2 (forward)" in err


def test_write_json_atomic_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "r.json"
    Report().write(str(path))
    before = path.read_text()
    with pytest.raises(ValueError):
        write_json_atomic(str(path), {"x": float("nan")})  # not strict JSON: refused
    assert path.read_text() == before
    assert list(tmp_path.iterdir()) == [path]
    assert json.loads(before)["status"] == "clean"


def test_report_encodes_non_finite_numbers_as_strings():
    from nanguard.core.events import Event
    r = Report(events=[Event(step=1, phase="forward", detected={"loss": float("inf"), "g": [float("-inf")]})],
               max_grad_norm=float("nan"))
    d = json.loads(json.dumps(r.as_dict(), allow_nan=False))
    assert d["status"] == "nonfinite"
    assert d["events"][0]["detected"] == {"loss": "inf", "g": ["-inf"]}
    assert d["max_grad_norm"] == "nan"


# --------------------------------------------------------------------------- bit-for-bit

SCALER_SCRIPT = '''\
import sys
import torch

torch.manual_seed(0)
MODE = sys.argv[1] if len(sys.argv) > 1 else "clean"
BAD = int(sys.argv[2]) if len(sys.argv) > 2 else -1
OUT = sys.argv[3] if len(sys.argv) > 3 else None
INIT = float(sys.argv[4]) if len(sys.argv) > 4 else 2.0 ** 20
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
# float16 autocast on CPU: with a large initial scale, the float16 gradients overflow
# at first and the scaler skips a few steps (its normal warm-up).
scaler = torch.amp.GradScaler("cpu", init_scale=INIT)
skips = 0
for step in range(24 if MODE == "collapse" else 16):
    x = torch.randn(8, 4)
    y = torch.randn(8, 4)
    if MODE == "data" and step == BAD:
        x[0, 0] = float("nan")
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
    if MODE == "collapse":  # a NaN gradient at every step: the scale keeps falling
        loss = loss + torch.sqrt((model[0].weight - model[0].weight).pow(2).sum())
    opt.zero_grad()
    before = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skips += scaler.get_scale() < before
    print(f"step={step} loss={loss.item()!r} scale={scaler.get_scale()}")
print(f"skips={skips}")
if OUT:
    torch.save({"model": model.state_dict(), "scale": torch.tensor(scaler.get_scale())}, OUT)
'''

ACCUM_SCRIPT = '''\
import sys
import torch

torch.manual_seed(0)
BAD = int(sys.argv[1]) if len(sys.argv) > 1 else -1
OUT = sys.argv[2] if len(sys.argv) > 2 else None
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(5):
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for micro in range(3):  # gradient accumulation: 3 backward passes per optimizer step
        x = torch.randn(4, 4)
        y = torch.randn(4, 1)
        if step == BAD and micro == 2:
            x[1, 2] = float("nan")
        loss = ((model(x) - y) ** 2).mean() / 3
        loss.backward()
        total += loss.item()
    opt.step()
    print(f"step={step} loss={total!r}")
if OUT:
    torch.save(model.state_dict(), OUT)
'''

HAND_SCRIPT = '''\
import sys
import torch

torch.manual_seed(0)
MODE = sys.argv[1] if len(sys.argv) > 1 else "clean"
BAD = int(sys.argv[2]) if len(sys.argv) > 2 else -1
OUT = sys.argv[3] if len(sys.argv) > 3 else None
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
lr = 0.05
for step in range(6):  # no optimizer: the update is written by hand
    x = torch.randn(16, 4)
    y = torch.randn(16, 1)
    if MODE == "data" and step == BAD:
        x[0, 0] = float("nan")
    loss = ((model(x) - y) ** 2).mean()
    if MODE == "backward" and step == BAD:
        loss = loss + torch.sqrt((model[0].weight - model[0].weight).pow(2).sum())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
            p.grad = None
    print(f"step={step} loss={loss.item()!r}")
if OUT:
    torch.save(model.state_dict(), OUT)
'''

GAN_SCRIPT = '''\
import sys
import torch
from torch import nn

torch.manual_seed(0)
MODE = sys.argv[1] if len(sys.argv) > 1 else "clean"
BAD = int(sys.argv[2]) if len(sys.argv) > 2 else -1
OUT = sys.argv[3] if len(sys.argv) > 3 else None
G = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))
D = nn.Sequential(nn.Linear(3, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
bce = nn.BCEWithLogitsLoss()
for it in range(6):
    real = torch.randn(8, 3) + 2
    z = torch.randn(8, 2)
    if MODE == "g_params" and it == BAD:
        with torch.no_grad():
            G[2].weight[0, 0] = float("nan")
    if MODE == "g_update" and it == BAD:
        opt_g.param_groups[0]["lr"] = float("inf")
    # discriminator step
    fake = G(z).detach()
    d_loss = bce(D(real), torch.ones(8, 1)) + bce(D(fake), torch.zeros(8, 1))
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    # generator step
    g_loss = bce(D(G(z)), torch.ones(8, 1))
    if MODE == "g_backward" and it == BAD:
        g_loss = g_loss + torch.sqrt((G[0].weight - G[0].weight).pow(2).sum())
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
    print(f"it={it} d={d_loss.item():.4f} g={g_loss.item():.4f}")
if OUT:
    torch.save({"G": G.state_dict(), "D": D.state_dict()}, OUT)
'''

GROUPS_OPT = ('torch.optim.Adam([{"params": model.fc1.parameters(), "lr": 0.01}, '
              '{"params": model.fc2.parameters(), "lr": 0.003, "weight_decay": 0.1}])')

BITWISE = {
    "sgd": (loop_script(), []),
    "adam_groups": (loop_script(opt=GROUPS_OPT), []),
    "set_to_none_false": (loop_script(opt="torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)")
                          .replace("opt.zero_grad()", "opt.zero_grad(set_to_none=False)"), []),
    "grad_scaler": (SCALER_SCRIPT, ["clean", -1]),
    "accumulation": (ACCUM_SCRIPT, [-1]),
    "hand_update": (HAND_SCRIPT, ["clean", -1]),
    "gan": (GAN_SCRIPT, ["clean", -1]),
}


@pytest.mark.parametrize("name", sorted(BITWISE))
def test_run_is_bit_for_bit_identical_to_plain_python(tmp_path, name):
    text, args = BITWISE[name]
    script = write(tmp_path, text)
    args = [str(a) for a in args]
    if name in ("sgd", "adam_groups", "set_to_none_false"):
        args = ["-1"]
    plain_out, guarded_out = str(tmp_path / "plain.pt"), str(tmp_path / "guarded.pt")
    run_plain(script, args + [plain_out])
    code, rep = run_ng(tmp_path, script, args + [guarded_out])
    assert code == 0 and rep["status"] == "clean"
    a, b = torch.load(plain_out), torch.load(guarded_out)
    if name == "grad_scaler":
        assert torch.equal(a["scale"], b["scale"])
        a, b = a["model"], b["model"]
    if name == "gan":
        assert_same_state(a["G"], b["G"])
        a, b = a["D"], b["D"]
    assert_same_state(a, b)
    assert rep["steps_watched"] >= 5


# --------------------------------------------------------------------------- GradScaler

def test_grad_scaler_warmup_skips_are_info_not_failures(tmp_path, capsys):
    script = write(tmp_path, SCALER_SCRIPT)
    code, rep = run_ng(tmp_path, script, ["clean", -1])
    out = capsys.readouterr().out
    skips = int(out.strip().splitlines()[-1].split("=")[1])
    assert skips > 0  # the script really went through warm-up skips
    assert code == 0
    assert rep["status"] == "clean" and rep["events"] == []
    assert rep["scaler_skips"] == skips
    assert rep["steps_watched"] == 16  # skipped steps are step attempts too
    skipped = [h["step"] for h in rep["history"] if h["skipped"]]
    assert skipped == list(range(skips))  # warm-up: the first steps
    assert [i["step"] for i in rep["info"]] == skipped
    assert all(i["scaler_skip"] for i in rep["info"])
    assert rep["history"][0]["loss_scale"] == 2.0 ** 20


def test_grad_scaler_step_count_includes_skipped_steps(tmp_path, capsys):
    script = write(tmp_path, SCALER_SCRIPT)
    code, rep = run_ng(tmp_path, script, ["data", 9])
    assert code == EXIT_NONFINITE
    assert rep["scaler_skips"] > 0
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (9, "data")
    assert rep["steps_watched"] == 9


@pytest.mark.parametrize("init,step", [(2.0 ** 20, 20), (4.0, 2)])
def test_grad_scaler_collapse_is_a_failure(tmp_path, init, step):
    # NaN gradients from the first step: the scaler never trains, so its skips are its search for a scale until it
    # skips at scale 1, no scaling left (core.lossscale): 2**20 at the 21st skip, 4.0 at the third.
    script = write(tmp_path, SCALER_SCRIPT)
    code, rep = run_ng(tmp_path, script, ["collapse", -1, "", init])
    assert code == EXIT_NONFINITE
    assert rep["status"] == "nonfinite"
    ev = rep["events"][0]
    assert ev["step"] == step
    assert ev["detected"]["loss_scale_collapse"] is True
    assert ev["detected"]["consecutive_skips"] == step + 1
    assert rep["scaler_skips"] == step  # the skips before the collapse were warm-up-like info


def test_grad_scaler_collapse_warn_mode_runs_to_the_end(tmp_path, capsys):
    script = write(tmp_path, SCALER_SCRIPT)
    code, rep = run_ng(tmp_path, script, ["collapse", -1, "", 4.0], on_nonfinite="warn")
    assert code == 0
    assert "skips=24" in capsys.readouterr().out
    assert rep["status"] == "nonfinite"
    assert rep["events"][0]["step"] == 2 and rep["events"][0]["detected"]["loss_scale_collapse"]
    assert rep["steps_watched"] == 24


# --------------------------------------------------------------------------- loop shapes

def test_gradient_accumulation_counts_optimizer_steps(tmp_path, capsys):
    script = write(tmp_path, ACCUM_SCRIPT)
    code, rep = run_ng(tmp_path, script)
    losses = _stdout_losses(capsys.readouterr().out)
    assert code == 0 and rep["status"] == "clean"
    assert rep["counting"] == "optimizer" and rep["steps_watched"] == 5
    # the recorded loss is the mean of the 3 micro-batch losses
    for h, total in zip(rep["history"], losses):
        assert h["loss"] == pytest.approx(total / 3, rel=1e-5)


def test_gradient_accumulation_nan_in_last_micro_batch(tmp_path):
    script = write(tmp_path, ACCUM_SCRIPT)
    code, rep = run_ng(tmp_path, script, [3])
    assert code == EXIT_NONFINITE
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (3, "data")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_modes(tmp_path, set_to_none):
    text = loop_script(**INJECT["backward_nan"]).replace(
        "opt.zero_grad()", f"opt.zero_grad(set_to_none={set_to_none})")
    script = write(tmp_path, text)
    code, rep = run_ng(tmp_path, script, [4])
    assert code == EXIT_NONFINITE
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (4, "backward")


FROZEN = "model.fc1.requires_grad_(False)"
FROZEN_OPT = "torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)"


def test_frozen_parameters_clean_and_untouched(tmp_path):
    out = str(tmp_path / "final.pt")
    script = write(tmp_path, loop_script(setup=FROZEN, opt=FROZEN_OPT))
    code, rep = run_ng(tmp_path, script, [-1, out])
    assert code == 0 and rep["status"] == "clean"
    sd = torch.load(out)
    plain = str(tmp_path / "plain.pt")
    run_plain(script, [-1, plain])
    assert_same_state(sd, torch.load(plain))
    assert len(rep["history"][0]["group_grad_norms"]) == 1


def test_nan_written_into_a_frozen_parameter_is_a_params_phase(tmp_path):
    script = write(tmp_path, loop_script(setup=FROZEN, opt=FROZEN_OPT, **INJECT["params_nan"]))
    code, rep = run_ng(tmp_path, script, [2])
    assert code == EXIT_NONFINITE
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (2, "params")
    assert ev["detected"]["nonfinite_params"] == ["fc1.weight"]


def test_several_param_groups(tmp_path):
    script = write(tmp_path, loop_script(opt=GROUPS_OPT, **INJECT["params_inf"]))
    code, rep = run_ng(tmp_path, script, [3])
    assert code == EXIT_NONFINITE
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (3, "params")
    assert ev["detected"]["nonfinite_params"] == ["fc2.bias"]
    h = rep["history"][0]
    assert len(h["group_grad_norms"]) == 2 and h["lr"] == [0.01, 0.003]
    assert h["grad_norm"] == pytest.approx((h["group_grad_norms"][0] ** 2 + h["group_grad_norms"][1] ** 2) ** 0.5)


# Steps are optimizer.step() calls across both optimizers (as the scenario verifier counts them):
# iteration 3's D update is step 6, its G update step 7.
@pytest.mark.parametrize("mode,phase,step", [("g_params", "params", 6), ("g_backward", "backward", 7),
                                             ("g_update", "optimizer", 7)])
def test_two_optimizers_gan(tmp_path, mode, phase, step):
    script = write(tmp_path, GAN_SCRIPT)
    code, rep = run_ng(tmp_path, script, [mode, 3])
    assert code == EXIT_NONFINITE
    assert rep["counting"] == "optimizer"
    assert len(rep["events"]) == 1  # blamed once, on the update/step that made it
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (step, phase)


def test_two_optimizers_gan_clean(tmp_path):
    script = write(tmp_path, GAN_SCRIPT)
    code, rep = run_ng(tmp_path, script)
    assert code == 0 and rep["status"] == "clean"
    assert rep["steps_watched"] == 12
    # one record per optimizer step: D's are 0, 2, .., 10 and G's 1, 3, .., 11
    assert [h["step"] for h in rep["history"]] == list(range(12))


# --------------------------------------------------------------------------- no optimizer

def test_hand_written_update_counts_backward_passes(tmp_path):
    script = write(tmp_path, HAND_SCRIPT)
    code, rep = run_ng(tmp_path, script)
    assert code == 0 and rep["status"] == "clean"
    assert rep["counting"] == "backward"
    assert rep["steps_watched"] == 6


@pytest.mark.parametrize("mode", ["data", "backward"])
def test_hand_written_update_detects_at_the_right_backward_pass(tmp_path, mode):
    script = write(tmp_path, HAND_SCRIPT)
    code, rep = run_ng(tmp_path, script, [mode, 4])
    assert code == EXIT_NONFINITE
    assert rep["counting"] == "backward"
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (4, mode)


# --------------------------------------------------------------------------- odd inputs

def test_model_without_parameters(tmp_path):
    script = write(tmp_path, """
        import sys
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh())  # no parameters at all
        assert not list(model.parameters())
        w = torch.zeros(4, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        BAD = int(sys.argv[1])
        for step in range(5):
            x = torch.randn(8, 4)
            if step == BAD:
                x[0, 0] = float("nan")
            loss = ((model(x) * w).sum(dim=1) - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            model.eval()
            model(torch.randn(2, 4))
        print("done", w.tolist())
        """)
    code, rep = run_ng(tmp_path, script, [-1])
    assert (code, rep["status"], rep["steps_watched"]) == (0, "clean", 5)
    code, rep = run_ng(tmp_path, script, [2])
    assert code == EXIT_NONFINITE
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (2, "data")


def test_no_training_at_all(tmp_path):
    script = write(tmp_path, """
        import torch
        m = torch.nn.Identity()
        print(m(torch.ones(3)).sum().item())
        """)
    code, rep = run_ng(tmp_path, script)
    assert (code, rep["status"], rep["steps_watched"], rep["history"]) == (0, "clean", 0, [])


def test_integer_and_complex_tensors(tmp_path):
    script = write(tmp_path, """
        import sys
        import torch
        from torch import nn
        torch.manual_seed(0)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 4)
                self.c = nn.Parameter(torch.randn(4, dtype=torch.cfloat))  # a complex parameter
                self.fc = nn.Linear(4, 3)
                self.register_buffer("calls", torch.zeros((), dtype=torch.long))  # an integer buffer

            def forward(self, idx, z):
                self.calls += 1
                return self.fc(self.emb(idx).mean(1) + (z * self.c).real)

        model = M()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        BAD = int(sys.argv[1])
        for step in range(6):
            idx = torch.randint(0, 10, (8, 5))
            z = torch.randn(8, 4, dtype=torch.cfloat)
            labels = torch.randint(0, 3, (8,))
            loss = nn.functional.cross_entropy(model(idx, z), labels)
            if step == BAD:
                loss = loss * torch.log(torch.tensor(-1.0))
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert int(model.calls) == 6
        """)
    code, rep = run_ng(tmp_path, script, [-1])
    assert (code, rep["status"], rep["steps_watched"]) == (0, "clean", 6)
    code, rep = run_ng(tmp_path, script, [4])
    assert code == EXIT_NONFINITE
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (4, "forward")


SPARSE = """
import sys
import torch
from torch import nn
torch.manual_seed(0)
emb = nn.Embedding(20, 4, sparse=True)
head = nn.Linear(4, 1)
OPT = sys.argv[1]
if OPT == "sparse_adam":
    opts = [torch.optim.SparseAdam(list(emb.parameters()), lr=1e-2), torch.optim.Adam(head.parameters(), lr=1e-2)]
else:
    opts = [torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)]
BAD = int(sys.argv[2])
OUT = sys.argv[3] if len(sys.argv) > 3 else None
for step in range(6):
    idx = torch.randint(0, 20, (8, 3))
    y = torch.randn(8, 1)
    if step == BAD:
        with torch.no_grad():
            emb.weight[idx[0, 0]] = float("nan")
    loss = ((head(emb(idx).mean(1)) - y) ** 2).mean()
    for o in opts:
        o.zero_grad()
    loss.backward()
    assert emb.weight.grad.is_sparse
    for o in opts:
        o.step()
if OUT:
    torch.save({"emb": emb.state_dict(), "head": head.state_dict()}, OUT)
"""


@pytest.mark.parametrize("opt", ["sparse_adam", "sgd"])
def test_sparse_gradients(tmp_path, opt):
    script = write(tmp_path, SPARSE)
    plain, guarded = str(tmp_path / "p.pt"), str(tmp_path / "g.pt")
    run_plain(script, [opt, -1, plain])
    code, rep = run_ng(tmp_path, script, [opt, -1, guarded])
    per_iteration = 2 if opt == "sparse_adam" else 1  # every optimizer.step() call is a step
    assert (code, rep["status"], rep["steps_watched"]) == (0, "clean", 6 * per_iteration)
    a, b = torch.load(plain), torch.load(guarded)
    assert_same_state(a["emb"], b["emb"])
    assert_same_state(a["head"], b["head"])
    code, rep = run_ng(tmp_path, script, [opt, 3])
    assert code == EXIT_NONFINITE
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (3 * per_iteration, "params")
    # two top-level models (emb, head) both hold a "weight": each is named by the script's variable of it
    assert ev["detected"]["nonfinite_params"] == ["emb.weight"]


def test_meta_device_tensors(tmp_path):
    script = write(tmp_path, """
        import sys
        import torch
        torch.manual_seed(0)
        with torch.device("meta"):  # e.g. sizing a big model without allocating it
            big = torch.nn.Linear(1000, 1000)
        meta_opt = torch.optim.SGD(big.parameters(), lr=0.1)
        big(torch.empty(2, 1000, device="meta")).sum().backward()
        meta_opt.step()
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        BAD = int(sys.argv[1])
        for step in range(5):
            x = torch.randn(8, 4)
            if step == BAD:
                x[0, 0] = float("inf")
            loss = (model(x) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        print("done")
        """)
    code, rep = run_ng(tmp_path, script, [-1])
    assert (code, rep["status"]) == (0, "clean")
    code, rep = run_ng(tmp_path, script, [2])
    assert code == EXIT_NONFINITE
    assert rep["events"][0]["phase"] == "data"


# --------------------------------------------------------------------------- exits

def test_missing_script_is_a_usage_error(tmp_path, capsys):
    missing = str(tmp_path / "nope.py")
    code = run_script(missing, [], report_path=str(tmp_path / "r.json"), localize=False)
    assert code == EXIT_USAGE == 2
    assert f"no such script: {missing}" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
    assert main(["run", "--no-localize", "--report", str(tmp_path / "r.json"), missing]) == 2


def test_script_exception_shows_its_traceback_and_exits_1(tmp_path, capsys):
    script = write(tmp_path, loop_script(
        before_forward='raise ValueError(f"boom at step {step}")'))
    code, rep = run_ng(tmp_path, script, [2], quiet=False)
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" in err and "ValueError: boom at step 2" in err
    assert f'File "{script}"' in err  # the user's frame is shown...
    assert "runpy" not in err and "cli.py" not in err  # ...not nanguard's
    # an honest status (issue 17): the script crashed, with what and where
    assert rep["status"] == "script_error" and rep["steps_watched"] == 2
    se = rep["script_error"]
    assert se["type"] == "ValueError" and se["message"] == "boom at step 2" and se["step"] == 2
    assert se["file"] == script and isinstance(se["line"], int)


@pytest.mark.parametrize("stmt,expected", [("sys.exit(5)", 5), ("sys.exit(0)", 0), ("sys.exit()", 0),
                                           ("sys.exit('fatal: bad config')", 1)])
def test_sys_exit_inside_the_loop(tmp_path, capsys, stmt, expected):
    script = write(tmp_path, loop_script(before_forward=stmt))
    code, rep = run_ng(tmp_path, script, [3])
    assert code == expected
    assert rep["steps_watched"] == 3 and rep["status"] == ("clean" if expected == 0 else "exited")
    assert rep["exit_code"] == expected
    if "fatal" in stmt:
        assert "fatal: bad config" in capsys.readouterr().err


def test_keyboard_interrupt_exits_130_with_report(tmp_path, capsys):
    script = write(tmp_path, loop_script(before_forward="raise KeyboardInterrupt"))
    code, rep = run_ng(tmp_path, script, [4])
    assert code == 130
    assert rep["steps_watched"] == 4 and rep["status"] == "interrupted"
    assert rep["interrupted"]["signal"] == "SIGINT" and rep["interrupted"]["exit_status"] == 130
    assert "interrupted" in capsys.readouterr().err


def test_exit_after_nonfinite_is_3_and_warn_runs_to_the_end(tmp_path, capsys):
    script = write(tmp_path, loop_script(**INJECT["data_nan"]))
    code, rep = run_ng(tmp_path, script, [2])
    out = capsys.readouterr().out
    assert code == 3 and "done" not in out and len(_stdout_losses(out)) == 2
    code, rep = run_ng(tmp_path, script, [2], on_nonfinite="warn")
    out = capsys.readouterr().out
    assert code == 0 and "done" in out and len(_stdout_losses(out)) == 6
    assert rep["status"] == "nonfinite"
    assert rep["steps_watched"] == 6
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (2, "data")


def test_script_that_catches_everything_is_still_stopped(tmp_path):
    script = write(tmp_path, loop_script(**INJECT["forward_nan"]).replace(
        "    loss.backward()\n    opt.step()\n",
        "    try:\n        loss.backward()\n        opt.step()\n    except Exception:\n        pass\n"))
    code, rep = run_ng(tmp_path, script, [1])
    assert code == EXIT_NONFINITE
    assert rep["events"][0]["step"] == 1


def test_sys_argv_name_and_path_as_python_sets_them(tmp_path):
    (tmp_path / "helper_mod_ng.py").write_text("VALUE = 42\n")
    info = tmp_path / "info.json"
    script = write(tmp_path, f"""
        import json, sys
        import helper_mod_ng  # next to the script, importable as with `python SCRIPT`
        json.dump({{"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
                   "value": helper_mod_ng.VALUE}}, open({str(info)!r}, "w"))
        """)
    code = main(["run", "--no-localize", "--report", str(tmp_path / "r.json"), script,
                 "a", "--flag", "-x", "3"])
    sys.modules.pop("helper_mod_ng", None)
    assert code == 0
    d = json.loads(info.read_text())
    assert d["argv"] == [script, "a", "--flag", "-x", "3"]
    assert d["name"] == "__main__"
    assert os.path.abspath(d["file"]) == os.path.abspath(script)
    assert d["path0"] == str(tmp_path)
    assert d["value"] == 42
    assert load_report(tmp_path / "r.json")["status"] == "clean"


# --------------------------------------------------------------------------- guard errors

def _boom(*a, **k):
    raise RuntimeError("boom inside the monitor")


def test_internal_error_warns_and_training_continues(tmp_path, monkeypatch):
    script = write(tmp_path, loop_script())
    plain = str(tmp_path / "plain.pt")
    run_plain(script, [-1, plain])
    monkeypatch.setattr(nanguard.pytorch.detect.gather, "_norm", _boom)
    out = str(tmp_path / "g.pt")
    with pytest.warns(RuntimeWarning, match="internal error.*boom inside the monitor"):
        code, rep = run_ng(tmp_path, script, [-1, out])
    assert code == 0
    assert "guard_disabled" in rep
    assert_same_state(torch.load(plain), torch.load(out))  # training was not disturbed


def test_internal_error_disables_but_does_not_hide_the_run(tmp_path, monkeypatch):
    script = write(tmp_path, loop_script(**INJECT["data_nan"]))
    monkeypatch.setattr(nanguard.pytorch.detect.StepMonitor, "check", _boom)
    with pytest.warns(RuntimeWarning):
        code, rep = run_ng(tmp_path, script, [2])
    assert code == 0  # the guard is off; the script ran to its end
    # the report says so, from which step, and its status is not "clean"
    assert rep["guard_disabled"] == {"error": "RuntimeError: boom inside the monitor", "step": 0}
    assert rep["status"] == "guard_disabled"


def test_internal_error_strict_raises(tmp_path, monkeypatch, capsys):
    script = write(tmp_path, loop_script())
    monkeypatch.setattr(nanguard.pytorch.detect.StepMonitor, "check", _boom)
    code, rep = run_ng(tmp_path, script, [-1], strict=True)
    assert code == 1
    assert "RuntimeError: boom inside the monitor" in capsys.readouterr().err


# --------------------------------------------------------------------------- end to end

def _cli(tmp_path, *args, timeout=120):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "nanguard", "run", *args], capture_output=True,
                          text=True, cwd=str(tmp_path), timeout=timeout, env=env)


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_cli_subprocess_stop_and_report(tmp_path):
    script = write(tmp_path, loop_script(**INJECT["backward_inf"]))
    p = _cli(tmp_path, "--no-localize", "--report", "rep.json", script, "3")
    assert p.returncode == 3, p.stderr
    assert len(_stdout_losses(p.stdout)) == 3
    rep = load_report(tmp_path / "rep.json")
    assert (rep["status"], rep["events"][0]["step"], rep["events"][0]["phase"]) == ("nonfinite", 3, "backward")
    assert "nanguard" in p.stderr and "backward" in p.stderr


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_cli_subprocess_healthy_and_missing(tmp_path):
    script = write(tmp_path, loop_script())
    p = _cli(tmp_path, "--no-localize", script)
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 2 and "watching train.py" in lines[0] and "clean: watched 6 steps" in lines[1]
    assert load_report(tmp_path / "nanguard_report.json")["status"] == "clean"  # default path
    p = _cli(tmp_path, str(tmp_path / "missing.py"))
    assert p.returncode == 2
    assert "no such script" in p.stderr


def test_weights_cast_to_float16_beyond_its_range_are_low_precision_overflow(tmp_path):
    # model.half() swaps each parameter's storage without bumping its version counter: the recorder
    # must still see the write, and a cast of finite float32 weights past 65504 is an overflow.
    script = write(tmp_path, """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        with torch.no_grad():
            model[0].weight.mul_(3e5)  # an input scale folded into the first layer
        model = model.half()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(5):
            x = torch.randn(16, 5).half()
            loss = (model(x).float() ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        """)
    code, rep = run_ng(tmp_path, script, localize=True, bundle=None)
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (0, "params")
    assert ev["cause"]["category"] == "low_precision_overflow", ev["cause"]["summary"]
    assert "Tensor.half" in ev["cause"]["summary"] or "half" in ev["cause"]["summary"]


HAND_SGD = '''
import torch
torch.manual_seed(0)
x = torch.randn(128, 6)
y = x @ torch.randn(6, 1)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
for step in range(12):
    loss = ((model(x) - y) ** 2).mean()
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.05)
'''


def test_hand_written_updates_get_their_measured_step_size(tmp_path):
    # No optimizer object: the step size of the hand-written update is measured from the parameters
    # before and after it (read with the next check), and the history says it (plain SGD: exactly lr).
    code, rep = run_ng(tmp_path, write(tmp_path, HAND_SGD))
    assert code == 0 and rep["counting"] == "backward"
    hist = rep["history"]
    lrs = [h.get("effective_lr") for h in hist[:-1]]  # the last update is not followed by a check
    assert len(lrs) == 11 and all(lr == pytest.approx(0.05, rel=1e-3) for lr in lrs), lrs
    assert all(h.get("param_norm_after") is not None for h in hist[:-1])


def test_the_summary_line_calls_an_early_warning_a_warning_not_a_failure():
    from nanguard.core.events import Event, Report
    from nanguard.core.render.terminal import summary_line
    warned = Report(events=[Event(step=3, phase="any", kind="warning")], steps_watched=80)
    line = summary_line(warned)
    assert line.startswith("warning: watched 80 steps") and "first warning at step 3" in line
    assert "failure" not in line
    both = Report(events=[Event(step=3, phase="any", kind="warning"), Event(step=9, phase="forward")])
    assert "first failure at step 9 (forward)" in summary_line(both)
