"""``nanguard run``: run a training script as ``__main__`` under the global hooks and report.

Exit status: the script's own when nanguard did not stop it (0, the ``sys.exit``
code, 1 for an uncaught exception, 130 for Ctrl-C); ``3`` when nanguard stopped
the run at a non-finite value; ``2`` for a usage error (no such script).
"""
from __future__ import annotations

import os
import runpy
import sys
import tempfile
import traceback
from typing import Any, List, Optional

from ..core.exitcodes import EXIT_NONFINITE, EXIT_USAGE


def run_script(script: str, args: List[str], *, report_path: Optional[str] = "nanguard_report.json",
               on_nonfinite: str = "stop", recover: Optional[str] = None, localize: bool = True,
               strict: bool = False, quiet: bool = False, bundle: Optional[str] = None,
               tensorboard: Optional[str] = None) -> int:
    """Run ``script`` as ``__main__`` under the global hooks; write the report however it ends.

    Under ``torchrun`` every rank runs this; the ranks decide together at every step
    (:mod:`nanguard.pytorch.distributed`) and only rank 0 prints and writes the report.
    A TensorFlow/Keras script goes to the TensorFlow runner (:func:`script_backend`).
    """
    if script_backend(script) == "tensorflow":
        from ..tensorflow.run import run_tf_script
        return run_tf_script(script, args, report_path=report_path, on_nonfinite=on_nonfinite,
                             recover=recover, localize=localize, strict=strict, quiet=quiet,
                             bundle=bundle, tensorboard=tensorboard)
    import torch

    from ..core.config import GuardConfig
    from ..core.render.terminal import print_line
    from ..pytorch.watch import StopRun, Watcher
    from ..pytorch.rng import capture_rng

    if not os.path.isfile(script):
        print(f"nanguard: no such script: {script}", file=sys.stderr)
        return EXIT_USAGE
    script_abs = os.path.abspath(script)
    from ..pytorch.distributed import barrier, is_main
    from ..pytorch.replay import rerun_localize_all
    quiet = quiet or not is_main()
    if bundle == "auto":
        from ..pytorch.bundle import default_bundle_path
        bundle = default_bundle_path(report_path)
    rng_fd, rng_file = tempfile.mkstemp(prefix="nanguard-rng-", suffix=".pt")
    os.close(rng_fd)
    torch.save(capture_rng(), rng_file)  # the re-run starts from this exact RNG state

    # Recovery decides on exact per-update parameter checks (no rotating slices).
    config = GuardConfig(on_nonfinite=on_nonfinite, strict=strict, param_check_every=1 if recover else None)
    policy = None
    if recover:
        from ..pytorch.recover import RecoveryPolicy
        policy = RecoveryPolicy.from_spec(recover)
        policy.quiet = policy.quiet or not is_main()
    watcher = Watcher(config)
    if policy is not None:
        policy.attach(watcher)
        cfg = child_config(config)
        if localize:
            watcher.localizer = lambda det: rerun_localize_all(det, script_abs, list(args), rng_file, cfg,
                                                               bundle=bundle)
    tb = None
    if tensorboard:
        from ..pytorch.tensorboard import TensorBoardLogger
        tb = TensorBoardLogger.attach_to(watcher.monitor, tensorboard)
    if not quiet:
        mode = "recover" if policy else on_nonfinite
        print_line(f"watching {os.path.basename(script)} (on non-finite: {mode}; report: {report_path})")

    old_argv, old_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(script_abs))
    code: int = 0
    stopped = False
    watcher.install()
    try:
        runpy.run_path(script_abs, run_name="__main__")
    except StopRun:
        stopped = True
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        print("nanguard: interrupted (Ctrl-C); writing the report", file=sys.stderr)
        code = 130
    except BaseException:
        _print_user_traceback(script_abs)
        code = 1
    finally:
        watcher.uninstall()
        sys.argv = old_argv
        try:
            sys.path.remove(os.path.dirname(script_abs))
        except ValueError:
            pass
    try:
        watcher.finish()
        report = _make_report(watcher, script_abs, args, rng_file, localize, config, policy, bundle)
        if tb is not None:
            tb.log_report(report)
            tb.close()
        if report_path and is_main():  # torch.distributed: rank 0 writes the merged report
            report.write(report_path)
        if not quiet:
            _print_outcome(report, report_path)
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


def script_backend(script: str) -> str:
    """``"tensorflow"`` for a script that imports tensorflow/keras and not torch (read from its
    import statements, without importing anything), or when torch is not installed; else ``"torch"``.
    The TensorFlow runner imports TensorFlow only when the script does (an import hook)."""
    import ast
    import importlib.util
    names = set()
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=script)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.partition(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.partition(".")[0])
    except (OSError, SyntaxError, ValueError):
        pass
    tf = bool(names & {"tensorflow", "keras", "tf_keras"})
    if tf and "torch" not in names:
        return "tensorflow"
    if importlib.util.find_spec("torch") is None and importlib.util.find_spec("tensorflow") is not None:
        return "tensorflow"
    return "torch"


def child_config(config: Any) -> dict:
    """The settings the localization re-run needs to see the same detections as this run."""
    return {"min_loss_scale": config.min_loss_scale, "max_consecutive_skips": config.max_consecutive_skips,
            "param_check_every": config.param_check_every}


def _make_report(watcher, script_abs, args, rng_file, localize, config, policy, bundle=None):
    from ..pytorch.distributed import report_extra, share_event
    from ..pytorch.replay import rerun_localize_all
    from ..core.pipeline import build_event
    from ..core.events import Report

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
    report.events = events
    if watcher.dropped_events:
        report.extra["dropped_events"] = watcher.dropped_events
    report_extra(report)
    if watcher.disabled:  # a clean status would otherwise hide that nothing was checked after this
        report.extra["guard_disabled"] = watcher.error or True
    return report


def _context(watcher) -> dict:
    mon = watcher.monitor
    ctx: dict = {"scaler": bool(watcher.scalers), "counting": mon.counting}
    for v in mon.views.values():
        opt = v.opt_ref()
        if opt is None:
            continue
        ctx.setdefault("optimizer", type(opt).__name__)
        g = opt.param_groups[0]
        ctx.setdefault("lr", [gg.get("lr") for gg in opt.param_groups if not hasattr(gg.get("lr"), "shape")])
        if "eps" in g:
            ctx.setdefault("eps", g["eps"])
        ps = v.all_params()
        if ps:
            ctx.setdefault("dtype", str(ps[0].dtype).replace("torch.", ""))
    return ctx


def _print_outcome(report, report_path) -> None:
    from ..core.render.terminal import print_line, render, summary_line
    if report.status == "clean":
        print_line(summary_line(report))
        return
    render(report, report_path)
    print_line(summary_line(report))


def _exit_code(c) -> int:
    if c is None:
        return 0
    if isinstance(c, int):
        return c
    print(c, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def _print_user_traceback(script_abs: str) -> None:
    """Show the script's own traceback, as ``python SCRIPT`` would (without nanguard's frames)."""
    etype, value, tb = sys.exc_info()
    # Drop leading frames until the first one in the user's script.
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script_abs:
        tb = tb.tb_next
    traceback.print_exception(etype, value, tb)


