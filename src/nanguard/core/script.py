"""Running a user's training script as ``__main__`` and mapping how it ended to a status.

Shared by the backends' ``nanguard run`` runners (:mod:`nanguard.pytorch.run`,
:mod:`nanguard.tensorflow.run`), so both treat ``sys.exit``, Ctrl-C, SIGTERM, crashes and
nanguard's own stop the same way, and every run ends with an honest status in its report:

* ``sys.exit(c)``: the script's own exit status;
* an uncaught exception (``SyntaxError`` included): exit status 1, ``"status": "script_error"`` with
  the exception's type, message, the user's file and line, the step, and a diagnosis when a rule
  knows the error (:mod:`nanguard.core.diagnosis.errors`);
* SIGTERM (what Slurm and Kubernetes send on preemption) and SIGINT (Ctrl-C): raised through the
  script as :class:`Terminated` / ``KeyboardInterrupt``, so the report (and the repro bundle, if
  one is due) is written, then exit status 143 / 130 (128 + the signal number), ``"status":
  "interrupted"`` unless a failure was found. A signal that comes while the report is written is
  remembered (it cuts a localization re-run short) and gives the exit status; the runner calls
  :func:`restore_signals` at its end;
* ``os._exit(c)`` (scripts that skip the interpreter's shutdown: worker threads or processes that would
  hang it): no exception unwinds and no ``finally`` runs, so the runner's end (``on_hard_exit``) is
  called right there, in the process that runs the script (not in a forked child), and then the process
  exits as asked, with the runner's status.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import sysconfig
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

from .exitcodes import EXIT_NONFINITE

__all__ = ["ScriptOutcome", "Terminated", "run_as_main", "run_to_end", "exit_code", "apply_outcome",
           "print_user_traceback", "interruptible", "pending_signal", "restore_signals", "block_outcome",
           "apply_late_signal", "signal_status", "ThreadStops"]


class Terminated(BaseException):
    """SIGTERM, raised through the user's script (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class ScriptOutcome:
    """How the script ended: ``code`` is its own exit status (0, its ``sys.exit`` code, 1 for an
    uncaught exception, 130 / 143 for SIGINT / SIGTERM); ``stopped`` is True when nanguard stopped it;
    ``error``: the uncaught exception (not SystemExit / stop / signal), ``error_info`` its description;
    ``signal``: "SIGTERM" or "SIGINT" when a signal ended it."""

    code: int = 0
    stopped: bool = False
    error: Optional[BaseException] = None
    error_info: Optional[Dict[str, Any]] = None
    signal: Optional[str] = None


def run_as_main(script: str, args: List[str], is_stop: Callable[[BaseException], bool],
                on_hard_exit: Optional[Callable[[ScriptOutcome], int]] = None) -> ScriptOutcome:
    """Run ``script`` as ``python SCRIPT ARGS`` would (its folder first on ``sys.path``, ``sys.argv``
    set as given), restoring both afterwards. ``is_stop(exc)`` says whether an exception is nanguard's
    own stop. SIGTERM and SIGINT are turned into exceptions while it runs (main thread only), and
    ignored after it ended until the caller exits (see the module docstring). ``on_hard_exit(outcome)``:
    the runner's end, called inside the script's ``os._exit`` (returns the status to exit with)."""
    script_abs = os.path.abspath(script)
    old_argv = sys.argv
    folder = os.path.dirname(script_abs)
    sys.argv = [script] + list(args)
    sys.path.insert(0, folder)
    out = ScriptOutcome()
    threads = ThreadStops(is_stop)
    threads.install()

    def restore() -> None:
        threads.uninstall()
        sys.argv = old_argv
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        else:
            try:
                sys.path.remove(folder)
            except ValueError:
                pass

    try:
        with _signals_raise(), _hard_exits(out, on_hard_exit, restore):
            runpy.run_path(script_abs, run_name="__main__")
    except BaseException as e:  # noqa: B902 - sorted below
        if is_stop(e):
            out.stopped = True
        elif isinstance(e, SystemExit):
            out.code = exit_code(e.code)
        elif isinstance(e, (KeyboardInterrupt, Terminated)):
            signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
            out.signal = signal.Signals(signum).name
            print(f"nanguard: interrupted ({out.signal}); writing the report", file=sys.stderr)
            out.code = 128 + int(signum)
        else:
            print_user_traceback(script_abs)
            out.code, out.error = 1, e
            out.error_info = describe_error(e, script_abs)
    finally:
        restore()
    return out


