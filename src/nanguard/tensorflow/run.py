"""``nanguard run`` for TensorFlow/Keras scripts: run the script as ``__main__`` under the TF hooks.

Same contract as :mod:`nanguard.pytorch.run` (the PyTorch runner): exit status 0 / the script's own
status when nanguard did not stop it (its ``sys.exit`` code, 1 for an uncaught exception, 130 for
Ctrl-C), ``3`` when nanguard stopped the run at a non-finite value, ``2`` for a usage error; the
report is written however the script ends.

TensorFlow is imported only when the script imports it: the hooks are installed by an import hook
the moment ``tensorflow`` or ``keras`` is first imported (before the script's next line runs), or
right away when it already is.
"""
from __future__ import annotations

import importlib.abc
import os
import sys
import time
from typing import Any, List, Optional

from ..core.config import GuardConfig
from ..core.exitcodes import EXIT_NONFINITE, EXIT_USAGE
from ..core.outputs import absolute
from ..core.render.html import html_target
from ..core.reportsink import interim_report, open_run_report
from ..core.render.terminal import print_line
from ..core.script import close_run, run_to_end
from .observer import TFObserver

_TF_MODULES = ("tensorflow", "keras")


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Calls ``install()`` once, right after the outermost import of tensorflow or keras completes
    (``import keras`` imports tensorflow inside it: the hooks go in when keras is done)."""

    def __init__(self, install) -> None:
        self.install = install
        self.done = False
        self.depth = 0
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        if self.done or self._busy or name not in _TF_MODULES:
            return None
        self._busy = True
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ChainedLoader(spec.loader, self)
        return spec


class _ChainedLoader(importlib.abc.Loader):
    def __init__(self, loader, finder: _InstallOnImport) -> None:
        self.loader = loader
        self.finder = finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader  # the module keeps its own loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        f = self.finder
        f.depth += 1
        try:
            self.loader.exec_module(module)
        finally:
            f.depth -= 1
        if f.depth == 0 and not f.done:
            f.done = True
            f.install()


def run_tf_script(script: str, args: List[str], *, report_path: Optional[str] = "nanguard_report.json",
                  on_nonfinite: str = "stop", recover: Optional[str] = None, localize: bool = True,
                  strict: bool = False, quiet: bool = False, bundle: Optional[str] = None,
                  tensorboard: Optional[str] = None, html: Optional[str] = "auto", on_spike: Optional[str] = None,
                  experiments: Any = "auto") -> int:
    """Run a TensorFlow/Keras ``script`` as ``__main__`` under the guard; write the report however it ends.
    ``on_spike``: what an early warning does (:mod:`nanguard.tensorflow.spikes`): ``"warn"``, ``"skip"``
    or ``"rollback"``; None: ``"rollback"`` with ``recover``, else ``"warn"``. ``experiments``: the
    counterfactual replays of a failing step (:mod:`nanguard.tensorflow.experiments`)."""
    if not os.path.isfile(script):
        print(f"nanguard: no such script: {script}", file=sys.stderr)
        return EXIT_USAGE
    script_abs = os.path.abspath(script)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    page_path = absolute(html_target(report_path, html))  # checked, and the report started, before the script runs
    try:
        sink = open_run_report(script=script_abs, report=report_path, html=page_path,
                               extra={"framework": "tensorflow"})
    except OSError as e:
        print(f"nanguard: {e}", file=sys.stderr)
        return EXIT_USAGE
    config = GuardConfig(on_nonfinite=on_nonfinite, strict=strict)
    on_spike = on_spike or ("rollback" if recover else "warn")
    state: dict = {"watcher": None, "policy": None, "driver": None, "unwatched": None}

    def install() -> None:
        other = keras_elsewhere()
        if other:  # nanguard's Keras hooks are TensorFlow's: say so, never call the run clean
            state["unwatched"] = (f"Keras ran on its {other} backend (KERAS_BACKEND={other}): nanguard watches Keras "
                                  "on TensorFlow only, so no step of this run was checked; run it with "
                                  "KERAS_BACKEND=tensorflow")
            if not quiet:
                print_line(f"not watching: {state['unwatched']}")
            return
        from .driver import RunDriver
        drv = RunDriver(config, script_abs, list(args), recover=recover, localize=localize, quiet=quiet,
                        on_spike=on_spike, observers=[_RunningReport(sink)] if sink.active else [],
                        experiments=experiments)
        state["driver"] = drv
        drv.install()

    if not quiet:
        mode = "recover" if recover else on_nonfinite
        spike = f"; on spike: {on_spike}" if on_spike != "warn" else ""
        print_line(f"watching {os.path.basename(script)} (on non-finite: {mode}{spike}; report: {report_path})")
    hook = _InstallOnImport(install)
    if any(m in sys.modules for m in _TF_MODULES):
        hook.done = True
        install()
    else:
        sys.meta_path.insert(0, hook)

    t0 = time.time()
    owner = os.getpid()

    def uninstall() -> None:
        try:
            sys.meta_path.remove(hook)
        except ValueError:
            pass
        drv = state["driver"]
        if drv is not None:
            drv.uninstall()

    def finish(outcome: Any) -> int:
        """The run's end: at the script's end, or inside its ``os._exit`` (``run_to_end``)."""
        uninstall()
        if os.getpid() != owner:  # a child the script forked (os.fork) ran on to the script's end: the
            return outcome.code   # parent reports, not the child
        drv = state["driver"]

        def build() -> Any:
            if drv is None:
                from .driver import empty_report
                return empty_report(state["unwatched"])
            report = drv.make_report(run_seconds=time.time() - t0)
            outcome.stopped = outcome.stopped or drv.stopped
            return report

        def show(report: Any) -> None:
            from .driver import print_outcome
            print_outcome(report, report_path, drv)

        code = close_run(build, outcome, sink=sink, report_path=report_path, page_path=page_path, quiet=quiet,
                         strict=strict, show=show)
        if code is not None:
            return code
        if outcome.stopped or (drv is not None and drv.stopped):
            return EXIT_NONFINITE
        return outcome.code

    return run_to_end(script, list(args), _is_stop, finish, uninstall)


class _RunningReport(TFObserver):
    """The report on disk follows the run: rewritten after a step that recorded an event."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def step_end(self, w: Any, step: int) -> None:
        events = w.policy.events if w.policy is not None else []
        warnings = list(w.warning_events)
        self.sink.poll(len(w.detections) + len(events) + len(warnings), lambda: interim_report(
            detections=w.detections, events=events, warnings=warnings, history=w.history.as_dicts(),
            steps_watched=w.steps_watched, max_grad_norm=w.history.max_grad_norm if len(w.history) else None,
            extra={"framework": "tensorflow"}))


def keras_elsewhere() -> Optional[str]:
    """Keras' backend when it is imported and not TensorFlow (``KERAS_BACKEND=jax`` or ``torch``), else None."""
    k = sys.modules.get("keras")
    try:
        name = str(k.backend.backend()) if k is not None else None
    except Exception:  # an old tf.keras, or a Keras without backends
        return None
    return name if name and name != "tensorflow" else None


def _is_stop(e: BaseException) -> bool:
    """Our StopRun, also when TensorFlow wrapped it (an exception raised inside a graph call)."""
    if "nanguard.tensorflow.watch" not in sys.modules:  # TF never imported: it cannot be ours
        return False
    from .watch import StopRun
    return isinstance(e, StopRun)
