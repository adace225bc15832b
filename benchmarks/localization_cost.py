"""What localizing a failure at step N costs under ``nanguard run`` (issue 17), as a multiple of one step.

A long job (logistic regression, batch 16, SGD: about a third of a millisecond per step) whose batch
of iteration N holds a NaN feature, for N = 10, 1,000 and 100,000. For each N it runs:

* ``python script N`` unguarded with no failure, to time one plain step (median over the run);
* ``nanguard run script N``: the failure is localized in-process from the step tape
  (``localization.method_kind`` = ``replay-tape``); its ``localization.seconds`` is the cost;
* with ``NANGUARD_TAPE=0``: the full re-run of the script to step N (the fallback), for N up to
  ``--rerun-max`` (default 1,000; the re-run at 100,000 costs the whole run again).

``--model mlp`` runs the same job with a 256-1024-1024-1 MLP (batch 128, a few milliseconds a step):
the tiny step shows that the cost does not grow with N, this one what the fixed cost is worth in
steps of a model that does some work.

Prints a table (seconds, multiple of one plain step, of the guarded step) and writes JSON with
``--out``. Not a test: timings depend on the machine; run it on a quiet one::

    python -m benchmarks.localization_cost [--steps 10,1000,100000] [--rerun-max 1000] [--out r.json]
    python -m benchmarks.localization_cost --model mlp --steps 10,1000,5000 --rerun-max 1000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPT = '''
import json, sys, time
import torch
import torch.nn.functional as F
FAIL, STEPS, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
MLP = len(sys.argv) > 4 and sys.argv[4] == "mlp"
torch.manual_seed(0)
torch.set_num_threads(1)
D, B = (256, 128) if MLP else (8, 16)
X = torch.randn(4096, D)
Y = (X @ torch.randn(D, 1) + 0.3 * torch.randn(4096, 1) > 0).float()
if MLP:  # a step of a few milliseconds, like a small real model
    model = torch.nn.Sequential(torch.nn.Linear(D, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 1))
else:
    model = torch.nn.Linear(D, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
times, i = [], 0
try:
    for it in range(STEPS):
        t0 = time.perf_counter()
        xb, yb = X[i:i + B], Y[i:i + B]
        if it == FAIL:
            xb = xb.clone()
            xb[3, 5] = float("nan")             # a corrupted record
        loss = F.binary_cross_entropy_with_logits(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        i = (i + B) % 4096
finally:
    times.sort()
    with open(OUT, "w") as f:
        json.dump({"steps": len(times), "median_step_s": times[len(times) // 2] if times else None}, f)
'''


def _run(cmd, env=None):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    return p, time.perf_counter() - t0


def measure(n: int, tmp: str, rerun: bool, model: str = "linear") -> dict:
    script = os.path.join(tmp, "long_job.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    plain = os.path.join(tmp, "plain.json")
    _run([sys.executable, script, "-1", str(min(max(n, 2000), 20000) if model == "linear" else 300), plain, model])
    step = json.load(open(plain))["median_step_s"]
    out = {"N": n, "model": model, "plain_step_s": step}
    for kind, env in (("tape", {}), ("rerun", {"NANGUARD_TAPE": "0"})):
        if kind == "rerun" and not rerun:
            continue
        rep, timing = os.path.join(tmp, f"r_{kind}.json"), os.path.join(tmp, f"t_{kind}.json")
        p, wall = _run([sys.executable, "-m", "nanguard", "run", "--report", rep, "--no-html", "--no-bundle",
                        script, str(n), str(n + 10), timing, model], env)
        ev = json.load(open(rep))["events"][0]
        loc = ev["localization"]
        guarded = json.load(open(timing))["median_step_s"]
        out[kind] = {"method_kind": loc.get("method_kind"), "seconds": loc.get("seconds"),
                     "x_plain_step": round(loc["seconds"] / step, 1) if loc.get("seconds") else None,
                     "x_guarded_step": round(loc["seconds"] / guarded, 1) if loc.get("seconds") and guarded else None,
                     "guarded_step_s": guarded, "run_wall_s": round(wall, 2), "step": ev["step"],
                     "phase": ev["phase"], "category": ev["cause"]["category"], "exit": p.returncode}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="10,1000,100000")
    ap.add_argument("--rerun-max", type=int, default=1000)
    ap.add_argument("--model", choices=["linear", "mlp"], default="linear",
                    help="linear: logistic regression (~0.5 ms a step); mlp: 256-1024-1024-1 MLP, batch 128 "
                         "(a few ms a step)")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.steps.split(",")]:
            r = measure(n, tmp, rerun=n <= a.rerun_max, model=a.model)
            rows.append(r)
            for kind in ("tape", "rerun"):
                if kind in r:
                    k = r[kind]
                    print(f"{a.model:6} N={n:>7}  {kind:5} {k['method_kind']:11} {k['seconds']:8.3f} s = {k['x_plain_step']:>9} x "
                          f"plain step ({r['plain_step_s'] * 1e3:.3f} ms) = {k['x_guarded_step']:>8} x guarded step "
                          f"({k['guarded_step_s'] * 1e3:.3f} ms); run {k['run_wall_s']} s; event {k['step']} "
                          f"{k['phase']} {k['category']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
