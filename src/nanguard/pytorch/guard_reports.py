"""The report a :class:`~nanguard.pytorch.guard.Guard` keeps: brought up to date from the monitor,
the recovery policy and the early warnings, written as JSON at each failure, as an HTML page when
the run stops or ends, and its events logged to TensorBoard.

:class:`GuardReportWriting` is a mixin of :class:`~nanguard.pytorch.guard.Guard`.
"""
from __future__ import annotations

from ..core.events import Event, Report
from ..core.render.html import write_run_html
from ..core.render.terminal import print_line
from .distributed import is_main, report_extra


class GuardReportWriting:
    """Bring the Guard's report up to date and write it (JSON, HTML, TensorBoard)."""

    def _sync_report(self) -> Report:
        mon = self.monitor
        r = self.report
        r.steps_watched = mon.steps_watched
        r.max_grad_norm = mon.history.max_grad_norm if len(mon.history) else None
        r.scaler_skips = sum(1 for i in r.info if i.get("scaler_skip"))
        r.history = mon.history.as_dicts()
        known = {id(e) for e in r.events}
        if self.policy is not None:
            r.events.extend(e for e in self.policy.events if id(e) not in known)
            r.events.sort(key=lambda e: (e.step, e.recovery is None))
        r.events.extend(e for e in self.spikes.events if id(e) not in known)
        return r

    def _tb_event(self, event: Event) -> None:
        if self.tensorboard is not None:
            self._safe(lambda: self.tensorboard.log_event(event))

    def _write_report(self) -> None:
        self._sync_report()
        if self.report_path and is_main():  # distributed: rank 0 writes the merged report
            report_extra(self.report)
            self._safe(lambda: self.report.write(self.report_path))

    def _write_html(self) -> None:
        if is_main():  # the page renders in seconds (plots): once, when the run stops or ends
            page = write_run_html(self.report, self.report_path, self.html)
            if page and not self.quiet:
                print_line(f"HTML report: {page}")
