"""nanguard for Keras 3 on the TensorFlow backend (importing this module imports TensorFlow).

* :class:`NanGuard`: a callback for ``model.fit``, added in one line::

      model.fit(x, y, callbacks=[nanguard.keras.NanGuard()])

* :func:`watch`: a context manager that watches every ``GradientTape`` / ``optimizer.apply_gradients``
  training step inside it (eager or ``@tf.function``), and every ``fit``, with no other change::

      with nanguard.keras.watch(on_nonfinite="stop"):
          for x, y in ds:
              train_step(x, y)

* ``nanguard run train.py`` does the same for a whole script, with no code change.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .tensorflow.callback import NanGuard

__all__ = ["NanGuard", "watch"]


@contextlib.contextmanager
def watch(report: Optional[str] = "nanguard_report.json", on_nonfinite: str = "warn", *,
          strict: bool = False, quiet: bool = False, on_spike: str = "warn") -> Iterator["object"]:
    """Watch every Keras optimizer update inside the block (the hooks of ``nanguard run``).

    ``on_nonfinite="stop"``: the failing update is skipped in-graph and the block ends with
    :class:`nanguard.NonFiniteError` (``err.report``); ``"warn"`` (default) reports and carries on.
    No replay runs here (the step is your inline code): events carry the step, phase and what the
    check saw. ``on_spike``: what an early warning does (``"warn"``, ``"skip"``; ``"rollback"`` keeps
    recovery snapshots). Yields the watcher (``.history``, ``.detections``); ``.report`` is set at the end.
    """
    from .core.config import GuardConfig
    from .core.events import NonFiniteError
    from .tensorflow.driver import RunDriver, print_outcome
    from .tensorflow.watch import StopRun

    drv = RunDriver(GuardConfig(on_nonfinite=on_nonfinite, strict=strict), localize=False, quiet=quiet,
                    on_spike=on_spike)
    drv.install()
    w = drv.watcher
    stopped = False
    try:
        yield w
    except StopRun:
        stopped = True
    finally:
        drv.uninstall()
        rep = drv.make_report()
        w.report = rep
        if report:
            rep.write(report)
        if not quiet:
            print_outcome(rep, report, drv)
    if stopped:
        ev = next((e for e in rep.events if e.recovery is None), rep.first)
        raise NonFiniteError(rep, ev)
