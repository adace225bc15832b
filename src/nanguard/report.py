"""Stage 5, report: the versioned JSON report (contract ``nanguard.report/1``) and
its terminal rendering.

The JSON contract is read by graders and tools, so the names and meanings of
``schema``, ``status`` and each event's ``step``, ``phase``, ``origin``,
``cause``, ``fixes`` and ``recovery`` never change within schema version 1.
Everything else is extra and may grow.
"""
from __future__ import annotations

import json
import linecache
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

SCHEMA = "nanguard.report/1"
PHASES = ("data", "params", "forward", "backward", "optimizer", "eval")


@dataclass
class Event:
    """One non-finite event (or one recovery) in the run."""

    step: int
    phase: str
    origin: Optional[Dict[str, Any]] = None
    cause: Dict[str, Any] = field(default_factory=lambda: {
        "category": "other", "summary": "", "confidence": 0.0, "evidence": {}})
    fixes: List[str] = field(default_factory=list)
    recovery: Optional[Dict[str, Any]] = None
    detected: Dict[str, Any] = field(default_factory=dict)  # what the per-step check saw
    localization: Optional[Dict[str, Any]] = None  # how the origin was found
    rank: Optional[int] = None

    def as_dict(self) -> Dict[str, Any]:
        d = {"step": self.step, "phase": self.phase, "origin": self.origin, "cause": self.cause,
             "fixes": list(self.fixes), "recovery": self.recovery, "detected": self.detected,
             "localization": self.localization}
        if self.rank is not None:
            d["rank"] = self.rank
        return _json_safe(d)


@dataclass
class Report:
    """The whole run's report: status, events, and run facts."""

    events: List[Event] = field(default_factory=list)
    info: List[Dict[str, Any]] = field(default_factory=list)  # non-failures: scaler warm-up skips...
    steps_watched: int = 0
    counting: str = "optimizer"  # "optimizer" step attempts or "backward" passes
    max_grad_norm: Optional[float] = None
    scaler_skips: int = 0
    history: List[Dict[str, Any]] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if not self.events:
            return "clean"
        failures = [e for e in self.events if e.recovery is None]
        if not failures and all((e.recovery or {}).get("ok") for e in self.events):
            return "recovered"
        return "nonfinite"

    @property
    def first(self) -> Optional[Event]:
        return self.events[0] if self.events else None

    def as_dict(self) -> Dict[str, Any]:
        from . import __version__
        d = {"schema": SCHEMA, "status": self.status, "events": [e.as_dict() for e in self.events],
             "nanguard_version": __version__, "counting": self.counting,
             "steps_watched": self.steps_watched, "max_grad_norm": self.max_grad_norm,
             "scaler_skips": self.scaler_skips, "info": self.info, "history": self.history}
        d.update(self.extra)
        return _json_safe(d)

    def write(self, path: str) -> str:
        """Write the JSON report atomically (temp file + rename): never a half-written file."""
        write_json_atomic(path, self.as_dict())
        return path


def _json_safe(obj: Any) -> Any:
    """Replace NaN/Inf floats by strings: the report must be strict JSON."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def write_atomic(path: str, write: Callable[[str], None], suffix: str = ".tmp") -> str:
    """Write through ``write(tmp_path)`` then rename over ``path``: readers never see half a file."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".nanguard-", suffix=suffix, dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(path: str, data: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
    write_atomic(path, write, ".json.tmp")


class NonFiniteError(RuntimeError):
    """Raised when a non-finite value is found and the guard is set to stop.

    ``err.report`` is the :class:`Report`; ``err.event`` the failing event.
    """

    def __init__(self, report: Report, event: Event) -> None:
        self.report = report
        self.event = event
        super().__init__(one_line(event))


def one_line(ev: Event) -> str:
    where = ""
    o = ev.origin or {}
    if o.get("file") and o.get("line"):
        where = f" at {os.path.basename(str(o['file']))}:{o['line']}"
    cat = (ev.cause or {}).get("category", "other")
    summary = (ev.cause or {}).get("summary") or ""
    return f"non-finite value at step {ev.step} (phase {ev.phase}){where}: {cat}. {summary}".strip()


# ----------------------------------------------------------------------------- terminal

def _console():
    from rich.console import Console
    return Console(stderr=True, highlight=False, soft_wrap=False)


def print_line(msg: str) -> None:
    """One short status line on stderr (never stdout: the user's script owns it)."""
    try:
        _console().print(f"[bold cyan]nanguard[/]: {_escape(msg)}", soft_wrap=True)
    except Exception:
        print(f"nanguard: {msg}", file=sys.stderr)


