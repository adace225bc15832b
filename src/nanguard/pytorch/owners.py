"""Who the global hooks of a :class:`~nanguard.pytorch.watch.Watcher` answer to, at this moment.

A Watcher's hooks (optimizer, backward, module forward) see every training step of the process. They
stand aside where the step is someone else's:

* a :class:`~nanguard.Guard` step (``Guard.step`` checks, replays and reports its own steps: a
  ``Guard`` inside ``nanguard.watch()`` or under ``nanguard run`` is left to the Guard);
* a forked child (``os.fork``, ``multiprocessing`` with the fork start method, DataLoader workers):
  only the process that started the run watches, stops and writes the report and the bundle; the
  child's hooks do nothing (the child is left alone: never stopped, never fatal, no file written).

A stop raised in one thread (:class:`StopRun`) stops the run in every thread: the thread it ends
prints one line (not a traceback: ``threading.excepthook``), every other thread's next hook raises
it too, and ``nanguard run`` ends with status 3 (:class:`StandAside`, a part the Watcher holds: the stop
and the fork flag; the Watcher's ``_replaying`` reads them in every hook).
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from ..core.script import ThreadStops

_local = threading.local()
# per thread: ``guard_depth``, the Guard steps open in this thread (read as
# ``getattr(guard_state, "guard_depth", 0)``: the watcher's hooks test it inline, with no call)
guard_state = _local


class StopRun(BaseException):
    """Raised through the user's script to stop it (BaseException: ``except Exception`` won't eat it)."""

    def __init__(self, detection: Any) -> None:
        super().__init__(f"nanguard stopped the run at step {detection.step} ({detection.phase})")
        self.detection = detection
_watchers: "weakref.WeakSet[Any]" = weakref.WeakSet()


class _GuardStep:
    """``with GUARD_STEP:`` the calling thread runs a Guard's own step: watchers stand aside inside
    (a class, not a generator context manager: two Python calls a step instead of nine)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.guard_depth = getattr(_local, "guard_depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _local.guard_depth -= 1


GUARD_STEP = _GuardStep()  # ``with GUARD_STEP:`` around a Guard's step


def in_guard_step() -> bool:
    return getattr(_local, "guard_depth", 0) > 0


def track(owner: Any) -> None:
    """An installed watcher's :class:`StandAside`: after a fork, the child's copy stands aside (``forked``)."""
    _watchers.add(owner)


def untrack(owner: Any) -> None:
    _watchers.discard(owner)


def _in_child() -> None:
    for w in list(_watchers):
        w.forked = True


class StandAside:
    """The Watcher's stop and fork state (see the module docstring): ``stopping``, the detection a stop
    was raised at in any thread (None: none), and ``forked``, this process is a forked child's copy."""

    def __init__(self) -> None:
        self.stopping: Any = None
        self.forked = False
        self._threads: Any = None

    def stop(self, det: Any) -> StopRun:
        """The run stops at ``det``, in every thread (see ``stopping``)."""
        if self.stopping is None:
            self.stopping = det
        return StopRun(det)

    def own_process(self) -> None:
        track(self)
        self._threads = ThreadStops(lambda e: isinstance(e, StopRun))
        self._threads.install()

    def release_process(self) -> None:
        if self._threads is not None:
            self._threads.uninstall()
            self._threads = None
        untrack(self)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
