"""``nanguard demo``: run the built-in example under ``nanguard run`` and show the report.

The report stays where the user can open it: ``--report PATH``, else ``nanguard_demo_report.json``
in the current folder (and its HTML page beside it); when the current folder cannot be written,
a new temporary folder that is kept (its path is printed).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from typing import Optional

from ..core.exitcodes import EXIT_NONFINITE, EXIT_USAGE
from ..core.render.terminal import print_line
from .run import run_script

DEFAULT_REPORT = "nanguard_demo_report.json"


def demo_script_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "demo_train.py")


def demo_report_path(report_path: Optional[str] = None) -> str:
    """Where the demo writes its report: the path given, else the current folder, else a kept temp folder."""
    if report_path:
        return report_path
    if os.access(os.getcwd(), os.W_OK):
        return os.path.join(os.getcwd(), DEFAULT_REPORT)
    return os.path.join(tempfile.mkdtemp(prefix="nanguard-demo-"), DEFAULT_REPORT)


def run_demo(report_path: Optional[str] = None) -> int:
    """Run the demo; exit 0 when nanguard caught and explained the failure, 1 otherwise, 2 without torch."""
    if importlib.util.find_spec("torch") is None:  # the demo is a PyTorch script; say so in one line
        print("nanguard: the demo trains a PyTorch model and torch is not installed: pip install "
              "'nanguard[torch]' (or run nanguard run on your own TensorFlow/Keras script)", file=sys.stderr)
        return EXIT_USAGE
    script = demo_script_path()
    print_line(f"demo: training {os.path.relpath(script)} (a metric-learning net with a hand-written "
               "pairwise distance) under `nanguard run`")
    path = demo_report_path(report_path)
    code = run_script(script, [], report_path=path, bundle=None)
    print_line(f"demo: JSON report written to {path} (open it with: nanguard show {path})")
    if code == EXIT_NONFINITE:
        print_line("demo: the run was stopped before the NaN reached the weights. "
                   "Try it on your own script: nanguard run train.py")
        return 0
    print_line(f"demo: unexpected exit status {code}")
    return 1
