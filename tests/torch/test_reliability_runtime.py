"""Issue 24, the runtime half: the guard stays on and every ending is honest.

Inference-mode evaluation between training steps, forked children, closure optimizers (LBFGS),
a NaN in one of two training threads, a signal during the localization re-run, a Guard inside
``watch()``, ``sys.exit(N)`` and a guard turned off by its own error. Each healthy shape also
trains bit for bit like the plain script.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ngtest import run_ng, run_plain, write  # noqa: E402

import nanguard  # noqa: E402


def _printed(out: str) -> list:
    return [ln for ln in out.splitlines() if ln.startswith("step=")]


def _same_run(tmp_path, capfd, script: str, args=()) -> dict:
    """The script run plainly and under ``nanguard run`` prints the same losses and ends with the
    same parameters (saved with torch.save to argv[-1]); returns the report."""
    plain, guarded = tmp_path / "plain.pt", tmp_path / "guarded.pt"
    run_plain(script, [*args, plain])
    out_plain = _printed(capfd.readouterr().out)
    code, rep = run_ng(tmp_path, script, [*args, guarded], localize=True)  # the step tape on, as by default
    out_guarded = _printed(capfd.readouterr().out)
    assert code == 0, rep
    assert out_plain and out_plain == out_guarded
    a, b = torch.load(plain, weights_only=True), torch.load(guarded, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return rep


# --------------------------------------------------------------------------- 1. inference mode
INFER = """\
import sys
import torch
torch.manual_seed(0)
BAD = int(sys.argv[1])
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(8):
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    if step == BAD:
        x[0, 0] = float("nan")
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.inference_mode():          # an evaluation between steps (Lightning's default)
        model.eval()
        xe = torch.randn(8, 4)
        val = (model(xe) - 1).abs().mean()
        model.train()
    print(f"step={step} loss={loss.item()!r} val={val.item()!r}")
if len(sys.argv) > 2:
    torch.save(model.state_dict(), sys.argv[2])
"""


def test_inference_mode_eval_keeps_the_guard_on(tmp_path):
    # localize: the step tape records the steps (and used to read _version of inference tensors)
    code, rep = run_ng(tmp_path, write(tmp_path, INFER), [5], localize=True, experiments=False)
    assert code == 3 and rep["status"] == "nonfinite"
    assert "guard_disabled" not in rep
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (5, "data")
    assert ev["cause"]["category"] == "bad_input_data"
    assert "step tape" in ev["localization"]["method"]  # replayed in-process: the tape stayed on


def test_inference_mode_eval_loop_is_bit_for_bit(tmp_path, capfd):
    rep = _same_run(tmp_path, capfd, write(tmp_path, INFER), [-1])
    assert rep["status"] == "clean" and rep["steps_watched"] == 8


def test_a_guard_turned_off_by_its_own_error_is_not_clean(tmp_path, monkeypatch):
    from nanguard.pytorch.detect import StepMonitor
    orig, calls = StepMonitor.check, []

    def check(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return orig(self, *a, **k)

    monkeypatch.setattr(StepMonitor, "check", check)
    with pytest.warns(RuntimeWarning, match="guard disabled"):
        code, rep = run_ng(tmp_path, write(tmp_path, INFER), [-1])
    assert code == 0
    assert rep["status"] == "guard_disabled"
    assert rep["guard_disabled"] == {"error": "RuntimeError: injected", "step": 2}
    from nanguard.core.events import Report
    from nanguard.core.render.terminal import summary_line
    line = summary_line(Report.from_dict(rep))
    assert line.startswith("guard_disabled:") and "disabled at step 2" in line


# --------------------------------------------------------------------------- 9. exit codes
def test_sys_exit_code_is_in_the_report(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, "import torch, sys\nsys.exit(5)\n"))
    assert code == 5 and rep["exit_code"] == 5 and rep["status"] == "exited"
    code, rep = run_ng(tmp_path, write(tmp_path, "import torch\nprint('ok')\n", "ok.py"))
    assert code == 0 and rep["exit_code"] == 0 and rep["status"] == "clean"
    code, rep = run_ng(tmp_path, write(tmp_path, "import torch\nraise ValueError('x')\n", "err.py"))
    assert code == 1 and rep["exit_code"] == 1 and rep["status"] == "script_error"
    code, rep = run_ng(tmp_path, write(tmp_path, INFER, "bad.py"), [2])
    assert code == 3 and rep["exit_code"] == 3 and rep["status"] == "nonfinite"


OS_EXIT = """
import os, sys
import torch
torch.manual_seed(0)
if os.fork() == 0:  # a worker process ends the way multiprocessing's children do
    os._exit(0)
