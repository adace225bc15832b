"""Naming what the recorder sees: tensors (parameters, buffers, gradients, optimizer state), modules
(the module whose forward is running), torch API calls and the user's frames and lines."""
from __future__ import annotations

import os
import re
import sys
import threading
import weakref
from typing import Any, Callable

import torch

from ...core.locate.naming import PACKAGE_DIR, UserFiles, resolved_dirs, stdlib_dirs, under

__all__ = ["api_name", "Frames", "Names", "ModuleTracker"]

_FRAME_RE = re.compile(r'File "(.*?)", line (\d+), in (.*)')

_API_MODULES = {"torch._C._VariableFunctions": "torch", "torch._C._VariableFunctionsClass": "torch",
                "torch._C._nn": "torch.nn.functional", "torch._C._linalg": "torch.linalg",
                "torch._C._special": "torch.special", "torch._C._fft": "torch.fft"}


def api_name(func: Any) -> str:
    """Readable name of a torch API callable: torch.log, Tensor.__truediv__, torch.nn.functional.kl_div."""
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    name = getattr(func, "__name__", qual)
    mod = getattr(func, "__module__", None)
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + name
    if mod in _API_MODULES:
        base = _API_MODULES[mod]
        for pre in ("linalg_", "special_", "fft_"):
            if base.endswith(pre[:-1]) and name.startswith(pre):
                name = name[len(pre):]
        return f"{base}.{name}"
    if mod:
        return f"{mod}.{qual}"
    return str(qual)


# ---------------------------------------------------------------------------- user frames
_OWN_DIRS = tuple(os.path.realpath(d) for d in (os.path.dirname(torch.__file__), PACKAGE_DIR))


def excluded_dirs() -> tuple[str, ...]:
    """Not the user's code: torch, nanguard and the standard library."""
    return resolved_dirs({os.path.dirname(torch.__file__), PACKAGE_DIR} | stdlib_dirs())


_FUNCTION_PY = os.path.join("torch", "autograd", "function.py")
_GRAPH_PY = os.path.join("torch", "autograd", "graph.py")
_ENGINE = "_engine_run_backward"   # torch.autograd.backward / grad call the C++ engine through it


class Frames:
    """The innermost frame of the user's code (not torch, not nanguard, not the standard library), and
    the innermost *library* frame below it (an installed package other than torch: transformers,
    accelerate...), where the op really ran when the user's line called into a library.

    During an in-process replay (:mod:`nanguard.pytorch.stepreplay`) the stack above the replayed
    call is nanguard's, not the user's: the replay sets ``boundary`` (the code object of its call
    trampoline) and ``site`` (the (user, library) frames recorded when the call first ran); a walk
    that reaches the boundary before any user frame answers with ``site``."""

    def __init__(self, user_file_filter: Callable[[str], bool] | None = None) -> None:
        self.user_file_filter = user_file_filter
        self.is_user = UserFiles(excluded_dirs(), user_file_filter)   # fn -> the user's file?
        self._lib: dict[str, bool] = {}
        # id(code object) -> (1 the user's, 2 a library's, 0 neither; the code object) (site_of)
        self._kind: dict[int, tuple] = {}
        self.boundary: Any = None
        self.site: tuple | None = None

    def is_library(self, fn: str) -> bool:
        """An installed package's file (site-packages) that is not torch or nanguard."""
        u = self._lib.get(fn)
        if u is None:
            u = False
            if fn and ("site-packages" in fn or "dist-packages" in fn) and not self.is_user(fn):
                try:
                    real = os.path.realpath(fn)
                except Exception:
                    real = fn
                u = not under(real, _OWN_DIRS)
            self._lib[fn] = u
        return u

    def user_frame(self) -> tuple[str, int, str] | None:
        """(file, line, function) of the innermost user frame on the current stack."""
        return self.site_of(sys._getframe(1))[0]

    def site_now(self) -> tuple:
        """(user frame, library frame) of the current stack (each (file, line, function) or None)."""
        return self.site_of(sys._getframe(1))

    def site_of(self, f: Any) -> tuple:
        """(user frame, innermost library frame below it) walking out from frame ``f``."""
        lib = None
        b = self.boundary
        # per code object, by its id (a code object hashes its name, constants and bytecode on every
        # lookup: ~2 us a frame under a dict keyed by it); the entry keeps the code alive, so its id
        # cannot be reused while the entry exists
        kinds = self._kind
        while f is not None:
            code = f.f_code
            if b is not None and code is b:
                site = self.site or (None, None)
                return site[0], lib or site[1]
            k = kinds.get(id(code))
            if k is None:
                fn = code.co_filename
                k = 1 if self.is_user(fn) else 2 if self.is_library(fn) else 0
                kinds[id(code)] = (k, code)
            else:
                k = k[0]
            if k == 1:
                return (code.co_filename, f.f_lineno, code.co_name), lib
            if lib is None and k == 2:
                lib = (code.co_filename, f.f_lineno, code.co_name)
            f = f.f_back
        return None, lib

    def called_back(self, f: Any) -> bool:
        """Whether the innermost user frame walking out from frame ``f`` was called by the autograd engine: the
        user's own code run inside a backward (a hook on a tensor or module), not a built-in backward formula,
        whose ops run under the user frame that called ``backward()``."""
        user = False
        while f is not None:
            code = f.f_code
            if not user:
                user = self.is_user(code.co_filename)
            elif code.co_name == _ENGINE and code.co_filename.endswith(_GRAPH_PY):
                return True
            f = f.f_back
        return False

    def applied_at(self, f: Any) -> tuple | None:
        """Walking out from frame ``f`` (an op in the forward of a ``torch.autograd.Function``): the user
        frame that called the Function's ``apply``, or None."""
        applied = False
        while f is not None:
            code = f.f_code
            if applied and self.is_user(code.co_filename):
                return code.co_filename, f.f_lineno, code.co_name
            if code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_PY):
                applied = True
            f = f.f_back
        return None

    def from_traceback(self, tb: Any) -> tuple[str, int, str] | None:
        """Innermost user frame of anomaly metadata (list of formatted stack strings)."""
        if not tb:
            return None
        entries = tb if isinstance(tb, (list, tuple)) else [tb]
        for entry in reversed(list(entries)):
            for m in reversed(list(_FRAME_RE.finditer(str(entry)))):
                fn, line, func = m.group(1), int(m.group(2)), m.group(3).strip()
                if self.is_user(fn):
                    return fn, line, func
        return None


