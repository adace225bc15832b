"""Does the in-process replay (step tape) find what the full re-run finds? (issue 17)

Runs every scenario of the given folders twice under ``nanguard run``: as is (a failure is
localized in-process from the step tape when it can), and with ``NANGUARD_TAPE=0`` (always the
full re-run of the script). Compares the first event's step, phase, category, origin op, line and
module, and prints which localization each run used and how long it took::

    python -m benchmarks.tape_vs_rerun /work/shared/scenarios/public tests/scenarios [--out r.json]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def run(script: pathlib.Path, tape: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "r.json")
        env = {**os.environ, "NANGUARD_TAPE": "1" if tape else "0", "OMP_NUM_THREADS": "2"}
        p = subprocess.run([sys.executable, "-m", "nanguard", "run", "--report", rep, "--no-bundle", "--no-html",
                            str(script)], capture_output=True, text=True, cwd=tmp, env=env, timeout=900)
        if not os.path.exists(rep):
            return {"rc": p.returncode, "error": p.stderr[-300:]}
        r = json.load(open(rep))
    ev = (r.get("events") or [None])[0]
    if ev is None:
        return {"rc": p.returncode, "status": r["status"]}
    o, loc = ev.get("origin") or {}, ev.get("localization") or {}
    return {"rc": p.returncode, "status": r["status"], "step": ev["step"], "phase": ev["phase"],
            "category": ev["cause"]["category"], "op": o.get("op"), "line": o.get("line"), "module": o.get("module"),
            "method": loc.get("method_kind"), "seconds": loc.get("seconds"),
            "fallback": (loc.get("fallback_from") or {}).get("reason")}


KEYS = ("status", "step", "phase", "category", "op", "line", "module")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows, same = [], 0
    for d in a.dirs:
        for truth in sorted(pathlib.Path(d).glob("*.json")):
            script = truth.with_suffix(".py")
            if not script.exists():
                continue
            t, r = run(script, True), run(script, False)
            ok = all(t.get(k) == r.get(k) for k in KEYS)
            same += ok
            rows.append({"scenario": script.stem, "tape": t, "rerun": r, "same": ok})
            diff = "" if ok else "  DIFF " + ", ".join(f"{k}: {t.get(k)!r} vs {r.get(k)!r}" for k in KEYS
                                                      if t.get(k) != r.get(k))
            print(f"{'same' if ok else 'DIFF':4} {script.stem:38} tape={t.get('method')} {t.get('seconds')}s "
                  f"rerun={r.get('method')} {r.get('seconds')}s{diff}" + (f"  (fallback: {t['fallback']})"
                                                                          if t.get("fallback") else ""), flush=True)
    print(f"{same}/{len(rows)} scenarios give the same first event")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
