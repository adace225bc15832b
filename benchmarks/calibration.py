"""Calibration of ``cause.confidence`` and the counterfactual experiments, on scenario suites.

Runs every non-clean scenario of the given directories (``NAME.py`` + ``NAME.json``, see
``/work/shared/scenarios/FORMAT.md``) under ``nanguard run`` as a user would, keeps the JSON report,
and compares the first event's ``cause.category`` with the scenario's ``accept`` list::

    python -m benchmarks.calibration tests/scenarios /work/shared/scenarios/public --out /tmp/cal.json
    python -m benchmarks.calibration --guard benchmarks/cf_scenarios    # Guard-driven scripts (NAME.py REPORT)
    python -m benchmarks.calibration --from /tmp/cal.json /tmp/cal2.json # re-print saved runs, merged

It prints the calibration table (confidence bucket -> share of right categories), the share of
causes at confidence >= 0.9 that are right (target >= 0.95), the share of diagnoses confirmed by an
experiment (``cause.confirmed_by``), and the median time the experiments added as a multiple of one
training step (``cause.evidence.experiments_cost.step_multiple``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from nanguard.core.experiments.calibration import calibration_table, share_right_at



def run_one(script: pathlib.Path, timeout: float, extra: List[str], guard: bool = False) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        cmd = [sys.executable, str(script), str(report), *extra] if guard else \
            [sys.executable, "-m", "nanguard", "run", "--report", str(report), "--no-bundle", "--no-html",
             *extra, str(script)]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(script.parent),
                               env={**os.environ, "OMP_NUM_THREADS": "2"})
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        data = json.loads(report.read_text()) if report.exists() else None
        return {"rc": rc, "seconds": round(time.time() - t0, 2), "report": data}


def row_of(truth: Dict[str, Any], res: Dict[str, Any], suite: str) -> Dict[str, Any]:
    ev = ((res.get("report") or {}).get("events") or [{}])[0]
    cause = ev.get("cause") or {}
    evid = cause.get("evidence") or {}
    cost = evid.get("experiments_cost") or {}
    return {"id": truth["id"], "suite": suite, "truth": truth["category"], "accept": truth["accept"],
            "category": cause.get("category"), "confidence": cause.get("confidence"),
            "right": cause.get("category") in truth["accept"], "confirmed_by": cause.get("confirmed_by"),
            "ruled_out": cause.get("ruled_out"), "experiments": evid.get("experiments"),
            "experiments_seconds": cost.get("seconds"), "step_multiple": cost.get("step_multiple"),
            "rc": res.get("rc"), "seconds": res.get("seconds")}


def table(rows: List[Dict[str, Any]]) -> str:
    lines = ["confidence bucket   n   right  share"]
    for b in calibration_table(rows):
        lo, hi = b["bucket"]
        lines.append(f"[{lo:.2f}, {hi:.2f}{']' if hi == 1.0 else ')'}  {b['n']:3d}  {b['right']:5d}  {b['share']:.2f}")
    hi = share_right_at(rows, 0.9)
    if hi["n"]:
        lines.append(f"confidence >= 0.9: {hi['right']}/{hi['n']} right ({hi['share']:.3f}; target >= 0.95)")
    conf = [r for r in rows if r["confirmed_by"]]
    lines.append(f"confirmed by an experiment: {len(conf)}/{len(rows)} ({len(conf) / max(len(rows), 1):.2f}); "
                 f"of them right: {sum(r['right'] for r in conf)}")
    mult = [r["step_multiple"] for r in rows if isinstance(r["step_multiple"], (int, float))]
    if mult:
        lines.append(f"experiments' added time: median {statistics.median(mult):.2f} training steps "
                     f"(n={len(mult)}, max {max(mult):.2f})")
    for r in rows:
        if not r["right"]:
            lines.append(f"  wrong: {r['suite']}/{r['id']}: got {r['category']} ({r['confidence']}), "
                         f"truth {r['truth']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--guard", nargs="*", default=[], help="directories of Guard-driven scripts (NAME.py REPORT)")
    ap.add_argument("--out", help="write the rows (and reports' causes) here")
    ap.add_argument("--from", dest="from_", nargs="*", help="print the table of saved runs (merged)")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--only", default=None, help="comma list of scenario ids")
    ap.add_argument("--extra", default="", help="extra `nanguard run` arguments, space separated")
    a = ap.parse_args()
    if a.from_:
        rows = [r for f in a.from_ for r in json.loads(pathlib.Path(f).read_text())["rows"]]
        print(table(rows))
        return
    rows = []
    only = set(a.only.split(",")) if a.only else None
    dirs = [(pathlib.Path(d), False) for d in a.paths] + [(pathlib.Path(d), True) for d in a.guard]
    for d, guard in dirs:
        for js in sorted(d.glob("*.json")):
            truth = json.loads(js.read_text())
            if truth.get("kind") != "nonfinite" or (only and truth["id"] not in only):
                continue
            res = run_one(js.with_suffix(".py").resolve(), a.timeout, a.extra.split(), guard)
            r = row_of(truth, res, d.name)
            rows.append(r)
            print(f"{'ok ' if r['right'] else 'BAD'} {r['id']:<38} {r['category']} {r['confidence']} "
                  f"confirmed_by={(r['confirmed_by'] or {}).get('kind')} x_step={r['step_multiple']} "
                  f"{r['seconds']}s", flush=True)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