# ---------------------------------------------------------------------------- tensors
class Names:
    """Names of parameters (the caller's, else a module path, else an optimizer slot), buffers,
    gradients and optimizer state, by object id and by storage (views and ``.data`` share it).
    ``named_params`` / ``named_buffers`` are the caller's dicts (read, never mutated; they may grow
    after start()); ``optimizers`` the caller's list (optimizers found on the stack are appended)."""

    def __init__(self, named_params: dict, named_buffers: dict, optimizers: list, notes: list[str]) -> None:
        self.named_params, self.named_buffers = named_params, named_buffers
        self.optimizers, self.notes = optimizers, notes
        self.param_ids: dict[int, str] = {}
        self.buffer_ids: dict[int, str] = {}
        self.param_storage: dict[int, str] = {}
        self.buffer_storage: dict[int, str] = {}
        self.grad_ids: dict[int, str] = {}
        self.state_ids: dict[int, tuple[str, str]] = {}
        self.params: dict[int, torch.Tensor] = {}     # every known parameter, by id
        self.param_prio: dict[int, int] = {}          # 3: caller's name, 2: module path, 1: optimizer slot

    def name_param(self, p: Any, name: str, prio: int) -> None:
        """Remember a parameter's name; a better source (higher prio) replaces a worse one."""
        if not isinstance(p, torch.Tensor) or self.param_prio.get(id(p), 0) > prio:
            return
        self.param_ids[id(p)] = name
        self.param_prio[id(p)] = prio
        self.params[id(p)] = p
        try:
            sp = p.untyped_storage().data_ptr()
            if sp:
                self.param_storage[sp] = name
        except Exception:
            pass

    def name_buffer(self, b: Any, name: str, prio: int) -> None:
        if not isinstance(b, torch.Tensor) or (id(b) in self.buffer_ids and prio < 3):
            return
        self.buffer_ids[id(b)] = name
        try:
            sp = b.untyped_storage().data_ptr()
            if sp:
                self.buffer_storage[sp] = name
        except Exception:
            pass

    def sync_given(self) -> None:
        """Pick up names the caller added to its dicts after construction."""
        for name, p in list(self.named_params.items()):
            if self.param_ids.get(id(p)) != name:
                self.name_param(p, name, 3)
        for name, b in list(self.named_buffers.items()):
            if self.buffer_ids.get(id(b)) != name:
                self.name_buffer(b, name, 3)

    def index_known(self) -> None:
        """At start(): the caller's names, existing gradients, the optimizers' parameters and state."""
        self.sync_given()
        for pid, p in list(self.params.items()):
            if p.grad is not None:
                self.grad_ids[id(p.grad)] = self.param_ids[pid]
        for opt in self.optimizers:
            self.name_optimizer_params(opt)
        self.index_optimizer_state()

    def name_optimizer_params(self, opt: torch.optim.Optimizer) -> None:
        """Parameters of an optimizer that nobody named get their slot as name."""
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                self.name_param(p, f"param_groups[{gi}].params[{pi}]", 1)

    def discover_optimizer(self) -> None:
        """The optimizer whose step() is running (found on the Python stack), if the caller did not pass it."""
        f = sys._getframe(1)
        while f is not None:
            obj = f.f_locals.get("self")
            if isinstance(obj, torch.optim.Optimizer):
                if not any(o is obj for o in self.optimizers):
                    self.optimizers.append(obj)
                    self.notes.append(f"optimizer {type(obj).__name__} found on the stack")
                    self.name_optimizer_params(obj)
                    self.index_optimizer_state()
                return
            f = f.f_back

    def index_optimizer_state(self) -> None:
        for opt in self.optimizers:
            for p, st in list(opt.state.items()):
                pname = self.param_ids.get(id(p), "?")
                if isinstance(st, dict):
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor):
                            self.state_ids[id(v)] = (pname, k)

    def param_name(self, t: torch.Tensor) -> tuple[str, str | None] | None:
        """('param'|'buffer', name) when ``t`` is (a view of) a known parameter or buffer."""
        if id(t) in self.param_ids:
            return "param", self.param_ids[id(t)]
        if id(t) in self.buffer_ids:
            return "buffer", self.buffer_ids[id(t)]
        try:
            sp = t.untyped_storage().data_ptr()
        except Exception:
            sp = None
        if sp and sp in self.param_storage:
            return "param", self.param_storage[sp]
        if sp and sp in self.buffer_storage:
            return "buffer", self.buffer_storage[sp]
        if isinstance(t, torch.nn.Parameter):
            return "param", None
        return None

    def kind_of(self, t: torch.Tensor) -> tuple[str, str | None]:
        """What a tensor that existed before the step is: ('data'|'param'|'buffer'|'optimizer_state', name)."""
        kind, name = "data", None
        try:
            sp = t.untyped_storage().data_ptr()
        except Exception:
            sp = None
        if id(t) in self.param_ids:
            kind, name = "param", self.param_ids[id(t)]
        elif id(t) in self.buffer_ids:
            kind, name = "buffer", self.buffer_ids[id(t)]
        elif id(t) in self.grad_ids:
            kind, name = "param", self.grad_ids[id(t)] + ".grad"
        elif id(t) in self.state_ids:
            kind, name = "optimizer_state", "{}:{}".format(*self.state_ids[id(t)])
        elif sp and sp in self.param_storage:
            kind, name = "param", self.param_storage[sp]
        elif sp and sp in self.buffer_storage:
            kind, name = "buffer", self.buffer_storage[sp]
        return kind, name


