"""The guard's own errors never kill the user's training: :func:`call_guarded`, shared by the drivers."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Tuple, Type, Union


def call_guarded(owner: Any, fn: Callable[[], Any],
                 passthrough: Union[Type[BaseException], Tuple[Type[BaseException], ...]] = ()) -> Any:
    """Run guard code ``fn`` for ``owner`` (a driver with ``disabled``, ``error`` and ``config.strict``).
    ``passthrough``: the driver's own control-flow exceptions (a stop), re-raised. Any other error warns
    once and disables the guard for the rest of the run (``owner.error`` says why), unless strict."""
    if owner.disabled:
        return None
    try:
        return fn()
    except passthrough:
        raise
    except Exception as e:  # never kill the user's training for a guard bug
        return internal_error(owner, e, stacklevel=5)


def guarded_method(passthrough: Union[Type[BaseException], Tuple[Type[BaseException], ...]] = (),
                   busy: bool = False) -> Callable[..., Any]:
    """A driver's method ``safe(self, fn, *args)``: :func:`call_guarded` for ``fn(*args)``, with the
    ``try`` in the method itself (drivers run several a step: no lambda and no ``call_guarded`` frame on
    the healthy path). ``busy``: the driver's ``_busy`` counter is raised while ``fn`` runs (its hooks
    then know the values they see are the guard's own)."""
    def safe(self: Any, fn: Callable[..., Any], *args: Any) -> Any:
        if self.disabled:
            return None
        if busy:
            self._busy += 1
        try:
            return fn(*args)
        except passthrough:
            raise
        except Exception as e:  # never kill the user's training for a guard bug
            return internal_error(self, e)
        finally:
            if busy:
                self._busy -= 1
    return safe


def internal_error(owner: Any, e: Exception, stacklevel: int = 4) -> None:
    """What :func:`call_guarded` does with guard code's error ``e`` (raised on when strict; else the
    owner is disabled, with a warning). Call it from the ``except`` block: it re-raises the error being
    handled when strict."""
    if owner.config.strict:
        raise e
    owner.disabled = True
    owner.error = f"{type(e).__name__}: {e}"
    owner.disabled_step = _step_of(owner)
    warnings.warn(f"nanguard: internal error, guard disabled for the rest of the run: "
                  f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=stacklevel)
    return None


def _step_of(owner: Any) -> Any:
    """The step the driver was at (its monitor's count of steps watched), or None."""
    for src in (getattr(owner, "monitor", None), owner):
        n = getattr(src, "steps_watched", None)
        if isinstance(n, int):
            return n
    return None


def disabled_note(owner: Any) -> Any:
    """The report's ``guard_disabled`` record of a driver an internal error turned off, or None."""
    if not getattr(owner, "disabled", False):
        return None
    return {"error": getattr(owner, "error", None) or "internal error",
            "step": getattr(owner, "disabled_step", None)}
