"""Named hooks on a :class:`~.watch.TFWatcher`'s steps, passed to its constructor (the re-run child,
the running report of ``nanguard run``): a base class whose hooks do nothing, in the style of
Lightning's callbacks. Each hook gets the watcher first."""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["TFObserver", "TFObservers"]


class TFObserver:
    """Override the hooks you need; ``recorder`` is an op recorder watching the live steps (the re-run
    child arms one at the failing step), or None."""

    recorder: Any = None

    def detection(self, watcher: Any, det: Any, st: Any) -> None:
        """A failure (or an information-only detection) was recorded for optimizer state ``st``."""

    def step_end(self, watcher: Any, step: int) -> None:
        """The host decided step ``step`` (its numbers were read)."""

    def update_done(self, watcher: Any, attempts: int) -> None:
        """An update was attempted: ``attempts`` updates so far."""


class TFObservers(TFObserver):
    """Several observers, called in order; the first armed recorder is the watcher's."""

    def __init__(self, observers: Sequence[TFObserver] = ()) -> None:
        self.items = list(observers)

    @property
    def recorder(self) -> Any:  # type: ignore[override]
        return next((o.recorder for o in self.items if o.recorder is not None), None)

    def detection(self, watcher: Any, det: Any, st: Any) -> None:
        for o in self.items:
            o.detection(watcher, det, st)

    def step_end(self, watcher: Any, step: int) -> None:
        for o in self.items:
            o.step_end(watcher, step)

    def update_done(self, watcher: Any, attempts: int) -> None:
        for o in self.items:
            o.update_done(watcher, attempts)
