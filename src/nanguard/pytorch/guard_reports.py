"""The report a :class:`~nanguard.pytorch.guard.Guard` keeps: brought up to date from the monitor,
the recovery policy and the early warnings, written as JSON at each failure, as an HTML page when
the run stops or ends, and its events logged to TensorBoard.

:class:`GuardReportWriting` is a mixin of :class:`~nanguard.pytorch.guard.Guard`.
"""
from __future__ import annotations

from ..core.engine import RunFacts, assemble_report
from ..core.events import Event, Report
from ..core.guarded import disabled_note
from ..core.render.html import write_run_html
from ..core.render.terminal import print_line
from .distributed import is_main, report_extra


class GuardReportWriting:
    """Bring the Guard's report up to date and write it (JSON, HTML, TensorBoard)."""

    def _sync_report(self) -> Report:
        mon = self.monitor
        events = [e for e in self.report.events if not e.is_warning]
        events += list(self.policy.events) if self.policy is not None else []
        return assemble_report(RunFacts(
            counting="optimizer", steps_watched=mon.steps_watched,
            max_grad_norm=mon.history.max_grad_norm if len(mon.history) else None,
            history=mon.history.as_dicts(), info=list(self.report.info), events=events,
            warnings=list(self.spikes.events), disabled=disabled_note(self)), self.report)

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