os.wait()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    x = torch.randn(8, 4)
    if step == int(sys.argv[1]):
        x[2, 1] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done", flush=True)
os._exit(int(sys.argv[2]))  # skips the interpreter's shutdown (threads that would hang it)
"""


@pytest.mark.parametrize("bad,code", [(-1, 0), (-1, 4), (3, 0)])
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_os_exit_ends_the_run_with_an_honest_report_and_no_temp_file(tmp_path, bad, code):
    """``os._exit`` runs no ``finally``: the report stayed "running" and the run's RNG file was left in the temp
    folder. The run now ends inside it (a forked child's ``os._exit`` is left alone), with the script's status."""
    script, rep, tmp = write(tmp_path, OS_EXIT), tmp_path / "r.json", tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-m", "nanguard", "run", "--on-nonfinite", "warn", "--report", str(rep),
                          "--no-bundle", "--no-html", script, str(bad), str(code)], capture_output=True, text=True,
                         timeout=300, cwd=str(tmp_path), env={**os.environ, "TMPDIR": str(tmp)})
    data = json.loads(rep.read_text())
    assert out.returncode == code and data["exit_code"] == code, out.stderr[-2000:]
    assert "done" in out.stdout and "os._exit" in out.stderr
    want = "nonfinite" if bad >= 0 else ("exited" if code else "clean")
    assert data["status"] == want and data["steps_watched"] == 6, (data["status"], out.stderr[-2000:])
    assert [(e["step"], e["phase"]) for e in data["events"][:1]] == ([(3, "data")] if bad >= 0 else [])
    assert not list(tmp.glob("nanguard-*")), list(tmp.iterdir())


# --------------------------------------------------------------------------- 9. Guard inside watch()
def test_guard_inside_watch_is_left_to_the_guard(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(quiet=True) as w:
        g = nanguard.Guard(model, opt, quiet=True, bundle=None)
        for i in range(3):
            g.step(torch.randn(8, 4), lambda b: model(b).pow(2).mean())
        x = torch.randn(8, 4)
        x[1, 2] = float("nan")
        with pytest.raises(nanguard.NonFiniteError) as ei:
            g.step(x, lambda b: model(b).pow(2).mean())
    ev = ei.value.event
    assert (ev.step, ev.phase, ev.cause["category"]) == (3, "data", "bad_input_data")
    assert w.report.events == [] and w.report.steps_watched == 0
    assert not os.path.exists("nanguard_report.json")  # the watcher writes no file unasked
    assert torch.isfinite(model.weight).all()


# --------------------------------------------------------------------------- 4. closure optimizers
LBFGS = """\
import sys
import torch
torch.manual_seed(0)
BAD = int(sys.argv[1])
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
for step in range(6):
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    if step == BAD:
        x[0, 0] = float("nan")

    def closure():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    print(f"step={step} loss={loss.item()!r}")
    if len(sys.argv) > 2:
        assert all(torch.isfinite(p).all() for p in model.parameters()), "NaN reached the weights"
if len(sys.argv) > 2:
    torch.save(model.state_dict(), sys.argv[2])
"""


def test_lbfgs_nan_batch_stops_before_the_weights(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, LBFGS), [3, tmp_path / "w.pt"])
    assert code == 3 and rep["status"] == "nonfinite"
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (3, "data")
    assert rep["steps_watched"] == 3


def test_lbfgs_clean_run_is_bit_for_bit_and_history_is_current(tmp_path, capfd):
    rep = _same_run(tmp_path, capfd, write(tmp_path, LBFGS), [-1])
    run_plain(write(tmp_path, LBFGS, "again.py"), [-1])
    printed = [float(ln.split("loss=")[1]) for ln in _printed(capfd.readouterr().out)]
    hist = rep["history"]
    assert [h["loss"] for h in hist] == pytest.approx(printed, rel=1e-6)
    assert all(isinstance(h["grad_norm"], float) for h in hist)


def _lbfgs_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)


def _batches(n, bad=-1):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if i == bad:
            x[0, 0] = float("nan")
        out.append((x, y))
    return out


def _mse(model):
    return lambda b: ((model(b[0]) - b[1]) ** 2).mean()


def test_guard_with_lbfgs_is_bit_for_bit(tmp_path):
    m1, o1 = _lbfgs_model()
    plain = []
    for b in _batches(5):
        def closure(b=b):
            o1.zero_grad()
            loss = _mse(m1)(b)
            loss.backward()
            return loss
        plain.append(o1.step(closure).item())
    m2, o2 = _lbfgs_model()
    g = nanguard.Guard(m2, o2, quiet=True, bundle=None)
    guarded = [float(g.step(b, _mse(m2))) for b in _batches(5)]
    rep = g.close()
    assert plain == guarded and rep.status == "clean"
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert [h["loss"] for h in rep.history] == pytest.approx(plain, rel=1e-6)


def test_guard_with_lbfgs_stops_a_nan_batch(tmp_path):
    m, o = _lbfgs_model()
    g = nanguard.Guard(m, o, quiet=True, bundle=None)
    batches = _batches(4, bad=2)
    for b in batches[:2]:
        g.step(b, _mse(m))
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(nanguard.NonFiniteError) as ei:
        g.step(batches[2], _mse(m))
    assert (ei.value.event.step, ei.value.event.phase) == (2, "data")
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


def test_guard_with_lbfgs_checks_every_evaluation(tmp_path):
    """LBFGS evaluates the closure several times per step: a NaN at a later evaluation stops the step
    before the optimizer uses it."""
    m, o = _lbfgs_model()
    g = nanguard.Guard(m, o, quiet=True, bundle=None, localize=False)
    calls = []

    def loss_fn(b):
        calls.append(1)
        loss = _mse(m)(b)
        return loss * float("nan") if len(calls) == 6 else loss  # step 1's second evaluation (4 per step)

    with pytest.raises(nanguard.NonFiniteError) as ei:
        for b in _batches(4):
            g.step(b, loss_fn)
    assert (ei.value.event.step, ei.value.event.phase) == (1, "forward")
    assert all(torch.isfinite(p).all() for p in m.parameters())


LBFGS_LATER = LBFGS.replace("""    def closure():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()""", """    evals = []

    def closure():
        opt.zero_grad()
        evals.append(1)
        loss = ((model(x) - y) ** 2).mean()
        if step == BAD and len(evals) == 2:
            loss = loss * torch.tensor(float("nan"))""").replace('x[0, 0] = float("nan")', "pass")


def test_lbfgs_nan_at_a_later_evaluation_is_caught(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, LBFGS_LATER), [2, tmp_path / "w.pt"])
    assert code == 3 and rep["status"] == "nonfinite"
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (2, "forward")


# --------------------------------------------------------------------------- 6. threads
THREADS = """\
import sys, threading
import torch
BAD = int(sys.argv[1])
results = {}

def train(k):
    g = torch.Generator().manual_seed(k)
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 4, generator=g))
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(30):
        x = torch.randn(16, 4, generator=g)
        if k == 1 and step == BAD:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    results[k] = {f"m{k}.{n}": p.detach().clone() for n, p in model.named_parameters()}