def run_to_end(script: str, args: List[str], is_stop: Callable[[BaseException], bool],
               finish: Callable[[ScriptOutcome], int], uninstall: Callable[[], None]) -> int:
    """A runner's whole run: the script (:func:`run_as_main`), then ``finish(outcome)`` (the report, the
    status), which its ``os._exit`` calls too; ``uninstall`` takes the hooks out if nanguard itself raised."""
    try:
        outcome = run_as_main(script, args, is_stop, on_hard_exit=finish)
    except BaseException:
        uninstall()
        raise
    return finish(outcome)


@contextlib.contextmanager
def _hard_exits(out: ScriptOutcome, finish: Optional[Callable[[ScriptOutcome], int]],
                restore: Callable[[], None]) -> Iterator[None]:
    """While the script runs, its ``os._exit(c)`` first ends the run (``finish``: the report written, the
    hooks taken out), then exits with the status ``finish`` returns. A forked child's ``os._exit`` (a
    worker process: the parent reports) exits at once."""
    if finish is None:
        yield
        return
    real, owner = os._exit, os.getpid()

    def _exit(code: int) -> None:
        if os.getpid() == owner and os._exit is _exit:
            os._exit = real
            out.code = int(code)
            print(f"nanguard: the script called os._exit({int(code)}); writing the report", file=sys.stderr)
            try:
                restore()
                code = finish(out)
            except BaseException as e:  # noqa: B902 - the script asked to exit now: exit whatever happens
                print(f"nanguard: could not end the run: {type(e).__name__}: {e}", file=sys.stderr)
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except Exception:
                    pass
        real(code)

    os._exit = _exit
    try:
        yield
    finally:
        if os._exit is _exit:
            os._exit = real


class ThreadStops:
    """While installed, a thread that nanguard's stop ended (``is_stop(exc)``) prints one line instead of
    a traceback (``threading.excepthook``); the backends raise the stop in the other threads at their
    next step and end the run with status 3. Other exceptions go to the previous hook."""

    def __init__(self, is_stop: Callable[[BaseException], bool]) -> None:
        self.is_stop, self.prev, self.noted = is_stop, None, False

    def install(self) -> None:
        self.prev, threading.excepthook = threading.excepthook, self.hook

    def uninstall(self) -> None:
        if threading.excepthook == self.hook:
            threading.excepthook = self.prev or threading.__excepthook__

    def hook(self, args: Any) -> None:
        if args.exc_value is not None and self.is_stop(args.exc_value):
            if not self.noted:
                self.noted = True
                name = getattr(args.thread, "name", None) or "a thread"
                print(f"nanguard: {args.exc_value} (in thread {name}); the other threads stop at their next step",
                      file=sys.stderr)
            return
        (self.prev or threading.__excepthook__)(args)


