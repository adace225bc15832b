"""Where an equation was written: the user's frame of its ``source_info`` and its module path.

JAX records, for every equation of a jaxpr, the Python traceback of the ``bind`` that made it
(``eqn.source_info.traceback``) and the name stack of transforms and scopes around it
(``jvp(...)``, ``transpose(jvp(...))``, Flax Linen's module scopes). The origin line is the innermost
frame in the user's files (the script): for an op inside a built-in layer that is the line calling
the layer; for the equations JAX derives from an op (its JVP coefficients, its transpose) the frame
of the forward op's ``bind``, i.e. the forward line.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional, Sequence, Tuple

from ...core.locate.naming import UserFiles, resolved_dirs, stdlib_dirs

__all__ = ["Frame", "FrameFinder", "is_backward", "linen_scope"]

Frame = Tuple[str, int, str]        # (file, line, function)
_TRANSFORM = re.compile(r"^[A-Za-z_]+\((.*)\)$")


def _default_excluded() -> Tuple[str, ...]:
    import jax
    import numpy
    dirs = [os.path.dirname(os.path.dirname(os.path.realpath(jax.__file__))),
            os.path.dirname(os.path.realpath(numpy.__file__))]
    return resolved_dirs(list(stdlib_dirs()) + dirs)


class FrameFinder:
    """The innermost user frame of a traceback: a frame in ``user_files`` when they are given, else
    the core's rule (not the standard library, an installed package, JAX or nanguard)."""

    def __init__(self, user_files: Sequence[str] = (), user_file_filter: Optional[Callable[[str], bool]] = None):
        self.files = {os.path.realpath(f) for f in user_files if f}
        self._rule = UserFiles(_default_excluded(), user_file_filter)
        self._cache: dict = {}

    def is_user(self, fn: str) -> bool:
        u = self._cache.get(fn)
        if u is None:
            if self.files:
                u = fn in self.files or os.path.realpath(fn) in self.files
            else:
                u = self._rule(fn)
            self._cache[fn] = u
        return u

    def in_library(self, traceback: Any) -> bool:
        """The equation's innermost frame outside JAX is not the user's (an op inside a Flax / Equinox
        layer or an optax transform, called from the user's line)."""
        try:
            from jax._src import source_info_util as siu
            f = siu.user_frame(traceback)
        except Exception:
            return False
        return f is not None and not self.is_user(f.file_name)

    def frame(self, traceback: Any) -> Optional[Frame]:
        """(file, line, function) of the innermost user frame, or None."""
        if traceback is None:
            return None
        try:
            from jax._src import source_info_util as siu
            codes, lastis = traceback.raw_frames()
            for code, lasti in zip(codes, lastis):
                if self.is_user(code.co_filename):
                    f = siu.raw_frame_to_frame(code, lasti)
                    return (f.file_name, int(f.start_line), f.function_name)
        except Exception:
            return None
        return None


def is_backward(name_stack: str) -> bool:
    """The equation comes from a transpose (the backward pass of ``grad``/``vjp``)."""
    return "transpose(" in name_stack


def linen_scope(name_stack: str) -> Optional[str]:
    """The Linen scope path of a name stack (``transpose(jvp(Model))/Dense_1`` -> ``Dense_1``; the root
    module alone -> ""), or None when the stack names no module."""
    parts = [p for p in name_stack.split("/") if p]
    if not parts:
        return None
    head = parts[0]
    while True:
        m = _TRANSFORM.match(head)
        if not m:
            break
        head = m.group(1)
    if not head:
        return None
    return "/".join(parts[1:])