def _escape(s: str) -> str:
    from rich.markup import escape
    return escape(s)


def render(report: Report, json_path: Optional[str] = None) -> None:
    """Print the one-screen terminal report of the first failure (or the clean summary)."""
    try:
        _render(report, json_path)
    except Exception as e:  # the report must never kill the run
        print(f"nanguard: (could not render report: {e})", file=sys.stderr)
        ev = report.first
        if ev:
            print("nanguard: " + one_line(ev), file=sys.stderr)


def _render(report: Report, json_path: Optional[str]) -> None:
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.table import Table
    from rich.console import Group

    con = _console()
    ev = next((e for e in report.events if e.recovery is None), report.first)
    if ev is None:
        con.print(f"[bold cyan]nanguard[/]: {_escape(summary_line(report))}")
        return
    cause = ev.cause or {}
    parts: list = []
    head = Table.grid(padding=(0, 1))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("step", str(ev.step))
    head.add_row("phase", ev.phase + _PHASE_HINT.get(ev.phase, ""))
    o = ev.origin or {}
    if o:
        bits = [str(o.get(k)) for k in ("op",) if o.get(k)]
        if o.get("autograd_node"):
            fwd = f", backward of {o['forward_op']}" if o.get("forward_op") else ""
            bits[-1:] = [f"{bits[-1] if bits else '?'} in {o['autograd_node']}{fwd}"]
        if o.get("module") not in (None,):
            bits.append(f"module '{o.get('module')}'")
        if o.get("dtype"):
            bits.append(str(o["dtype"]))
        head.add_row("where", _escape(", ".join(bits) or "-"))
        if o.get("file"):
            head.add_row("line", _escape(f"{o['file']}:{o.get('line')} in {o.get('function')}"))
    head.add_row("cause", _escape(f"{cause.get('category', 'other')} "
                                  f"(confidence {float(cause.get('confidence') or 0):.2f})"))
    if cause.get("summary"):
        head.add_row("why", _escape(str(cause["summary"])))
    loc = ev.localization or {}
    if loc.get("method"):
        head.add_row("how", _escape(str(loc["method"])))
    parts.append(head)
    code = _excerpt(o.get("file"), o.get("line"))
    if code:
        parts.append(Syntax(code[0], "python", line_numbers=True, start_line=code[1],
                            highlight_lines={int(o["line"])}, word_wrap=True))
    if ev.fixes:
        fx = Table.grid(padding=(0, 1))
        fx.add_column()
        fx.add_column()
        for i, f in enumerate(ev.fixes, 1):
            fx.add_row(f"[bold green]{i}.[/]", _escape(f))
        parts.append("[bold]What to do[/]")
        parts.append(fx)
    more = len(report.events) - 1
    tail = []
    if more > 0:
        tail.append(f"{more} more event(s) in the JSON report")
    if json_path:
        tail.append(f"JSON report: {json_path}")
    if tail:
        parts.append("[dim]" + _escape("; ".join(tail)) + "[/]")
    con.print(Panel(Group(*parts), title="[bold red]nanguard: non-finite value[/]", expand=False))


_PHASE_HINT = {
    "data": " (already in the batch)",
    "params": " (parameters were non-finite before the step)",
    "forward": " (born in the forward pass or the loss)",
    "backward": " (born in the backward pass; the loss was finite)",
    "optimizer": " (made by the optimizer update; gradients were finite)",
    "eval": " (model output during evaluation)",
}


def _excerpt(path: Optional[str], line: Optional[int], context: int = 2):
    if not path or not line:
        return None
    try:
        line = int(line)
        lines = [linecache.getline(path, i) for i in range(max(1, line - context), line + context + 1)]
    except Exception:
        return None
    if not any(lines):
        return None
    return "".join(lines).rstrip("\n"), max(1, line - context)


def summary_line(report: Report) -> str:
    mg = report.max_grad_norm
    mg_s = f"{mg:.3g}" if isinstance(mg, float) and math.isfinite(mg) else "n/a"
    unit = "steps" if report.counting == "optimizer" else "backward passes"
    s = (f"{report.status}: watched {report.steps_watched} {unit}, max grad norm {mg_s}, "
         f"scaler skips {report.scaler_skips}")
    n_rec = sum(1 for e in report.events if e.recovery)
    if n_rec:
        s += f", recoveries {n_rec}"
    fails = [e for e in report.events if e.recovery is None]
    if fails:
        s += f", first failure at step {fails[0].step} ({fails[0].phase})"
    return s