class _Signals:
    """SIGTERM/SIGINT handling around a script run (main thread only).

    While the script runs, a signal raises (:class:`Terminated` / ``KeyboardInterrupt``) through it.
    After it ended, while nanguard writes the report, a signal is remembered (``pending``) and raised
    only inside :func:`interruptible` (waiting for the localization re-run, which it then cuts short).
    :func:`restore_signals` puts the previous handlers back. SIGINT is handled also when it was
    ignored (a background job of a shell script), so that ``kill -INT`` ends the run with a report."""

    def __init__(self) -> None:
        self.old: Dict[int, Any] = {}
        self.raising = False
        self.pending: Optional[int] = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self.old:
            return
        for s in (signal.SIGTERM, signal.SIGINT):
            self.old[s] = signal.getsignal(s)
            signal.signal(s, self.handler)

    def handler(self, signum, frame) -> None:
        if not self.raising:
            if self.pending is None:
                self.pending = signum
            return
        self.raising = False  # one signal asks to stop: later ones wait for the report
        if self.pending is None:
            self.pending = signum
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    def restore(self) -> None:
        for s, h in self.old.items():
            try:
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
        self.old = {}
        self.raising = False
        self.pending = None


_SIGNALS = _Signals()


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    _SIGNALS.install()
    _SIGNALS.pending = None
    _SIGNALS.raising = True
    try:
        yield
    finally:
        _SIGNALS.raising = False


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """A signal received after the script ended (or during this block) raises inside this block."""
    if _SIGNALS.pending is not None:
        sig = _SIGNALS.pending
        if sig == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(sig)
    prev, _SIGNALS.raising = _SIGNALS.raising, bool(_SIGNALS.old)
    try:
        yield
    finally:
        _SIGNALS.raising = prev


def pending_signal() -> Optional[int]:
    """The signal received since the script started, if any (it ended the script, or came after)."""
    return _SIGNALS.pending


def restore_signals() -> None:
    """Put back the signal handlers the process had before :func:`run_as_main`."""
    _SIGNALS.restore()