ts = [threading.Thread(target=train, args=(k,)) for k in (0, 1)]
for t in ts:
    t.start()
for t in ts:
    t.join()
state = {**results.get(0, {}), **results.get(1, {})}
print("step=end", sorted(state))
if len(sys.argv) > 2:
    torch.save(state, sys.argv[2])
"""


def test_nan_in_one_of_two_threads_stops_the_run(tmp_path, capfd):
    code, rep = run_ng(tmp_path, write(tmp_path, THREADS), [4])
    err = capfd.readouterr().err
    assert code == 3 and rep["status"] == "nonfinite", err
    assert rep["events"][0]["phase"] == "data"
    assert "Traceback" not in err and "StopRun" not in err


def test_two_training_threads_are_bit_for_bit(tmp_path, capfd):
    _same_run(tmp_path, capfd, write(tmp_path, THREADS), [-1])


# --------------------------------------------------------------------------- 2. forked children
FORK = """\
import os, sys
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

def step(bad=False):
    x = torch.randn(16, 4)
    if bad:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

for i in range(3):
    step()
pid = os.fork()
if pid == 0:          # the child trains on (and goes NaN), then ends normally
    for i in range(6):
        step(bad=i == 1)
    sys.exit(0)
os.waitpid(pid, 0)
for i in range(4):
    step(bad=i == 2)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_forked_child_does_not_write_the_parents_report(tmp_path):
    # a subprocess: the forked child runs on to the script's end and returns into nanguard (not pytest)
    script, report, bundle = write(tmp_path, FORK), tmp_path / "r.json", tmp_path / "b.pt"
    p = subprocess.run([sys.executable, "-m", "nanguard", "run", "--report", str(report), "--no-html",
                        "--bundle", str(bundle), script], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120)
    rep = json.loads(report.read_text())
    assert p.returncode == 3 and rep["status"] == "nonfinite", p.stderr
    assert rep["steps_watched"] == 5 and rep["events"][0]["step"] == 5
    assert rep["exit_code"] == 3
    assert "Traceback" not in p.stderr
    from nanguard.pytorch.bundle import load_bundle
    assert load_bundle(str(bundle)).step == 5  # the parent's failing step, not the child's


