"""Command line: ``nanguard run``, ``nanguard demo`` (argument parsing; the work is in :mod:`.run`).

"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .._version import __version__
from ..core.exitcodes import EXIT_USAGE
from .report_html import add_parser as add_report_parser
from .show import add_parser as add_show_parser


def run_script(script: str, args: List[str], **kwargs) -> int:
    """:func:`nanguard.cli.run.run_script`, imported when a script is run: it imports torch and the
    backend (seconds), which ``nanguard --help`` / ``--version`` do without."""
    from .run import run_script as run
    return run(script, args, **kwargs)


class _Parser(argparse.ArgumentParser):
    """Argument errors are one line on stderr and exit status 2 (no usage block to read through)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _check_recover(spec: Optional[str]) -> Optional[str]:
    """What is wrong with a ``--recover`` value (checked by the framework-free core), or None."""
    if spec is None:
        return None
    from ..core.recovery.policy import RecoveryPolicy
    try:
        RecoveryPolicy.from_spec(spec)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _Parser(prog="nanguard", description="Catch the first NaN/Inf in PyTorch training, "
                 "find where it was born, and say why.")
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="run a training script under the guard, with no code changes")
    r.add_argument("--report", default="nanguard_report.json", help="where to write the JSON report "
                   "(default: ./nanguard_report.json)")
    r.add_argument("--on-nonfinite", choices=["stop", "warn"], default="stop",
                   help="stop before the bad update is applied (default), or warn and carry on")
    r.add_argument("--recover", default=None, metavar="auto|ACTIONS",
                   help="recover instead of stopping: 'auto' picks the action from the diagnosis; or a "
                        "comma list of allowed actions (skip_step,rollback,lr_backoff,clip,upcast,loss_scale)")
    r.add_argument("--on-spike", choices=["warn", "skip", "rollback"], default=None,
                   help="what an early warning (the loss or gradient norm spiking or growing before anything "
                        "is non-finite) does: warn (the default), skip the step, or roll back to before the "
                        "excursion and lower the learning rate (the default with --recover)")
    r.add_argument("--no-localize", action="store_true",
                   help="do not re-run the script to find the origin op (detection only)")
    r.add_argument("--experiments", default="auto", metavar="auto|off|STEPS|KINDS",
                   help="counterfactual replays that test the diagnosed cause (PyTorch, Keras and JAX, from the "
                        "in-process step replay): 'auto' (a budget of 3 training steps), 'off', a budget in training steps, or a "
                        "comma list of kinds (drop_samples,upcast_module,float64_step,...)")
    r.add_argument("--strict", action="store_true", help="internal guard errors raise instead of warning")
    r.add_argument("--bundle", default=None, help="where to save the repro bundle of the first failure "
                   "(default: nanguard_bundle.pt next to the report)")
    r.add_argument("--no-bundle", action="store_true", help="do not save a repro bundle")
    r.add_argument("--html", default="auto", metavar="PATH", help="where to write the HTML report of a run "
                   "that had an event (default: beside the JSON report, .html)")
    r.add_argument("--no-html", action="store_true", help="do not write the HTML report")
    r.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the step history and the events to TensorBoard event files in DIR")
    r.add_argument("script", help="the training script (run as __main__, like `python SCRIPT ARGS`)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    d = sub.add_parser("demo", help="run a small built-in training script that goes NaN, and show the report")
    d.add_argument("--report", default=None, help="also write the JSON report here")
    add_report_parser(sub)
    add_show_parser(sub)
    if not argv or argv[0] not in ("run", "demo"):  # start-up: `nanguard run` does not import the linter
        from ..lint.command import add_parser as add_lint_parser
        add_lint_parser(sub)
    a = ap.parse_args(argv)
    if a.version:
        print(f"nanguard {__version__}")
        return 0
    if a.cmd == "run":
        try:
            if a.experiments != "auto":  # start-up: the experiments' modules only when asked for
                from ..core.experiments.config import ExperimentConfig
                ExperimentConfig.from_spec(a.experiments)
        except (ValueError, TypeError) as e:
            print(f"nanguard: --experiments: {e}", file=sys.stderr)
            return EXIT_USAGE
        bad = _check_recover(a.recover)
        if bad:
            print(f"nanguard: --recover: {bad}", file=sys.stderr)
            return EXIT_USAGE
        return run_script(a.script, a.args, report_path=a.report, on_nonfinite=a.on_nonfinite,
                          recover=a.recover, localize=not a.no_localize, strict=a.strict,
                          bundle=None if a.no_bundle else (a.bundle or "auto"), tensorboard=a.tensorboard,
                          html=None if a.no_html else a.html, experiments=a.experiments, on_spike=a.on_spike)
    if a.cmd == "demo":
        from .demo import run_demo  # lazy: imports torch, like `run`
        return run_demo(a.report)
    if a.cmd in ("report", "show", "lint"):
        return a.run(a)
    ap.print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
