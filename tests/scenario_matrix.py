"""Check that scenario truths hold on any CPU (see tests/scenarios/README.md).

Runs each scenario unguarded under a small reference detector and under
`nanguard run`, once per CPU capability (`ATEN_CPU_CAPABILITY`) and thread count
(`OMP_NUM_THREADS`), and prints what each run saw next to the truth. A row is
marked BAD when a run disagrees with NAME.json (first bad step, or the phase the
detector can tell apart: loss / gradients / updated parameters).

This is a tool for scenario authors, not a test (pytest does not collect it):

    .venv/bin/python tests/scenario_matrix.py [--caps default,avx2,native]
        [--threads 1,2] [--no-guard] [--recover] [NAME ...]
    .venv/bin/python tests/scenario_matrix.py --perturb 20 [NAME ...]

`--perturb N` runs the reference detector N more times (native capability, one
thread) with every parameter scaled by (1 + 1e-7 * noise) when the optimizer is
built (`--scale` to change 1e-7): a stand-in for the rounding of a CPU not at
hand. A truth decided by construction does not move; one decided by the last
bits does. It cannot see rounding that touches only the data (a reduction over
the batch): reason about those (README).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).parent / "scenarios"

# Reference detector: counts iterations as optimizer steps divided by the number of
# optimizers (a step GradScaler skips counts too); checks the loss at backward, the
# gradients and parameters before each step and the parameters after it.
PROBE = r'''
import os, runpy, sys, torch
state = {"it": 0, "first": None, "what": None, "steps": 0, "optimizers": 0}
_opt_init = torch.optim.Optimizer.__init__
def _counting_init(self, *a, **k):
    state["optimizers"] += 1
    _opt_init(self, *a, **k)
torch.optim.Optimizer.__init__ = _counting_init
def _count():  # iteration = optimizer steps // optimizers (a GAN steps two per iteration)
    state["steps"] += 1
    state["it"] = state["steps"] // max(1, state["optimizers"])
def _bad(t):
    return t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all())
_orig_backward = torch.Tensor.backward
def backward(self, *a, **k):
    if state["first"] is None and self.numel() == 1 and _bad(self.detach()):
        state["first"], state["what"] = state["it"], "loss"
    return _orig_backward(self, *a, **k)
torch.Tensor.backward = backward
def pre(opt, args, kwargs):
    if state["first"] is None:
        for g in opt.param_groups:
            for p in g["params"]:
                if _bad(p.detach()):
                    state["first"], state["what"] = state["it"], "params_before"; return
                if p.grad is not None and _bad(p.grad):
                    state["first"], state["what"] = state["it"], "grad"; return
def post(opt, args, kwargs):
    if state["first"] is None:
        for g in opt.param_groups:
            for p in g["params"]:
                st = opt.state.get(p) or {}  # or the optimizer state (an fp16 exp_avg_sq that overflowed)
                if _bad(p.detach()) or any(isinstance(v, torch.Tensor) and v.is_floating_point() and _bad(v)
                                           for v in st.values()):
                    state["first"], state["what"] = state["it"], "params_after"; break
    _count()
import torch.optim.optimizer as _oo
_oo.register_optimizer_step_pre_hook(pre)
_oo.register_optimizer_step_post_hook(post)
from torch.amp import GradScaler
_orig_scaler_step = GradScaler.step
def scaler_step(self, optimizer, *a, **k):
    before = state["steps"]
    out = _orig_scaler_step(self, optimizer, *a, **k)
    if state["steps"] == before:  # skipped by the scaler
        _count()
    return out
GradScaler.step = scaler_step
if os.environ.get("SCENARIO_PERTURB"):
    # stand-in for another CPU's rounding: scale the parameters of every optimizer by
    # (1 + SCALE * N(0, 1)) when it is built (a separate generator: the script's own draws are unchanged)
    _gen = torch.Generator().manual_seed(int(os.environ["SCENARIO_PERTURB"]))
    _scale = float(os.environ.get("SCENARIO_PERTURB_SCALE", "1e-7"))
    _orig_init = torch.optim.Optimizer.__init__
    def _init(self, params, *a, **k):
        _orig_init(self, list(params), *a, **k)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if p.is_floating_point():
                        p.mul_(1 + _scale * torch.randn(p.shape, generator=_gen).to(p.dtype))
    torch.optim.Optimizer.__init__ = _init
script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    sys.stdout.flush()
    print("PROBE " + repr((state["first"], state["what"])), file=sys.stderr)
'''

EXPECT_WHAT = {"forward": ("loss",), "data": ("loss",), "params": ("loss", "params_before"),
               "backward": ("grad",), "optimizer": ("params_after",)}


def _env(cap: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NANGUARD_TEST_THREADS": str(threads)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cap != "native":
        env["ATEN_CPU_CAPABILITY"] = cap
    return env


def _final(stdout: str):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("final_loss=")]
    return lines[-1].split("=", 1)[1] if lines else None


def probe(script: pathlib.Path, env: dict):
    p = subprocess.run([sys.executable, "-c", PROBE, str(script)], capture_output=True,
                       text=True, timeout=300, env=env)
    for line in p.stderr.splitlines():
        if line.startswith("PROBE "):
            return eval(line[6:]), _final(p.stdout)
    return ("crash", p.stderr.strip().splitlines()[-1:]), None


def guarded(script: pathlib.Path, env: dict, recover: bool):
    with tempfile.TemporaryDirectory() as d:
        report = pathlib.Path(d) / "r.json"
        cmd = [sys.executable, "-m", "nanguard", "run", "--report", str(report), "--no-bundle"]
        if recover:
            cmd += ["--recover", "auto"]
        p = subprocess.run(cmd + [str(script)], capture_output=True, text=True, timeout=300,
                           cwd=d, env=env)
        if not report.exists():
            return {"rc": p.returncode, "err": p.stderr.strip().splitlines()[-1:]}
        data = json.loads(report.read_text())
    out = {"rc": p.returncode, "status": data["status"], "final": _final(p.stdout)}
    if data["events"]:
        ev = data["events"][0]
        o = ev.get("origin") or {}
        out.update(step=ev["step"], phase=ev["phase"], cat=ev["cause"]["category"],
                   line=o.get("line"), module=o.get("module"))
    return out


def perturbed(cases, n: int, scale: float) -> int:
    bad = 0
    for js in cases:
        truth = json.loads(js.read_text())
        lo, hi = truth.get("first_bad_step_range") or [truth.get("first_bad_step")] * 2
        seen = {}
        for seed in range(1, n + 1):
            env = {**_env("native", 1), "SCENARIO_PERTURB": str(seed), "SCENARIO_PERTURB_SCALE": str(scale)}
            (first, what), _ = probe(js.with_suffix(".py"), env)
            seen[(first, what)] = seen.get((first, what), 0) + 1
        if truth["kind"] in ("clean", "warning"):  # warning: diverges, every value stays finite
            ok = set(seen) == {(None, None)}
        else:
            ok = all(f not in (None, "crash") and lo <= f <= hi and w in EXPECT_WHAT.get(truth["phase"], (w,))
                     for f, w in seen)
        bad += not ok
        dist = ", ".join(f"{f}/{w} x{c}" for (f, w), c in sorted(seen.items(), key=str))
        print(("ok  " if ok else "BAD ") + f"{truth['id']:<36} {dist}", flush=True)
    print(f"{bad} bad scenarios")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="default,avx2,native")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--no-guard", action="store_true", help="only the unguarded reference runs")
    ap.add_argument("--recover", action="store_true", help="also run --recover auto")
    ap.add_argument("--perturb", type=int, default=0, metavar="N",
                    help="only N unguarded runs with the initial parameters perturbed by 1e-7 (relative)")
    ap.add_argument("--scale", type=float, default=1e-7,
                    help="relative size of the --perturb noise (1e-7: about one rounding; larger probes the margin)")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    cases = sorted(HERE.glob("*.json"))
    if a.names:
        cases = [c for c in cases if c.stem in a.names]
    if a.perturb:
        return perturbed(cases, a.perturb, a.scale)
    bad = 0
    for js in cases:
        truth = json.loads(js.read_text())
        script = js.with_suffix(".py")
        lo, hi = truth.get("first_bad_step_range") or [truth.get("first_bad_step")] * 2
        for cap in a.caps.split(","):
            for th in map(int, a.threads.split(",")):
                env = _env(cap, th)
                t0 = time.time()
                (first, what), final = probe(script, env)
                problems = []
                if truth["kind"] in ("clean", "warning"):
                    if first is not None:
                        problems.append("probe non-finite")
                else:
                    if first is None or first == "crash" or not lo <= first <= hi:
                        problems.append("probe step")
                    if what not in EXPECT_WHAT.get(truth["phase"], (what,)):
                        problems.append("probe phase")
                row = f"{truth['id']:<36} {cap:<7} t={th} probe={first!s:>4}/{what!s:<13}"
                if not a.no_guard:
                    g = guarded(script, env, recover=False)
                    row += (f" ng={g.get('step')!s:>4}/{g.get('phase')!s:<9} {g.get('cat')!s:<22}"
                            f" line={g.get('line')!s:<4} mod={g.get('module')!s}")
                    if truth["kind"] in ("clean", "warning"):
                        if g.get("status") != truth["kind"]:
                            problems.append(f"ng not {truth['kind']}")
                    else:
                        if g.get("step") is None or not lo <= g["step"] <= hi:
                            problems.append("ng step")
                        if truth["phase"] != "any" and g.get("phase") != truth["phase"]:
                            problems.append("ng phase")
                        if g.get("cat") not in truth["accept"]:
                            problems.append("ng category")
                        if truth.get("origin_line") and g.get("line") != truth["origin_line"]:
                            problems.append("ng line")
                        if truth.get("origin_module") is not None and g.get("module") != truth["origin_module"]:
                            problems.append("ng module")
                    if a.recover and truth.get("recoverable"):
                        r = guarded(script, env, recover=True)
                        ok = (r.get("rc") == 0 and r.get("status") == "recovered" and r.get("final")
                              and float(r["final"]) <= truth["max_final_loss"])
                        row += f" rec={r.get('status')}/{r.get('final')}"
                        if not ok:
                            problems.append("recover")
                row += f" {time.time() - t0:5.1f}s"
                bad += bool(problems)
                print(("BAD " if problems else "ok  ") + row + ("  " + ",".join(problems) if problems else ""),
                      flush=True)
    print(f"{bad} bad rows")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
