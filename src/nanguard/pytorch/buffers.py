"""A model's buffers walked once and reused while its module tree is unchanged: :class:`BufferCache`.

Some per-step work needs the buffers of the model (BatchNorm statistics and counters): the sync-free
mode's buffer latch (:class:`~nanguard.pytorch.detect.gate.BufferLatch`) and the per-step virtual
snapshot of recovery (:mod:`nanguard.pytorch.recover.forward`). ``module.named_buffers()`` walks the
whole module tree in Python (a generator frame per module: ~800 Python calls a step on a 12-layer GPT),
so the list is kept and reused while

* torch's global registration hooks saw no module or buffer registered anywhere since (a buffer
  assigned with ``module.x = tensor``, ``register_buffer``, a submodule added: they count them), and
* each buffer is still its owner's (``module.to()`` and ``_apply`` replace them without a hook), and
* the module is the one the list was made for (a list is keyed by ``id``, checked by a weak reference).

On a torch without the registration hooks the tree is walked every time.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Tuple

import torch

__all__ = ["BufferCache"]

_TREE = [0]        # registrations of modules and buffers seen by torch's global hooks (a module tree changed)
_HOOKS: list = []


def _watch_tree() -> None:
    """Count module and buffer registrations (installed once per process: a counter, nothing else)."""
    if _HOOKS:
        return
    try:
        from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                             register_module_module_registration_hook)
    except ImportError:
        return

    def bump(*_: Any) -> None:
        _TREE[0] += 1

    _HOOKS.extend([register_module_buffer_registration_hook(bump), register_module_module_registration_hook(bump)])


class BufferCache:
    """``named(m)``: ``m.named_buffers()`` as a list, walked once and reused (see the module docstring)."""

    def __init__(self) -> None:
        # id(module) -> (tree version, weakref to it, [(name, owner's _buffers, key, tensor)], [(name, tensor)])
        self._bufs: Dict[int, tuple] = {}
        _watch_tree()

    def named(self, m: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
        """``list(m.named_buffers())`` (the same list object while it is valid: do not modify it)."""
        c = self._bufs.get(id(m))
        if c is not None and c[0] == _TREE[0] and c[1]() is m and all([d.get(k) is b for _, d, k, b in c[2]]):
            return c[3]
        items = []
        for name, b in m.named_buffers():
            path, _, key = name.rpartition(".")
            items.append((name, (m.get_submodule(path) if path else m)._buffers, key, b))
        named = [(n, b) for n, _, _, b in items]
        self._bufs[id(m)] = (_TREE[0] if _HOOKS else None, weakref.ref(m), items, named)  # no hooks: walked each time
        return named
