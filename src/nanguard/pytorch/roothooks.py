"""The watcher's module hooks: a callback for each outermost module call, and almost no cost inside it.

``nanguard run`` must see every outermost module call of the script (the batch goes in there, the step
tape records it, an evaluation's output is checked there), so it registers torch's global forward
hooks, which run on every module call of the process. With any global hook, ``Module.__call__`` leaves
its fast path (~4 us a call on this CPU, whatever the hook does), and on a GPU, where the host's
dispatch sets the pace, that is the watcher's main cost. So while an outermost call runs, the two
global hooks are taken out of torch's hook tables, and a hook on that one module puts them back when it
returns or raises: the module calls it makes inside take the fast path.

They stay in while a second thread is known to make outermost calls (its calls would go unseen while
the hooks are out), inside backward (activation checkpointing re-runs blocks there), during a replay,
and for a module whose own hooks torch may not run (an overridden ``__call__``, a compiled call).
A ``BaseException`` raised inside a forward (KeyboardInterrupt) skips torch's always-called hooks, so
the hooks are put back at ``uninstall`` too.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, List, Optional

import torch
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

__all__ = ["RootHooks"]

_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"

Pre = Callable[[torch.nn.Module, tuple], Optional[tuple]]
Post = Callable[[torch.nn.Module, tuple, dict, Any], None]


class RootHooks:
    """Calls ``pre(module, args)`` and ``post(module, args, kwargs, output)`` around each outermost module
    call for which ``active()`` is true (it may raise to stop the run)."""

    def __init__(self, pre: Pre, post: Post, active: Callable[[], bool]) -> None:
        self._pre_cb, self._post_cb, self._active = pre, post, active
        self._local = threading.local()
        self._handles: List[Any] = []
        self._thread: Optional[int] = None  # the thread that made the outermost calls so far
        self._shared = False                # a second thread made one: the hooks stay in
        self._out: Any = None               # the root's own hook while the global ones are out
        self._filter: Any = None            # the warnings filter install() added

    @property
    def depth(self) -> int:
        """Module calls open in this thread (1 inside an outermost call whose inner calls are unseen)."""
        return getattr(self._local, "depth", 0)

    def install(self) -> None:
        self._handles = [torch_module.register_module_forward_pre_hook(self._pre),
                         torch_module.register_module_forward_hook(self._post, always_call=True, with_kwargs=True)]
        # a compiled module warns about global hooks at its calls: these are nanguard's, not the script's
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]

    def uninstall(self) -> None:
        self._put_back()
        for h in self._handles:
            h.remove()
        self._handles = []
        f, self._filter = self._filter, None
        if f is not None and f in warnings.filters:
            warnings.filters.remove(f)
            getattr(warnings, "_filters_mutated", lambda: None)()  # the registries' cache is stale

    # ------------------------------------------------------------------ the global hooks
    def _pre(self, module: torch.nn.Module, args: tuple) -> Optional[tuple]:
        loc = self._local
        d = getattr(loc, "depth", 0)
        loc.depth = d + 1
        if d or (_node is not None and _node() is not None) or not self._active():  # (_in_backward(), inline)
            return
        if _transformed():  # inside torch.func's vmap/grad: its tensors live only in the transform
            return
        res = self._pre_cb(module, args)  # the arguments to run with (the same, or a carried state put back)
        self._take_out(module)
        return res

    def _post(self, module: torch.nn.Module, args: tuple, *rest: Any) -> None:
        # (module, args, kwargs, output); torch calls an always_call hook as (module, args, output)
        # when the forward raised, even when it was registered with kwargs
        loc = self._local
        d = getattr(loc, "depth", 1) - 1
        loc.depth = d if d > 0 else 0
        if d > 0 or (_node is not None and _node() is not None) or not self._active() or _transformed():
            return
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0] if rest else None)
        self._post_cb(module, args, kwargs, output)

    # ------------------------------------------------------------------ out while a root runs
    def _take_out(self, module: torch.nn.Module) -> None:
        ident = threading.get_ident()
        if self._thread is None:
            self._thread = ident
        elif ident != self._thread:
            self._shared = True
        if self._shared or self._out is not None or len(self._handles) != 2 \
                or type(module).__call__ is not torch.nn.Module.__call__ \
                or getattr(module, "_compiled_call_impl", None) is not None:
            return
        try:
            self._out = _add_return_hook(module, self._root_return)
        except Exception:  # a module that takes no hooks: keep the global ones
            return
        torch_module._global_forward_pre_hooks.pop(self._handles[0].id, None)
        torch_module._global_forward_hooks.pop(self._handles[1].id, None)

    def _root_return(self, module: torch.nn.Module, args: tuple, *rest: Any) -> None:
        self._put_back()
        self._post(module, args, *rest)

    def _put_back(self) -> None:
        out, self._out = self._out, None
        if out is None:
            return
        if isinstance(out, tuple):
            hid, dicts = out
            for d in dicts:
                d.pop(hid, None)
        else:
            out.remove()
        # the ids stay in torch's always-called / with-kwargs tables: putting the function back is enough
        torch_module._global_forward_pre_hooks[self._handles[0].id] = self._pre
        torch_module._global_forward_hooks[self._handles[1].id] = self._post


_node = getattr(torch._C, "_current_autograd_node", None)  # not None inside backward (checkpointing)
# torch.func's transforms (vmap, grad, jacrev...) are running: a model called inside one (per-sample
# gradients, DP-SGD) gets wrapped tensors that are unusable once the transform returns, so a root call
# there is not a training forward, and its batch is read at the update instead (its gradients)
_transformed = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _add_return_hook(module: torch.nn.Module, fn: Callable[..., None]) -> Any:
    """``module.register_forward_hook(fn, always_call=True, with_kwargs=True)``, written into the
    module's hook tables directly, as that method does, under a fresh handle id: (id, tables) to pop
    it from. Once per outermost call, so without the handle object (its constructor and ``remove()``
    cost six Python calls); a module without those tables gets the public call (its handle)."""
    hooks = module.__dict__.get("_forward_hooks")
    kw = module.__dict__.get("_forward_hooks_with_kwargs")
    always = module.__dict__.get("_forward_hooks_always_called")
    if hooks is None or kw is None or always is None:
        return module.register_forward_hook(fn, always_call=True, with_kwargs=True)
    hid = RemovableHandle.next_id
    RemovableHandle.next_id = hid + 1
    hooks[hid] = fn
    kw[hid] = True
    always[hid] = True
    return hid, (hooks, kw, always)