MPFORK = """\
import multiprocessing as mp
import torch
torch.manual_seed(0)

def work(q):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(3):
        x = torch.randn(8, 4)
        if i == 1:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    q.put("done")

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=work, args=(q,))
    p.start()
    print("step=child", q.get(timeout=60))
    p.join()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_multiprocessing_fork_child_is_never_fatal(tmp_path, capfd):
    code, rep = run_ng(tmp_path, write(tmp_path, MPFORK))
    out = capfd.readouterr()
    assert code == 0 and "step=child done" in out.out
    assert "Traceback" not in out.err and "StopRun" not in out.err
    assert rep["status"] == "clean" and rep["exit_code"] == 0


# --------------------------------------------------------------------------- 7. signals win over localization
SLOW = """\
import os, sys, time
import torch
torch.manual_seed(0)
with open(sys.argv[1], "a") as f:
    f.write("start\\n")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(12):
    x = torch.randn(8, 4)
    if step == 11:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.2)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_the_localization_rerun_wins(tmp_path, sig, code):
    marks = tmp_path / "marks.txt"
    script = write(tmp_path, SLOW)
    report = tmp_path / "r.json"
    env = {**os.environ, "NANGUARD_TAPE": "0"}  # the failure is localized by re-running the script
    p = subprocess.Popen([sys.executable, "-m", "nanguard", "run", "--report", str(report), "--no-html",
                          "--no-bundle", script, str(marks)], env=env, cwd=str(tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while time.time() - t0 < 60:
            if marks.exists() and marks.read_text().count("start") >= 2:  # the re-run has started
                break
            time.sleep(0.05)
        time.sleep(0.5)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == code, err
    rep = json.loads(report.read_text())
    assert rep["status"] == "interrupted" and rep["exit_code"] == code
    assert rep["interrupted"]["signal"] == signal.Signals(sig).name
    ev = rep["events"][0]
    assert ev["step"] == 11
    loc = json.dumps(ev["localization"]).lower()
    assert "interrupted" in loc
    assert "nondetermin" not in json.dumps(ev).lower() and "could not reproduce" not in json.dumps(ev).lower()
