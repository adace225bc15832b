"""Run a localization child process (``nanguard run``'s re-run of the script up to a failing step).

Both backends re-run the user's script in a fresh interpreter with a recorder armed at the failing
step; the child writes its findings as JSON to ``--out``. This module owns the process part: temp
files, the environment (``NANGUARD_REPLAY_CHILD``, this package first on ``PYTHONPATH``), the
timeout, reading the result and cleaning up. It never raises for a failed child: the result says why.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional

CHILD_TIMEOUT_S = 600.0

# src/ (this package's parent): the child imports the same nanguard as the parent
_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_child(module: str, args: List[str], step: int, *, timeout: float = CHILD_TIMEOUT_S,
              extra_env: Optional[Dict[str, str]] = None,
              around: Optional[Callable[[], ContextManager[Any]]] = None) -> Dict[str, Any]:
    """``python -m module --step N --out F *args``; returns ``{"method": "rerun", "step", "returncode",
    ...the child's JSON..., "seconds"}`` or an ``error`` (with ``stderr_tail``). ``around``: a context
    manager entered around the wait (e.g. one that lets SIGTERM stop the child, not the report)."""
    t0 = time.time()
    fd, out = tempfile.mkstemp(prefix="nanguard-loc-", suffix=".json")
    os.close(fd)
    errf = out + ".stderr"
    cmd = [sys.executable, "-m", module, "--step", str(step), "--out", out] + list(args)
    res: Dict[str, Any] = {"method": "rerun", "step": step}
    try:
        env = dict(os.environ, NANGUARD_REPLAY_CHILD="1")
        env.update(extra_env or {})
        env["PYTHONPATH"] = _SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(errf, "w") as ef, (around() if around is not None else contextlib.nullcontext()):
            p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=ef, stdin=subprocess.DEVNULL,
                               timeout=timeout, cwd=os.getcwd(), env=env)
        res["returncode"] = p.returncode
        if os.path.getsize(out) > 0:
            with open(out) as f:
                res.update(json.load(f))
        else:
            res["error"] = "the re-run ended without reaching the failing step"
            res["stderr_tail"] = _tail(errf)
    except subprocess.TimeoutExpired:
        res["error"] = f"the re-run timed out after {timeout:.0f}s"
    except Exception as e:  # localization is best effort; detection already happened
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        for f in (out, errf):
            try:
                os.unlink(f)
            except OSError:
                pass
    res["seconds"] = round(time.time() - t0, 3)
    return res


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""