def exit_code(c: Any) -> int:
    """The status ``sys.exit(c)`` gives: None -> 0, an int as is, anything else printed and 1."""
    if c is None:
        return 0
    if isinstance(c, int):
        return c
    print(c, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def print_user_traceback(script_abs: str) -> None:
    """Show the script's own traceback, as ``python SCRIPT`` would (without nanguard's frames)."""
    etype, value, tb = sys.exc_info()
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script_abs:
        tb = tb.tb_next
    traceback.print_exception(etype, value, tb)


def _library_dirs() -> tuple:
    dirs = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # nanguard itself
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            dirs.add(sysconfig.get_paths()[key])
        except Exception:
            pass
    return tuple(os.path.realpath(d) for d in dirs if d)


def describe_error(e: BaseException, script_abs: str) -> Dict[str, Any]:
    """Type, message, the user's file/line/function (the innermost frame outside installed packages
    and the standard library; for a SyntaxError its own location) and where it was raised."""
    d: Dict[str, Any] = {"type": type(e).__name__, "message": str(e)[:2000]}
    if isinstance(e, SyntaxError):
        d.update(file=e.filename, line=e.lineno, function=None, offset=e.offset,
                 text=(e.text or "").rstrip("\n")[:300] or None)
        d["message"] = e.msg
        return d
    lib = _library_dirs()
    frames = traceback.extract_tb(e.__traceback__)
    user = None
    for fr in frames:
        real = os.path.realpath(fr.filename)
        if not fr.filename.startswith("<") and "site-packages" not in real and "dist-packages" not in real \
                and not any(real == p or real.startswith(p + os.sep) for p in lib):
            user = fr
    if user is not None:
        d.update(file=user.filename, line=user.lineno, function=user.name, text=(user.line or None))
    if frames:
        last = frames[-1]
        if user is None or (last.filename, last.lineno) != (user.filename, user.lineno):
            d["raised_in"] = {"file": last.filename, "line": last.lineno, "function": last.name}
    return d


def block_outcome(e: BaseException) -> ScriptOutcome:
    """How a watched block (``with nanguard.watch():``) ended when it raised ``e``."""
    out = ScriptOutcome(code=1)
    if isinstance(e, (KeyboardInterrupt, Terminated)):
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        out.signal, out.code = signal.Signals(signum).name, 128 + int(signum)
    elif isinstance(e, SystemExit):
        out.code = exit_code(e.code)
    else:
        frames = traceback.extract_tb(e.__traceback__)
        out.error = e
        out.error_info = describe_error(e, frames[0].filename if frames else "")
    return out


def apply_outcome(report: Any, outcome: ScriptOutcome, step: Optional[int] = None) -> None:
    """Record on ``report`` (a :class:`~nanguard.core.events.Report`) how the script ended."""
    if outcome.error_info is not None:
        err = dict(outcome.error_info)
        if step is not None:
            err["step"] = step
        from .diagnosis import diagnose_error  # only for a script that raised (start-up: not loaded)
        dx = diagnose_error(err)
        if dx is not None:
            err["diagnosis"] = dx
        report.script_error = err
    if outcome.signal is not None:
        report.interrupted = {"signal": outcome.signal, "exit_status": outcome.code, "step": step}
    report.exit_code = EXIT_NONFINITE if outcome.stopped else outcome.code


def apply_late_signal(report: Any, outcome: ScriptOutcome, step: Optional[int] = None) -> Optional[int]:
    """A signal that came after the script ended (nanguard stopped it, or it finished) while nanguard
    localized the failure: it wins. The report says ``interrupted`` (``"during": "localization"``) with
    128 + the signal number as ``exit_code``, which is returned; None when no such signal came."""
    sig = _SIGNALS.pending
    if sig is None or outcome.signal is not None:
        return None
    code = 128 + int(sig)
    report.interrupted = {"signal": signal.Signals(sig).name, "exit_status": code, "step": step,
                          "during": "localization"}
    report.exit_code = code
    return code


def close_run(build: Callable[[], Any], outcome: ScriptOutcome, *, sink: Any, report_path: Optional[str],
              page_path: Optional[str], quiet: bool, strict: bool, show: Callable[[Any], None],
              write: bool = True, settled: Optional[Callable[[Any], None]] = None) -> Optional[int]:
    """The end of a ``nanguard run``, the same for every backend's runner: build the report (``build``),
    settle its status with how the script ended (an error, a signal), hand it to ``settled`` (TensorBoard),
    write the JSON and the HTML page (``write``: False on the ranks other than 0 of a distributed run),
    print it (``show``) and put the signal handlers back. The guard's own error here is a warning unless
    strict. Returns the exit status a signal imposes, or None (the runner's own)."""
    from .render.html import write_run_html
    from .render.terminal import print_line
    final = None
    try:
        report = build()
        apply_outcome(report, outcome, step=report.steps_watched)  # script_error / interrupted
        final = apply_late_signal(report, outcome, step=report.steps_watched)  # a signal wins over the stop
        if settled is not None:
            settled(report)
        page = None
        if write:
            if report_path:
                sink.finish(report)
            page = write_run_html(report, report_path, page_path)
        if not quiet:
            show(report)
            if page:
                print_line(f"HTML report: {page}")
    except Exception as e:
        if strict:
            raise
        print(f"nanguard: could not build the report: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        late = pending_signal()
        restore_signals()
    return signal_status(final, outcome, late)


def signal_status(final: Optional[int], outcome: ScriptOutcome, late: Any) -> Optional[int]:
    """The exit status a signal imposes at a run's end (``final``: one that came while nanguard localized the
    failure; ``late``: one that came while the report was written), or None (the runner's own)."""
    if final is not None:
        return final
    if outcome.signal is None and late is not None:
        return 128 + int(late)
    return None


def main_names() -> Dict[int, str]:
    """id -> name of the script's module-level variables (``nanguard run`` runs it as ``__main__``): the
    words users recognise for an optimizer or a model (read at an event, never in a healthy step)."""
    out: Dict[int, str] = {}
    for k, v in list(getattr(sys.modules.get("__main__"), "__dict__", {}).items()):
        if not k.startswith("_"):
            out.setdefault(id(v), k)
    return out
