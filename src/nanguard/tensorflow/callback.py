"""The Keras callback behind :class:`nanguard.keras.NanGuard`."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import keras

from ..core.config import GuardConfig
from ..core.events import Report


def _record_construction_lines() -> None:
    """From this import on, remember the user line that constructs each Keras layer and loss (one frame walk
    per construction, nothing per step; never uninstalled): the callback is installed when ``fit`` starts,
    after the model was built, and an origin inside a built-in layer is named by that line, as under
    ``nanguard run``. A model built before ``nanguard.keras`` was imported falls back on
    :mod:`.locate.naming`'s source scan, or says the line is not known."""
    try:
        from .locate.naming import install_construction_hook
        install_construction_hook()
    except Exception as e:  # best effort: the origin's line then comes from the fallback
        warnings.warn(f"nanguard: could not record layer construction lines: {type(e).__name__}: {e}", RuntimeWarning)


_record_construction_lines()


class NanGuard(keras.callbacks.Callback):
    """Guard ``model.fit`` against NaN/Inf: ``model.fit(..., callbacks=[nanguard.keras.NanGuard()])``.

    Every step, in-graph (fit's train step is a ``tf.function``): the loss, the batch, the gradients
    and, after the update, the variables and the optimizer state are checked, with one host read
    per step. A step that fails the check has its update skipped in-graph (it never reaches the
    variables); then training stops (``on_nonfinite="stop"``: ``model.stop_training``) or goes on
    (``"warn"``: the update is applied, as without the guard). A LossScaleOptimizer's own skips are
    counted as steps and reported as information unless the loss scale collapses.

    Args:
        on_nonfinite: ``"stop"`` (default) or ``"warn"``.
        report: path of the JSON report (``nanguard.report/1``), written when fit ends; None: none.
        recover: None, ``"auto"`` or a list of recovery actions (see :mod:`nanguard.tensorflow.recover`).
        localize: replay the failing step under the op-level recorder, when it is available.
        quiet: print nothing (the report is still built: ``callback.report``).
        strict: internal guard errors raise instead of warning and disabling the guard.
        history_size: steps kept in the step history.
        on_spike: what an early warning (the loss or gradient norm spiking or growing geometrically while
            every value is still finite; :mod:`nanguard.tensorflow.spikes`) does: ``"warn"`` (a warning
            event in the report and one line), ``"skip"`` the step's update, or ``"rollback"`` to before
            the excursion with a lower learning rate. None: ``"rollback"`` with ``recover``, else ``"warn"``.

    After ``fit``: ``callback.report`` (:class:`nanguard.Report`), ``callback.stopped`` (bool).
    Under ``nanguard run`` (whose hooks already watch the script) the callback defers to it.
    """

    def __init__(self, on_nonfinite: str = "stop", report: Optional[str] = "nanguard_report.json",
                 recover: Any = None, localize: bool = True, quiet: bool = False, strict: bool = False,
                 history_size: int = 200, on_spike: Optional[str] = None) -> None:
        super().__init__()
        from ..core.alerts import check_on_spike
        self.on_spike = check_on_spike(on_spike) if on_spike is not None else None
        self.config = GuardConfig(on_nonfinite=on_nonfinite, strict=strict, history_size=history_size)
        self.report_path = report
        self.recover = recover
        self.localize = localize
        self.quiet = quiet
        self.report: Optional[Report] = None
        self.stopped = False
        self._driver = None
        self._run = None  # the run this callback's fits share (kept after each fit's end)
        self._external = None

    def on_train_begin(self, logs=None) -> None:
        from . import watch as W
        from .driver import RunDriver
        self.report, self.stopped = None, False
        from .run import keras_elsewhere
        other = keras_elsewhere()
        if other:  # the hooks are TensorFlow's: an unguarded fit is said, never reported clean
            from .driver import empty_report
            why = (f"Keras runs on its {other} backend (KERAS_BACKEND={other}): NanGuard watches Keras on TensorFlow "
                   "only, so this fit is not guarded")
            warnings.warn(f"nanguard: {why}", RuntimeWarning)
            self.report = empty_report(why)
            if self.report_path:
                self.report.write(self.report_path)
            return
        ext = W.active()
        if ext is not None:  # nanguard run / nanguard.keras.watch() already watches everything
            self._external = ext
            return
        drv = self._run
        if drv is None or drv.stopped:
            drv = RunDriver(self.config, recover=self.recover, localize=self.localize, quiet=self.quiet,
                            raise_on_stop=False, on_spike=self.on_spike)
        # the same callback in a later fit (a fine-tune after training the head) goes on with the same
        # run: steps count across the fit calls and the report covers them all, as under nanguard run
        self._run = drv
        drv.install()
        self._driver = drv
        # a stop ends fit's loop from the host read of the failing step itself: the callback has no
        # per-batch hook (no Python call per batch; Keras' batch-end dispatch is left as it is: off the
        # training thread on the backends that allow it)
        drv.watcher.on_stop = self._stop_fit
        drv.watcher._fit_begin()  # the report's fit position (call, epoch); epochs are marked below
        try:
            drv.watcher._watch_fit(self.model)  # re-make the train function: traced with the check
        except Exception as e:
            drv.uninstall()
            self._driver = None
            if self.config.strict:
                raise
            warnings.warn(f"nanguard: could not guard this fit: {type(e).__name__}: {e}", RuntimeWarning)
        if not self.quiet:
            from ..core.render.terminal import print_line
            mode = "recover" if self.recover else self.config.on_nonfinite
            spike = f"; on spike: {drv.on_spike}" if drv.on_spike != "warn" else ""
            print_line(f"guarding {type(self.model).__name__}.fit (on non-finite: {mode}{spike})")

    def on_epoch_begin(self, epoch, logs=None) -> None:
        if self._driver is not None and self._driver.watcher.fit_now is not None:
            self._driver.watcher.fit_now.update(epoch=int(epoch), epoch_start=self._driver.watcher.steps_watched)

    def _stop_fit(self) -> None:
        self.model.stop_training = True
        self.stopped = True

    def on_train_end(self, logs=None) -> None:
        drv, self._driver, self._external = self._driver, None, None
        if drv is None:
            return
        drv.uninstall()
        try:
            from .watch import fit_ended
            fit_ended(drv.watcher, logs)  # what the fit logged last (the report's status must not contradict it)
            self.report = drv.make_report()
            if self.report_path:
                self.report.write(self.report_path)
            if not self.quiet:
                from .driver import print_outcome
                print_outcome(self.report, self.report_path, drv)
        except Exception as e:
            if self.config.strict:
                raise
            warnings.warn(f"nanguard: could not build the report: {type(e).__name__}: {e}", RuntimeWarning)
        self.stopped = self.stopped or drv.stopped