# ---------------------------------------------------------------------------- modules
def owner_in_frames(mod: torch.nn.Module, frame: Any, depth: int = 40) -> torch.nn.Module | None:
    """The largest module held by a variable of a calling frame that contains ``mod`` as a descendant: the
    model whose child the script (or ``checkpoint_sequential``, a loop over ``model.layers``) calls directly,
    so the child is named by its path in that model ('5'), not as a model of its own (''). Runs once per
    module first seen at top level."""
    best, size, seen = None, 0, set()
    f = frame
    while f is not None and depth > 0:
        for scope in (f.f_locals, f.f_globals if f.f_back is None or f.f_globals is not f.f_back.f_globals else {}):
            for v in list(scope.values()):
                if isinstance(v, torch.nn.Module) and v is not mod and id(v) not in seen:
                    seen.add(id(v))
                    subs = list(v.modules())
                    if len(subs) > size and any(m is mod for m in subs):
                        best, size = v, len(subs)
        f, depth = f.f_back, depth - 1
    return best


class ModuleTracker:
    """The module whose forward is running (its path and type), from global module forward hooks.

    Like ``torch.utils.module_tracker.ModuleTracker``: the hooks are registered by ``install()`` and
    removed by ``remove()``; only calls on the recording thread while ``switch.armed`` count. A
    module called at top level becomes a root (its subtree is named from it, its parameters get
    module paths); an unregistered child inherits its caller's path."""

    def __init__(self, names: Names, switch: Any) -> None:
        self.names, self.switch = names, switch
        self.mod_names: dict[int, str] = {}
        self.mod_types: dict[int, str] = {}
        self.stack: list[str] = []
        self.type_stack: list[str] = []
        self._hooks: list[Any] = []
        self._thread: int | None = None
        self.batch_size: int | None = None   # leading dimension of the first top-level call's first tensor
        self._flat_batch = False  # the first top-level call's first tensor was 1-D: its output decides
        self.batch_inputs: list = []          # weak references to that call's batch-shaped tensor arguments

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    @property
    def current_type(self) -> str | None:
        return self.type_stack[-1] if self.type_stack else None

    def register_tree(self, root: torch.nn.Module, overwrite: bool = False) -> None:
        """Module paths (and, when the caller named no parameters, parameter names) under ``root``."""
        while hasattr(root, "_orig_mod") and type(root).__name__ == "OptimizedModule":
            root = root._orig_mod  # torch.compile's wrapper: the model's own paths, not "_orig_mod.*"
        try:
            for name, m in root.named_modules(remove_duplicate=False):
                if overwrite:
                    self.mod_names[id(m)] = name
                else:
                    self.mod_names.setdefault(id(m), name)
                self.mod_types[id(m)] = type(m).__name__
            for name, p in root.named_parameters(remove_duplicate=False):
                self.names.name_param(p, name, 2)
            for name, b in root.named_buffers(remove_duplicate=False):
                self.names.name_buffer(b, name, 2)
        except Exception:
            pass

    def install(self, thread: int) -> None:
        from torch.nn.modules import module as _m
        self._thread = thread
        self._hooks.append(_m.register_module_forward_pre_hook(self._pre))
        self._hooks.append(_m.register_module_forward_hook(self._post, always_call=True, with_kwargs=True))

    def remove(self) -> None:
        for h in self._hooks:
            try:
                h.remove()
            except Exception:
                pass
        self._hooks = []
        self.stack.clear()
        self.type_stack.clear()

    def _pre(self, mod, args) -> None:
        if not self.switch.armed or threading.get_ident() != self._thread:
            return
        name = self.mod_names.get(id(mod))
        if name is None:
            if not self.stack:               # a module called at top level: a root
                self._note_batch(args)
                self.register_tree(mod, overwrite=True)
                name = self.mod_names.get(id(mod), "")
            else:                            # unregistered child: attribute to its caller
                name = self.stack[-1]
                self.mod_names[id(mod)] = name
                self.mod_types[id(mod)] = type(mod).__name__
        elif not self.stack:
            self._note_batch(args)
        self.stack.append(name)
        self.type_stack.append(type(mod).__name__)

    def _note_batch(self, args: Any, out: Any = None, flat_ok: bool = False) -> None:
        """The batch size: the leading dimension of the first top-level call's first tensor. A 1-D first
        tensor is a flat stream (EmbeddingBag's tokens with offsets, one id per sample) whose length need
        not be the number of samples: the call's output rows decide (``_post`` calls back with ``out``)."""
        if self.batch_size is not None:
            return
        t = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
        if t is None:
            return
        if t.dim() == 1 and not flat_ok:
            self._flat_batch = True
            return
        rows = out if isinstance(out, torch.Tensor) and out.dim() >= 1 else t
        self.batch_size = int(rows.shape[0])
        self.batch_inputs = [weakref.ref(a) for a in args if isinstance(a, torch.Tensor)
                             and a.dim() >= 1 and a.shape[0] == self.batch_size]

    def _post(self, mod, args, *rest) -> None:
        # (mod, args, kwargs, out); (mod, args, out) when the forward raised (torch's always_call path)
        kwargs = rest[0] if len(rest) == 2 else None
        if self.switch.armed and self.stack and threading.get_ident() == self._thread:
            if len(self.stack) == 1 and kwargs:   # model(**batch): the batch is in the keyword arguments
                self._note_batch(tuple(kwargs.values()))
            if len(self.stack) == 1 and self._flat_batch and self.batch_size is None:
                self._flat_batch = False
                self._note_batch(args, rest[-1] if rest else None, flat_ok=True)
            self.stack.pop()
            if self.type_stack:
                self.type_stack.pop()
