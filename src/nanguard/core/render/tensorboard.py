"""TensorBoard: nanguard's step history and events as TensorBoard scalars and text.

Framework-neutral: the logger writes to any object with ``add_scalar``/``add_text``
(``torch.utils.tensorboard.SummaryWriter``, or an adapter); a backend turns a log
directory into a writer (:mod:`nanguard.pytorch.tensorboard`).

>>> guard = nanguard.Guard(model, opt, tensorboard="runs/exp1")          # doctest: +SKIP
>>> # or, zero-code:  nanguard run --tensorboard runs/exp1 train.py
>>> # or, on any StepMonitor (the Lightning / HF callbacks take tensorboard= too):
>>> TensorBoardLogger.attach_to(monitor, SummaryWriter("runs/exp1"))   # doctest: +SKIP

One point per optimizer step (``global_step`` = nanguard's 0-based step):

==============================  ===============================================
tag                             value
==============================  ===============================================
``nanguard/loss``               the step's loss (mean over micro-batches; over ranks under DDP)
``nanguard/grad_norm``          global gradient L2 norm (before clipping)
``nanguard/grad_norm/group{i}`` per param-group gradient norm
``nanguard/param_norm``         parameter L2 norm
``nanguard/update_ratio``       estimated update-to-weight ratio lr*|g|/|w|
``nanguard/lr/group{i}``        learning rate per param group
``nanguard/loss_scale``         GradScaler scale (when a scaler is used)
``nanguard/skipped``            1 when the update was skipped (scaler or recovery), else 0
``nanguard/nonfinite``          1 at the step of each non-finite event
``nanguard/events`` (text)      one line per event: step, phase, cause, origin, recovery
==============================  ===============================================

Non-finite values are written as they are (TensorBoard shows NaN/Inf points).
Under torch.distributed only rank 0 writes unless ``all_ranks=True``. The
logger costs a few Python calls per step and no device sync (it reads the
numbers the step's one sync already produced).
"""
from __future__ import annotations

from typing import Any, Optional

from ..events import one_line

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger:
    """Write a StepMonitor's history records and report events to a ``SummaryWriter``.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (kept open: you own it) or a
            log directory (a writer is created, and closed by :meth:`close`).
        prefix: tag prefix (default ``"nanguard"``).
        all_ranks: under torch.distributed, also write from ranks other than 0
            (give each rank its own directory then).
    """

    def __init__(self, writer: Any, prefix: str = "nanguard", all_ranks: bool = False) -> None:
        self.prefix = prefix.rstrip("/")
        self.enabled = all_ranks or self._is_main()
        self._owned = False
        self.writer = None
        self.n_events = 0
        if not self.enabled:
            return
        if isinstance(writer, (str, bytes)) or hasattr(writer, "__fspath__"):
            self.writer = self._open(str(writer))
            self._owned = True
        else:
            if not hasattr(writer, "add_scalar"):
                raise TypeError(f"tensorboard must be a log directory or a SummaryWriter, got {type(writer).__name__}")
            self.writer = writer

    # A backend supplies these two: how to open a log directory, and whether this process writes.
    def _open(self, log_dir: str) -> Any:
        raise TypeError("pass a writer with add_scalar/add_text (this logger has no default writer)")

    @staticmethod
    def _is_main() -> bool:
        return True

    # ------------------------------------------------------------------ wiring
    @classmethod
    def attach_to(cls, monitor: Any, writer: Any, **kw: Any) -> "TensorBoardLogger":
        """Create a logger (unless ``writer`` already is one) and log every step ``monitor`` records."""
        logger = writer if isinstance(writer, cls) else cls(writer, **kw)
        logger.attach(monitor)
        return logger

    def attach(self, monitor: Any) -> "TensorBoardLogger":
        """Log each :class:`~nanguard.core.history.StepRecord` as ``monitor`` appends it to its history."""
        hist = monitor.history
        if getattr(hist, "_nanguard_tb", None) is self:
            return self
        orig = hist.append

        def append(rec, _orig=orig):
            _orig(rec)
            try:
                self.log_record(rec)
            except Exception:  # logging must never break the training step
                pass

        hist.append = append
        hist._nanguard_tb = self
        return self

    # ------------------------------------------------------------------ writing
    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if value is None:
            return
        try:
            v = float(value)
        except (TypeError, ValueError):
            return
        self.writer.add_scalar(f"{self.prefix}/{tag}", v, global_step=step)

    def log_record(self, rec: Any) -> None:
        """One step's numbers (a StepRecord or its dict)."""
        if self.writer is None:
            return
        d = rec if isinstance(rec, dict) else rec.__dict__
        step = int(d.get("step") or 0)
        self._scalar("loss", d.get("loss"), step)
        self._scalar("grad_norm", d.get("grad_norm"), step)
        groups = d.get("group_grad_norms") or []
        if len(groups) > 1:
            for i, g in enumerate(groups):
                self._scalar(f"grad_norm/group{i}", g, step)
        self._scalar("param_norm", d.get("param_norm"), step)
        self._scalar("update_ratio", d.get("update_ratio"), step)
        for i, lr in enumerate(d.get("lr") or []):
            self._scalar(f"lr/group{i}", lr, step)
        self._scalar("loss_scale", d.get("loss_scale"), step)
        self._scalar("skipped", 1.0 if d.get("skipped") else 0.0, step)

    def log_event(self, event: Any) -> None:
        """A report event: ``nonfinite`` = 1 at its step, and one line of text."""
        if self.writer is None:
            return
        ev = event if not isinstance(event, dict) else None
        step = int(getattr(event, "step", None) if ev is not None else event.get("step") or 0)
        self.writer.add_scalar(f"{self.prefix}/nonfinite", 1.0, global_step=step)
        line = one_line(ev) if ev is not None else str(event)
        rec = getattr(ev, "recovery", None) if ev is not None else event.get("recovery")
        if rec:
            line += f" Recovered: {rec.get('action')}."
        rank = getattr(ev, "rank", None) if ev is not None else event.get("rank")
        if rank is not None:
            line = f"[rank {rank}] " + line
        self.writer.add_text(f"{self.prefix}/events", line, global_step=step)
        self.n_events += 1
        self.writer.flush()

    def log_report(self, report: Any) -> None:
        """Every event of a finished report (``nanguard run`` does this at the end)."""
        for ev in getattr(report, "events", []) or []:
            self.log_event(ev)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this logger created it."""
        if self.writer is None:
            return
        self.writer.flush()
        if self._owned:
            self.writer.close()
