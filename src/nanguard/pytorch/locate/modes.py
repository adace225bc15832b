"""Mode plumbing: the recorder's TorchDispatchMode (every ATen op) and TorchFunctionMode (the torch API
call that issued it), installed and removed as a pair, and paused around the recorder's own work.

The modes call back into the recorder only while ``Switch.armed`` and not ``Switch.busy``; the
recorder sets ``busy`` while it runs its own ops (checks, re-runs), so they are never recorded.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .naming import api_name

__all__ = ["Switch", "Modes"]

# Torch API entries that do not enclose forward ops (we must not attribute backward ops to them).
_API_SKIP_NAMES = {"backward", "grad", "__get__", "__set__", "__delete__", "run_backward", "_engine_run_backward"}


class Switch:
    """``armed``: recording; ``busy``: the recorder is running its own code (not recorded)."""
    __slots__ = ("armed", "busy")

    def __init__(self) -> None:
        self.armed = False
        self.busy = False


class _FunctionMode(TorchFunctionMode):
    """Remembers the torch API call that encloses the ATen ops (F.kl_div, torch.log, Tensor.__truediv__)."""

    def __init__(self, switch: Switch, api_stack: list, api_names: dict):
        super().__init__()
        self.switch, self.api_stack, self.api_names = switch, api_stack, api_names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sw = self.switch
        if sw.busy or not sw.armed or getattr(func, "__name__", "") in _API_SKIP_NAMES:
            return func(*args, **kwargs)
        name = self.api_names.get(func)
        if name is None:
            try:
                name = self.api_names[func] = api_name(func)
            except TypeError:  # unhashable callable
                name = api_name(func)
        self.api_stack.append((name, args, kwargs))
        try:
            return func(*args, **kwargs)
        finally:
            self.api_stack.pop()


class _DispatchMode(TorchDispatchMode):
    """Sees every ATen op (the mode is popped by PyTorch while this runs, so our checks are not recorded)."""

    def __init__(self, switch: Switch, before: Callable, after: Callable, fail: Callable):
        super().__init__()
        self.switch, self.before, self.after, self.fail = switch, before, after, fail

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sw = self.switch
        if sw.busy or not sw.armed:
            return func(*args, **kwargs)
        pre = None
        sw.busy = True
        try:
            with torch._C.DisableTorchFunction():
                pre = self.before(func, args, kwargs)
        except Exception as e:  # the recorder must never break training
            self.fail(e)
        finally:
            sw.busy = False
        out = func(*args, **kwargs)
        if pre is not None:
            sw.busy = True
            try:
                with torch._C.DisableTorchFunction():   # autograd is already below this mode
                    self.after(func, args, kwargs, out, pre)
            except Exception as e:
                self.fail(e)
            finally:
                sw.busy = False
        return out


class _Paused:
    def __init__(self, switch: Switch) -> None:
        self.switch = switch

    def __enter__(self) -> None:
        self.prev = self.switch.busy
        self.switch.busy = True

    def __exit__(self, *exc) -> None:
        self.switch.busy = self.prev


class Modes:
    """The function + dispatch mode pair (and, if asked, autograd anomaly metadata).

    ``install`` pushes the function mode then the dispatch mode; ``remove`` pops each from wherever it
    sits in its stack, so modes that other code pushed on top of ours stay, in their order.
    ``api_stack`` holds (API name, args, kwargs) of the enclosing torch API calls, innermost last.
    """

    def __init__(self, switch: Switch, notes: list[str]) -> None:
        self.switch, self.notes = switch, notes
        self.api_stack: list[tuple[str, tuple, dict]] = []
        self._api_names: dict[Any, str] = {}
        self._fmode: _FunctionMode | None = None
        self._dmode: _DispatchMode | None = None
        self._anomaly_prev: tuple[bool, bool] | None = None

    def paused(self) -> _Paused:
        """Context manager: run code while armed without it being recorded."""
        return _Paused(self.switch)

    def enable_anomaly_metadata(self) -> None:
        """Anomaly mode without NaN checks: every autograd node keeps ``metadata["traceback_"]``."""
        try:
            self._anomaly_prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.set_anomaly_enabled(True, False)
        except Exception as e:
            self.notes.append(f"anomaly metadata unavailable: {e}")

    def install(self, before: Callable, after: Callable, fail: Callable) -> None:
        self._fmode = _FunctionMode(self.switch, self.api_stack, self._api_names)
        self._fmode.__enter__()
        self._dmode = _DispatchMode(self.switch, before, after, fail)
        self._dmode.__enter__()

    def remove(self) -> None:
        """Pop both modes (idempotent), restore anomaly mode, forget the API stack."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        for mode, getter, popper, pusher in (
                (self._dmode, _get_current_dispatch_mode_stack, _pop_dispatch, _push_dispatch),
                (self._fmode, _fn_stack, _pop_fn, _push_fn)):
            if mode is None:
                continue
            try:
                stack = getter()
                if mode in stack:
                    above = []
                    while stack and stack[-1] is not mode:  # foreign modes pushed after ours
                        above.append(popper())
                        stack = getter()
                    popper()
                    for m in reversed(above):
                        pusher(m)
            except Exception as e:
                self.notes.append(f"mode teardown: {type(e).__name__}: {e}")
        self._dmode = self._fmode = None

    def restore_anomaly(self) -> None:
        if self._anomaly_prev is not None:
            try:
                torch.set_anomaly_enabled(*self._anomaly_prev)
            except Exception:
                pass
            self._anomaly_prev = None


def _fn_stack() -> list:
    from torch.overrides import _get_current_function_mode_stack
    return _get_current_function_mode_stack()


def _pop_fn():
    from torch._C import _pop_torch_function_stack
    return _pop_torch_function_stack()


def _push_fn(m) -> None:
    from torch._C import _push_on_torch_function_stack
    _push_on_torch_function_stack(m)


def _pop_dispatch():
    from torch.utils._python_dispatch import _pop_mode
    return _pop_mode()


def _push_dispatch(m) -> None:
    from torch.utils._python_dispatch import _push_mode
    _push_mode(m)
