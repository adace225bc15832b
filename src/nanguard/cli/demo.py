"""``nanguard demo``: run the built-in example under ``nanguard run`` and show the report."""
from __future__ import annotations

import os
import tempfile
from typing import Optional

from ..core.exitcodes import EXIT_NONFINITE
from ..core.render.terminal import print_line
from .run import run_script


def demo_script_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "demo_train.py")


def run_demo(report_path: Optional[str] = None) -> int:
    """Run the demo; exit 0 when nanguard caught and explained the failure, 1 otherwise."""
    script = demo_script_path()
    print_line(f"demo: training {os.path.relpath(script)} (a metric-learning net with a hand-written "
               "pairwise distance) under `nanguard run`")
    with tempfile.TemporaryDirectory() as tmp:
        path = report_path or os.path.join(tmp, "nanguard_report.json")
        code = run_script(script, [], report_path=path)
        if report_path:
            print_line(f"demo: JSON report written to {report_path}")
    if code == EXIT_NONFINITE:
        print_line("demo: the run was stopped before the NaN reached the weights. "
                   "Try it on your own script: nanguard run train.py")
        return 0
    print_line(f"demo: unexpected exit status {code}")
    return 1
