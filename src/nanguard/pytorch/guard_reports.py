"""The report a :class:`~nanguard.pytorch.guard.Guard` keeps: brought up to date from the monitor,
the recovery policy and the early warnings, written as JSON at each failure, as an HTML page when
the run stops or ends, and its events logged to TensorBoard.

:class:`ReportWriter` is a part the Guard holds (``guard.reports``), built with what it reads.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ..core.engine import RunFacts, assemble_report
from ..core.events import Event, Report
from ..core.render.terminal import print_line
from .distributed import is_main, report_extra


class ReportWriter:
    """Bring the Guard's report up to date and write it (JSON, HTML, TensorBoard).

    ``report``: the Report kept (updated in place); ``monitor``, ``policy``, ``spikes``: where its
    history, recoveries and early warnings come from; ``path``/``html``: the JSON report's and the
    HTML page's targets; ``tensorboard``: a logger or None; ``safe``: runs guard code without ever
    killing training; ``disabled``: the internal error that turned the guard off, if any, now."""

    def __init__(self, report: Report, *, monitor: Any, policy: Any, spikes: Any, path: Optional[str],
                 html: Optional[str], quiet: bool, tensorboard: Any, safe: Callable[[Callable[[], Any]], Any],
                 disabled: Callable[[], Optional[Dict[str, Any]]]) -> None:
        self.report, self.monitor, self.policy, self.spikes = report, monitor, policy, spikes
        self.path, self.html, self.quiet, self.tensorboard = path, html, quiet, tensorboard
        self.safe, self.disabled = safe, disabled

    def sync(self) -> Report:
        mon = self.monitor
        events = [e for e in self.report.events if not e.is_warning]
        events += list(self.policy.events) if self.policy is not None else []
        return assemble_report(RunFacts(
            counting="optimizer", steps_watched=mon.steps_watched,
            max_grad_norm=mon.history.max_grad_norm if len(mon.history) else None,
            history=mon.history.as_dicts(), info=list(self.report.info), events=events,
            warnings=list(self.spikes.events), disabled=self.disabled()), self.report)

    def tb_event(self, event: Event) -> None:
        if self.tensorboard is not None:
            self.safe(lambda: self.tensorboard.log_event(event))

    def write_json(self) -> None:
        self.sync()
        if self.path and is_main():  # distributed: rank 0 writes the merged report
            report_extra(self.report)
            self.safe(lambda: self.report.write(self.path))

    def write_html(self) -> None:
        if is_main():  # the page renders in seconds (plots): once, when the run stops or ends
            from ..core.render.html import write_run_html  # (the page's code: loaded when a report is written)
            page = write_run_html(self.report, self.path, self.html)
            if page and not self.quiet:
                print_line(f"HTML report: {page}")

    def close(self) -> None:
        """The run ended: the report written (JSON, HTML), the TensorBoard log closed."""
        self.write_json()
        self.write_html()
        if self.tensorboard is not None:
            self.safe(self.tensorboard.close)
