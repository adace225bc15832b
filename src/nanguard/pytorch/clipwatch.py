"""Where the script clips its gradients: ``torch.nn.utils.clip_grad_norm_`` called before ``backward``.

A clip placed between the forward and ``loss.backward()`` finds no gradients (``zero_grad`` set them to
None) and clips nothing, so every update runs unclipped while the script reads as if it clipped (the
word_language_model loop with its two lines swapped). While ``nanguard run`` watches, the clip function is
wrapped to note, per call, whether any parameter it was given had a gradient; the diagnosis of a
divergence reads it (``run_context``: ``clip_before_backward``) and says to move the call. The note is
O(parameters) attribute reads per clip call, next to the clip's own per-parameter work.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Dict, Optional

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad

__all__ = ["ClipWatch"]

_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # nanguard's package directory


class ClipWatch:
    """Wraps ``clip_grad_norm_`` while installed; ``calls`` / ``empty`` count the calls and those that found
    no gradient; ``site`` is the user's line of the first empty one."""

    def __init__(self) -> None:
        self.calls = 0
        self.empty = 0
        self.site: Optional[Dict[str, Any]] = None
        self.first: Optional[Dict[str, Any]] = None  # the user's line of the first call that found gradients
        self._orig: Any = None
        self.returned: Any = None  # a weak reference to the norm the latest call returned

    def install(self) -> None:
        if self._orig is not None:
            return
        orig = self._orig = nn_utils.clip_grad_norm_
        watch = self

        def clip_grad_norm_(parameters: Any, *a: Any, **k: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            try:
                caller = sys._getframe(1)
                if not caller.f_code.co_filename.startswith(_OWN):  # recovery's own clip is not the script's
                    watch._note(params, caller)
            except Exception:  # a note must never break the script's clip
                pass
            out = orig(params, *a, **k)
            if isinstance(out, torch.Tensor):
                watch.returned = weakref.ref(out)  # the step's norm: a failure's leftover if read later
            return out

        clip_grad_norm_.__wrapped__ = orig  # type: ignore[attr-defined]
        nn_utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = clip_grad_norm_

    def uninstall(self) -> None:
        if self._orig is not None:
            nn_utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = self._orig
            self._orig = None

    def _note(self, params: list, frame: Any) -> None:
        self.calls += 1
        if any(p.grad is not None for p in params):
            if self.first is None and frame is not None:
                self.first = {"file": frame.f_code.co_filename, "line": frame.f_lineno}
            return
        self.empty += 1
        if self.site is None and frame is not None:
            self.site = {"file": frame.f_code.co_filename, "line": frame.f_lineno}

    def used(self) -> Optional[Dict[str, Any]]:
        """``{"calls", "file", "line"}`` of the script's clip when its calls found gradients to clip, else None."""
        if self.calls > self.empty and self.first is not None:
            return {"calls": self.calls, **self.first}
        return None

    def context(self) -> Optional[Dict[str, Any]]:
        """``{"calls", "line", "file"}`` when every clip call found no gradient (it runs before backward), else
        None."""
        if self.calls and self.empty == self.calls and self.site is not None:
            return {"calls": self.calls, **self.site}
        return None
