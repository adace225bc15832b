"""Running a user's training script as ``__main__`` and mapping how it ended to an exit status.

Shared by the backends' ``nanguard run`` runners (:mod:`nanguard.pytorch.run`,
:mod:`nanguard.tensorflow.run`), so both treat ``sys.exit``, Ctrl-C, crashes and nanguard's own
stop the same way.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Optional


@dataclass
class ScriptOutcome:
    """How the script ended: ``code`` is its own exit status (0, its ``sys.exit`` code, 1 for an
    uncaught exception, 130 for Ctrl-C); ``stopped`` is True when nanguard stopped it."""

    code: int = 0
    stopped: bool = False
    error: Optional[BaseException] = None  # the uncaught exception, if any (not SystemExit / stop)


def run_as_main(script: str, args: List[str], is_stop: Callable[[BaseException], bool]) -> ScriptOutcome:
    """Run ``script`` as ``python SCRIPT ARGS`` would (its folder first on ``sys.path``, ``sys.argv``
    set as given), restoring both afterwards. ``is_stop(exc)`` says whether an exception is nanguard's
    own stop."""
    script_abs = os.path.abspath(script)
    old_argv = sys.argv
    folder = os.path.dirname(script_abs)
    sys.argv = [script] + list(args)
    sys.path.insert(0, folder)
    out = ScriptOutcome()
    try:
        runpy.run_path(script_abs, run_name="__main__")
    except BaseException as e:  # noqa: B902 - sorted below
        if is_stop(e):
            out.stopped = True
        elif isinstance(e, SystemExit):
            out.code = exit_code(e.code)
        elif isinstance(e, KeyboardInterrupt):
            print("nanguard: interrupted (Ctrl-C); writing the report", file=sys.stderr)
            out.code = 130
        else:
            print_user_traceback(script_abs)
            out.code, out.error = 1, e
    finally:
        sys.argv = old_argv
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        else:
            try:
                sys.path.remove(folder)
            except ValueError:
                pass
    return out


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
