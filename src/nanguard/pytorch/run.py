"""``nanguard run`` for PyTorch scripts: run the script as ``__main__`` under the global hooks and report.

Exit status: the script's own when nanguard did not stop it (0, the ``sys.exit``
code, 1 for an uncaught exception, 130 for Ctrl-C); ``3`` when nanguard stopped
the run at a non-finite value; ``2`` for a usage error (no such script).
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, List, Optional

import torch

from ..core.config import GuardConfig
from ..core.events import Report
from ..core.exitcodes import EXIT_NONFINITE, EXIT_USAGE
from ..core.pipeline import build_event
from ..core.render.html import write_run_html
from ..core.render.terminal import print_line, render, summary_line
from ..core.script import run_as_main
from .bundle import default_bundle_path
from .distributed import barrier, is_main, report_extra, share_event
from .recover import RecoveryPolicy
from .replay import CHILD_CONFIG_KEYS, rerun_localize_all
from .rng import capture_rng
from .spikes import SpikeResponder, optimizer_context
from .tensorboard import TensorBoardLogger
from .watch import StopRun, Watcher


def run_torch_script(script: str, args: List[str], *, report_path: Optional[str] = "nanguard_report.json",
               on_nonfinite: str = "stop", recover: Optional[str] = None, localize: bool = True,
               strict: bool = False, quiet: bool = False, bundle: Optional[str] = None,
               tensorboard: Optional[str] = None, html: Optional[str] = "auto",
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
    rng_fd, rng_file = tempfile.mkstemp(prefix="nanguard-rng-", suffix=".pt")
    os.close(rng_fd)
    torch.save(capture_rng(), rng_file)  # the re-run starts from this exact RNG state

    # Recovery decides on exact per-update parameter checks (no rotating slices).
    config = GuardConfig(on_nonfinite=on_nonfinite, strict=strict, param_check_every=1 if recover else None)
    on_spike = on_spike or ("rollback" if recover else "warn")
    policy = None
    if recover:
        policy = RecoveryPolicy.from_spec(recover)
        policy.quiet = policy.quiet or not is_main()
    elif on_spike == "rollback":  # snapshots for the early-warning rollbacks only; failures as on_nonfinite says
        policy = RecoveryPolicy(failures=False)
    watcher = Watcher(config)
    watcher.spikes = SpikeResponder(watcher.monitor, on_spike, quiet=quiet)
    if policy is not None:
        policy.attach(watcher)
        cfg = child_config(config)
        if localize and policy.failures:
            watcher.localizer = lambda det: rerun_localize_all(det, script_abs, list(args), rng_file, cfg,
                                                               bundle=bundle)
    tb = None
    if tensorboard:
        tb = TensorBoardLogger.attach_to(watcher.monitor, tensorboard)
    if not quiet:
        mode = "recover" if policy is not None and policy.failures else on_nonfinite
        spike = f"; on spike: {on_spike}" if on_spike != "warn" else ""
        print_line(f"watching {os.path.basename(script)} (on non-finite: {mode}{spike}; report: {report_path})")

    watcher.install()
    try:
        outcome = run_as_main(script, list(args), lambda e: isinstance(e, StopRun))
    finally:
        watcher.uninstall()
    code, stopped = outcome.code, outcome.stopped
    try:
        watcher.finish()
        report = _make_report(watcher, script_abs, args, rng_file, localize, config, policy, bundle)
        if tb is not None:
            tb.log_report(report)
            tb.close()
        page = None
        if report_path and is_main():  # torch.distributed: rank 0 writes the merged report
            report.write(report_path)
        if is_main():
            page = write_run_html(report, report_path, html)
        if not quiet:
            _print_outcome(report, report_path)
            if page:
                print_line(f"HTML report: {page}")
            if policy is not None:
                policy.print_summary()
        barrier()  # torch.distributed: no rank exits (and gets the others killed) before rank 0 is done
    except Exception as e:
        if strict:
            raise
        print(f"nanguard: could not build the report: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        try:
            os.unlink(rng_file)
        except OSError:
            pass
    if stopped:
        return EXIT_NONFINITE
    return code


def child_config(config: Any) -> dict:
    """The settings the localization re-run needs to see the same detections as this run."""
    return {k: getattr(config, k) for k in CHILD_CONFIG_KEYS}


def _make_report(watcher, script_abs, args, rng_file, localize, config, policy, bundle=None):
    mon = watcher.monitor
    report = Report(counting=mon.counting, steps_watched=mon.steps_watched,
                    max_grad_norm=mon.history.max_grad_norm if len(mon.history) else None,
                    scaler_skips=sum(1 for d in watcher.info if d.detected.get("scaler_skip")),
                    history=mon.history.as_dicts())
    report.info = [{"step": d.step, "phase": d.phase, **d.detected} for d in watcher.info][:200]
    history = mon.history.raw_dicts()
    events = list(policy.events) if policy is not None else []
    failures = [d for d in watcher.detections]
    # torch.distributed: eval events are per rank; the first training failure is the same on every rank
    first_train = next((d for d in failures if d.phase != "eval"), None)
    for i, det in enumerate(failures):
        if det.event is not None:  # already diagnosed during the run (recovery mode)
            events.append(det.event)
            continue
        loc_run = None
        if (i == 0 or (det is first_train and det.rank is not None)) and localize and det.phase != "eval":
            cfg = child_config(config)
            loc_run = rerun_localize_all(det, script_abs, list(args), rng_file, cfg, bundle=bundle)
        hist = [h for h in history if h["step"] < det.step]
        events.append(share_event(build_event(det, loc_run, hist, _context(watcher)), det.rank))
    events.sort(key=lambda e: (e.step, e.recovery is not None))
    report.events = events + list(watcher.spikes.events if watcher.spikes is not None else [])
    if watcher.dropped_events:
        report.extra["dropped_events"] = watcher.dropped_events
    report_extra(report)
    if watcher.disabled:  # a clean status would otherwise hide that nothing was checked after this
        report.extra["guard_disabled"] = watcher.error or True
    return report


def _context(watcher) -> dict:
    mon = watcher.monitor
    ctx: dict = {"scaler": bool(watcher.scalers), "counting": mon.counting}
    ctx.update(optimizer_context(watcher.optimizers()))  # name, lr, eps, betas, momentum
    for v in mon.views.values():
        ps = v.all_params()
        if ps:
            ctx.setdefault("dtype", str(ps[0].dtype).replace("torch.", ""))
    return ctx


def _print_outcome(report, report_path) -> None:
    if report.status == "clean":
        print_line(summary_line(report))
        return
    render(report, report_path)
    print_line(summary_line(report))
