"""``nanguard run`` for PyTorch scripts: run the script as ``__main__`` under the global hooks and report.

Exit status: the script's own when nanguard did not stop it (0, the ``sys.exit``
code, 1 for an uncaught exception, 130 / 143 for SIGINT / SIGTERM); ``3`` when nanguard
stopped the run at a non-finite value; ``2`` for a usage error (no such script).

A failure is localized at the failing step, in-process, from the step tape (about one
instrumented step whatever the step number); when the tape cannot replay that step, by
re-running the script up to it (at the end of the run; at once under ``--recover``). See
:mod:`nanguard.pytorch.zerocode`.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, List, Optional

import torch

from ..core.config import GuardConfig
from ..core.experiments import ExperimentConfig
from ..core.exitcodes import EXIT_NONFINITE, EXIT_USAGE
from ..core.outputs import absolute
from ..core.render.html import html_target
from ..core.reportsink import interim_report, open_run_report
from ..core.render.terminal import print_line, render, summary_line
from ..core.script import close_run, run_to_end
from .bundle import default_bundle_path
from .distributed import barrier, is_main
from .recover import RecoveryPolicy
from .replay import CHILD_CONFIG_KEYS, rerun_localize_all
from .rng import capture_rng
from .tensorboard import TensorBoardLogger
from .watch import StopRun, Watcher
from .observer import WatchObserver
from .raised import record_raise
from .zerocode import LocalizeSpec, make_report


def run_torch_script(script: str, args: List[str], *, report_path: Optional[str] = "nanguard_report.json",
               on_nonfinite: str = "stop", recover: Optional[str] = None, localize: bool = True,
               strict: bool = False, quiet: bool = False, bundle: Optional[str] = None,
               tensorboard: Optional[str] = None, html: Optional[str] = "auto", experiments: Any = "auto",
               on_spike: Optional[str] = None) -> int:
    """Run a PyTorch ``script`` as ``__main__`` under the global hooks; write the report however it ends.

    ``html``: the HTML page of a run that had an event, ``"auto"`` beside the JSON report, a path,
    or None for none. ``on_spike``: what an early warning does (:mod:`nanguard.pytorch.spikes`):
    ``"warn"``, ``"skip"`` the step, or ``"rollback"`` (keeps rollback snapshots even without ``recover``);
    None: ``"rollback"`` with ``recover``, else ``"warn"``.

    Under ``torchrun`` every rank runs this; the ranks decide together at every step
    (:mod:`nanguard.pytorch.distributed`) and only rank 0 prints and writes the report.
    """
    if not os.path.isfile(script):
        print(f"nanguard: no such script: {script}", file=sys.stderr)
        return EXIT_USAGE
    script_abs = os.path.abspath(script)
    quiet = quiet or not is_main()
    if bundle == "auto":
        bundle = default_bundle_path(report_path)
    # every output checked (and the report started, "running") before the script runs; absolute paths:
    # a script that changes its working folder does not move them
    page_path, bundle, tensorboard = absolute(html_target(report_path, html)), absolute(bundle), absolute(tensorboard)
    try:
        sink = open_run_report(script=script_abs, report=report_path, html=page_path, bundle=bundle,
                               tensorboard=tensorboard, write=is_main())
    except OSError as e:
        print(f"nanguard: {e}", file=sys.stderr)
        return EXIT_USAGE
    # Recovery decides on exact per-update parameter checks (no rotating slices).
    config = GuardConfig(on_nonfinite=on_nonfinite, strict=strict, param_check_every=1 if recover else None)
    on_spike = on_spike or ("rollback" if recover else "warn")
    policy = None
    if recover:
        policy = RecoveryPolicy.from_spec(recover)
        policy.quiet = policy.quiet or not is_main()
    elif on_spike == "rollback":  # snapshots for the early-warning rollbacks only; failures as on_nonfinite says
        policy = RecoveryPolicy(failures=False)
    cfg = child_config(config)

    def rerun(det, to_bundle):
        return rerun_localize_all(det, script_abs, list(args), rng_file, cfg, bundle=to_bundle)

    recovering = policy is not None and policy.failures
    # NANGUARD_TAPE=0: no step tape (every failure is localized by re-running the script; for comparisons)
    watcher = Watcher(
        config, tape=localize and os.environ.get("NANGUARD_TAPE", "1") != "0", on_spike=on_spike, quiet=quiet,
        # counterfactual replays of a failing step, once the step can be replayed in-process (step tape)
        experiments=ExperimentConfig.from_spec(False if (experiments == "auto" and not localize) else experiments),
        policy=policy,
        localize=LocalizeSpec(rerun=rerun, bundle=bundle, config=cfg, at_once=recovering) if localize else None,
        announce=not quiet and on_nonfinite == "warn" and not recovering,
        # the report on disk follows the run: rewritten at each event
        observer=RunningReport(sink, policy) if sink.active else None)
    localizer = watcher.localizer
    tb = None
    if tensorboard:
        tb = TensorBoardLogger.attach_to(watcher.monitor, tensorboard)
    if not quiet:
        mode = "recover" if policy is not None and policy.failures else on_nonfinite
        spike = f"; on spike: {on_spike}" if on_spike != "warn" else ""
        print_line(f"watching {os.path.basename(script)} (on non-finite: {mode}{spike}; report: {report_path})")

    owner = os.getpid()

    def finish(outcome: Any) -> int:
        """The run's end: at the script's end, or inside its ``os._exit`` (``run_to_end``)."""
        watcher.uninstall()
        if os.getpid() != owner:  # a child the script forked (os.fork) ran on to the script's end: it was
            return outcome.code   # not watched, and writes nothing (the parent reports; nanguard.pytorch.owners)
        # a stop raised in another thread (the thread ended with it; this one may have run on to the end)
        outcome.stopped = outcome.stopped or (watcher.stopping is not None and outcome.signal is None)

        def build() -> Any:
            watcher.finish()
            if isinstance(outcome.error, Exception) and localize:
                record_raise(watcher, outcome.error)  # a NaN born before the raise: the step's failure
            return make_report(watcher, localizer, policy, localize=localize and outcome.signal is None)

        def settled(report: Any) -> None:
            if tb is not None:
                tb.log_report(report)
                tb.close()

        def show(report: Any) -> None:
            _print_outcome(report, report_path)
            if policy is not None:
                policy.print_summary()

        try:  # torch.distributed: rank 0 writes the merged report
            imposed = close_run(build, outcome, sink=sink, report_path=report_path, page_path=page_path,
                                quiet=quiet, strict=strict, show=show, write=is_main(), settled=settled)
            barrier()  # torch.distributed: no rank exits (and gets the others killed) before rank 0 is done
        finally:
            try:
                os.unlink(rng_file)
            except OSError:
                pass
        if imposed is not None:
            return imposed
        return EXIT_NONFINITE if outcome.stopped else outcome.code

    rng_fd, rng_file = tempfile.mkstemp(prefix="nanguard-rng-", suffix=".pt")  # removed by finish()
    os.close(rng_fd)
    torch.save(capture_rng(), rng_file)  # the re-run starts from this exact RNG state
    watcher.install()
    return run_to_end(script, list(args), lambda e: isinstance(e, StopRun), finish, watcher.uninstall)


class RunningReport(WatchObserver):
    """Rewrites the running report whenever an event was recorded: at the event (a failure the run stops
    at, a warn-mode failure) and at the next step's start (recoveries, early warnings)."""

    def __init__(self, sink: Any, policy: Any) -> None:
        self.sink, self.policy = sink, policy

    def event(self, watcher: Any, det: Any) -> None:
        self.current(watcher)

    def step_start(self, watcher: Any, step: int) -> None:
        self.current(watcher)

    def current(self, watcher: Any) -> None:
        events, warnings = (self.policy.events if self.policy is not None else []), watcher.spikes.events
        mon = watcher.monitor
        self.sink.poll(len(watcher.detections) + len(events) + len(warnings), lambda: interim_report(
            detections=watcher.detections, events=events, warnings=warnings, history=mon.history.as_dicts(),
            counting=mon.counting, steps_watched=mon.steps_watched,
            max_grad_norm=mon.history.max_grad_norm if len(mon.history) else None))


def child_config(config: Any) -> dict:
    """The settings the localization re-run needs to see the same detections as this run."""
    return {k: getattr(config, k) for k in CHILD_CONFIG_KEYS}


def _print_outcome(report, report_path) -> None:
    if report.events or report.script_error:
        render(report, report_path)
    print_line(summary_line(report))
