"""What a :class:`~nanguard.pytorch.watch.Watcher` tells an observer: :class:`WatchObserver`.

An observer is one object with named hooks, passed to the Watcher's constructor (in the style of
Lightning's ``Callback``): the localization re-run's child arms its op recorder at the failing step
and moves it between stages, ``nanguard run`` rewrites its running report after each event, and
``watch()`` / ``nanguard run`` print one line at a failure. Every hook gets the watcher first; the
base class's hooks do nothing, so a subclass overrides only what it needs. The hooks are called once
per step (or per batch, per failure), never per op: a healthy step pays a few no-op calls.

``recorder``: an op recorder the observer armed on the live script (the re-run's child): while it
runs its own checks, the values it reads (NaN included) are not the script's (``Watcher.busy``).
"""
from __future__ import annotations

from typing import Any, List, Sequence

__all__ = ["WatchObserver", "Observers", "combine", "hook"]


class WatchObserver:
    """The Watcher's hooks (see the module docstring); each does nothing here."""

    def step_start(self, watcher: Any, step: int) -> None:
        """Step ``step`` starts (0 at install, then after each update or skip)."""

    def backward_begin(self, watcher: Any, losses: List[Any]) -> None:
        """A backward pass on ``losses`` begins."""

    def backward_end(self, watcher: Any) -> None:
        """The backward pass ended (also when it raised)."""

    def optimizer_begin(self, watcher: Any) -> None:
        """An optimizer's check and update begin."""

    def optimizer_end(self, watcher: Any) -> None:
        """An optimizer's update (or skip) is done (a GAN: the other model's forward comes next)."""

    def detection(self, watcher: Any, det: Any, opt: Any) -> None:
        """A failure was recorded (``opt``: the optimizer of its check, or None)."""

    def event(self, watcher: Any, det: Any) -> None:
        """A failure was handled (localized, tested): called inside the guard's error handling."""

    def data_begin(self, watcher: Any) -> None:
        """A DataLoader fetches a batch (the fetch is data, not the step's ops)."""

    def data_end(self, watcher: Any) -> None:
        """The fetch ended (also on StopIteration)."""

    @property
    def recorder(self) -> Any:
        """The op recorder armed on the live script, or None."""
        return None


class Observers(WatchObserver):
    """Several observers as one: each hook calls them in order."""

    def __init__(self, observers: Sequence[WatchObserver]) -> None:
        self.observers = list(observers)

    def step_start(self, watcher: Any, step: int) -> None:
        for o in self.observers:
            o.step_start(watcher, step)

    def backward_begin(self, watcher: Any, losses: List[Any]) -> None:
        for o in self.observers:
            o.backward_begin(watcher, losses)

    def backward_end(self, watcher: Any) -> None:
        for o in self.observers:
            o.backward_end(watcher)

    def optimizer_begin(self, watcher: Any) -> None:
        for o in self.observers:
            o.optimizer_begin(watcher)

    def optimizer_end(self, watcher: Any) -> None:
        for o in self.observers:
            o.optimizer_end(watcher)

    def detection(self, watcher: Any, det: Any, opt: Any) -> None:
        for o in self.observers:
            o.detection(watcher, det, opt)

    def event(self, watcher: Any, det: Any) -> None:
        for o in self.observers:
            o.event(watcher, det)

    def data_begin(self, watcher: Any) -> None:
        for o in self.observers:
            o.data_begin(watcher)

    def data_end(self, watcher: Any) -> None:
        for o in self.observers:
            o.data_end(watcher)

    @property
    def recorder(self) -> Any:
        return next((r for r in (o.recorder for o in self.observers) if r is not None), None)


def hook(observer: WatchObserver, name: str) -> Any:
    """``observer``'s bound hook ``name``, or None when it is the base class's no-op: the Watcher then
    makes no call for it (its per-step hooks run every step)."""
    if getattr(type(observer), name, None) is getattr(WatchObserver, name):
        return None
    return getattr(observer, name)


def combine(*observers: Any) -> WatchObserver:
    """One observer for these (None left out): the base class's no-op for none, the one itself for one."""
    obs = [o for o in observers if o is not None]
    if not obs:
        return WatchObserver()
    return obs[0] if len(obs) == 1 else Observers(obs)
