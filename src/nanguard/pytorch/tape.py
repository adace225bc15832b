"""The step tape: what zero-code runs keep of the current training step to replay it in-process.

``nanguard run`` and ``nanguard.watch()`` cannot call the user's inline training step again. The tape
records, while the step runs, the calls that make its loss, so that a failing step can be replayed
in the same process under the op recorder (:mod:`nanguard.pytorch.stepreplay`) instead of re-running
the whole script up to it. Three kinds of entries, in program order:

* ``module``: each outermost module call made with grad enabled (the watcher's global module hooks
  see it anyway): the module, its arguments, the torch RNG state, grad/autocast mode and the user's
  call site (the innermost user frame, and the innermost library frame below it);
* ``call``: each torch API call made *between* the end of a module call and the next module call or
  backward (the loss code: ``F.cross_entropy(out.view(-1, V), y)``, ``loss + 0.01 * reg``...), seen by
  a ``TorchFunctionMode`` that is pushed only in that region, so the model's own ops pay nothing;
  it is popped in ``Optimizer.zero_grad``/``Module.zero_grad`` and ``DataLoader.__next__``;
* ``backward``: each backward call (the tensors and gradient tensors, and the loss values).

Arguments are templates: a tensor made by an earlier entry is a reference (entry, output slot), known
by identity at record time only (weak references, so activations are not kept alive); any other
tensor (the batch, targets, masks, parameters) is *external*, held by reference with its version
counter. What the tape adds per healthy step is O(1) Python work outside the model's own ops: two
hook bodies per outermost module call (one ``torch.get_rng_state()``, a frame walk, the argument
templates), one mode handler per loss-code call, a wrapper around backward and zero_grad, and a
reset per optimizer step. No tensor is copied and no host sync is made.

The tape is *incomplete* (and localization falls back to re-running the script) when the loss was
not made from recorded calls, when an external tensor already carries autograd history or was
modified in place after it was recorded, when a call budget is exceeded (a loss written as hundreds
of torch calls: after three such steps in a row the tape turns itself off), or when a replay does
not give back the recorded loss bit for bit.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from .locate.naming import Frames, api_name
from .numerics import to_float32, version

__all__ = ["StepTape", "Entry", "Ref", "Ext", "tensor_leaves", "rng_now", "set_rng"]

_MAX_LEAVES = 64
_MAX_DEPTH = 4
# Calls that end the loss region (the Tensor.backward wrapper closes it; these must not be recorded).
_NOT_RECORDED = {"backward", "grad", "register_hook", "retain_grad", "__del__"}
_OFF_AFTER = 3  # consecutive over-budget steps after which the tape turns itself off
_PLAIN = frozenset({int, float, bool, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device})


class Ref:
    """Output ``slot`` of entry ``entry``."""
    __slots__ = ("entry", "slot")

    def __init__(self, entry: int, slot: int) -> None:
        self.entry, self.slot = entry, slot


class Ext:
    """External tensor number ``i`` of the tape."""
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _region_closing(tape: "StepTape", orig: Any) -> Any:
    """``Tensor.backward`` that ends the tape's region first (torch's dispatch must not see it). A backward
    that keeps its graph (``retain_graph``/``create_graph``: another loss of the same forward follows, e.g.
    ``l1.backward(retain_graph=True); l2 = torch.log(t) - head(h); l2.backward()``) opens it again as it
    returns, so the next loss's calls before its first module call are recorded (they were not: a NaN
    born there read as bad input data)."""
    def backward(self, *a, **k):
        tape._later = None
        if tape._pushed or tape._stale:
            tape.close()
        out = orig(self, *a, **k)
        keep = k.get("retain_graph", a[1] if len(a) > 1 else None)
        if keep is None:
            keep = k.get("create_graph", a[2] if len(a) > 2 else False)
        if keep and tape.trained:
            tape.open()
        return out
    return backward


def _opening_after(tape: "StepTape", orig: Any) -> Any:
    """``record_function.__exit__`` that opens a region deferred to it (:meth:`StepTape.reset`): the
    optimizer's own profiler range ends after its post hooks, and that exit is a torch op, which would
    otherwise go through the tape's function mode every step (torch's Python override path)."""
    def __exit__(self, *exc):
        try:
            return orig(self, *exc)
        finally:
            if tape._later is not None and tape._later == _ident():
                tape.open()
    return __exit__


_NANGUARD_DIR = __file__.rsplit("/", 2)[0] + "/"  # .../nanguard/


def _unrecorded(tape: "StepTape", orig: Any) -> Any:
    """A ``zero_grad`` run outside the tape's region (pause/resume inline: a generator context manager
    would cost six Python calls more, every step)."""
    def zero_grad(self, *a, **k):
        if _NANGUARD_DIR not in sys._getframe(1).f_code.co_filename:  # the script's own (not a replay's)
            tape.zero_grads += 1  # (a run that never resets its gradients accumulates them: run_context)
            tape.zeroed_at = tape.step
        if not tape._pushed and tape._later is None:
            return orig(self, *a, **k)
        tape.close()
        try:
            return orig(self, *a, **k)
        finally:
            tape.resume(True)
    return zero_grad


_new = object.__new__  # Ref/Ext on the hot path: made without an __init__ frame
_ident = threading.get_ident
_grad_on, _inference_on, _autocast_on = \
    torch.is_grad_enabled, torch.is_inference_mode_enabled, torch._C._is_any_autocast_enabled
_RANGE = torch.autograd.profiler.record_function
_detach = torch.Tensor.detach


class Entry:
    """One recorded call. ``kind``: 'module' | 'call' | 'backward'; ``fn``: the module, the torch
    callable, or None for backward; ``args``/``kwargs``: templates; ``site``: (user frame, library
    frame) of the call; ``rng``: torch RNG state before a module call; ``loss``: detached tensors
    given to backward (the recorded values a replay must give back)."""
    __slots__ = ("kind", "fn", "args", "kwargs", "grad", "inference", "autocast", "site", "rng", "loss")

    def __init__(self, kind: str, fn: Any, args: Any, kwargs: Any, site: tuple) -> None:
        self.kind, self.fn, self.args, self.kwargs, self.site = kind, fn, args, kwargs, site
        self.grad = g = _grad_on()
        self.inference = False if g else _inference_on()  # (inference mode turns grad off)
        self.autocast = _autocast_state() if _autocast_on() else None
        self.rng: Any = None
        self.loss: Optional[List[torch.Tensor]] = None


def _autocast_state() -> Optional[Tuple]:
    out = []
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                out.append((dev, torch.get_autocast_dtype(dev)))
        except Exception:
            pass
    return tuple(out)


def rng_now() -> Tuple[torch.Tensor, Any]:
    """torch's CPU RNG state, and the current CUDA device's when CUDA is initialised (no sync)."""
    global _cuda_available
    cuda = None
    if _cuda_available is None:
        try:
            _cuda_available = torch.cuda.is_available()  # asked once (a driver query), not every call
        except Exception:
            _cuda_available = False
    if _cuda_available and torch.cuda.is_initialized():
        try:
            cuda = (torch.cuda.current_device(), torch.cuda.get_rng_state())
        except Exception:
            cuda = None
    return _CPU_GEN.get_state(), cuda  # (what torch.get_rng_state() returns, without its Python frame)


_cuda_available: Optional[bool] = None
_CPU_GEN = torch.default_generator
_NULL = contextlib.nullcontext()


def set_rng(st: Tuple[torch.Tensor, Any]) -> None:
    """Inverse of :func:`rng_now`."""
    cpu, cuda = st
    torch.set_rng_state(cpu)
    if cuda is not None:
        try:
            torch.cuda.set_rng_state(cuda[1], cuda[0])
        except Exception:
            pass


def tensor_leaves(obj: Any, out: Optional[list] = None, depth: int = 0) -> list:
    """The tensors inside an output (tensors, lists, tuples, dicts incl. model-output dicts), in order."""
    if out is None:
        if isinstance(obj, torch.Tensor):
            return [obj]
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < _MAX_DEPTH and len(out) < _MAX_LEAVES:
        if isinstance(obj, (tuple, list)):
            for o in obj:
                tensor_leaves(o, out, depth + 1)
        elif isinstance(obj, dict):
            for o in obj.values():
                tensor_leaves(o, out, depth + 1)
    return out


@functools.lru_cache(maxsize=4096)  # per recorded call: a C-level cache hit, no Python frame
def _inplace_name(name: str) -> bool:
    """A call of this name writes its first argument in place (``add_``, ``__iadd__``, ``__setitem__``);
    a call given ``out=`` writes that (tested apart)."""
    return (name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))
            or (name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__iter__",
                                                                                   "__index__", "__int__")))


class _UserWarnings:
    """While a recorded call runs, a warning it raises (``std(): degrees of freedom is <= 0``) is shown
    at the user's line that made the call, as without nanguard, not at the mode handler's frame: the
    warning machinery's ``showwarning`` is swapped for the call (one attribute write each way, inline in
    :meth:`StepTape.call`: ``orig`` is the one it replaced, ``show`` the replacement)."""

    def __init__(self, frames: Frames) -> None:
        self.frames = frames
        self.orig: Any = None

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        warnings.showwarning = self.orig   # re-emitted once, with the user's location and registry
        try:
            user = self.frames.site_of(sys._getframe(1))[0]
            if user is None or file is not None:
                self.orig(message, category, filename, lineno, file, line)
                return
            g = sys._getframe(1)
            while g is not None and g.f_code.co_filename != user[0]:
                g = g.f_back
            registry = g.f_globals.setdefault("__warningregistry__", {}) if g is not None else None
            warnings.warn_explicit(message, category, user[0], user[1], registry=registry)
        finally:
            warnings.showwarning = self.show


_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential", "gumbel",
           "random", "poisson", "cauchy", "geometric", "shuffle", "perm", "sample")


@functools.lru_cache(maxsize=4096)  # per recorded call: a C-level cache hit, no generator frame
def _random(name: str) -> bool:
    """A call that may draw from torch's RNG (its state is kept, so a replay draws the same numbers)."""
    return any(r in name for r in _RANDOM)


class _TapeMode(TorchFunctionMode):
    """Records the loss code's torch calls (pushed only between a module call and backward)."""

    def __init__(self, tape: "StepTape") -> None:
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.tape.float32:  # recovery ran the loss code in float32 (:meth:`StepTape.loss_in_float32`)
            return _in_float32(self.tape, func, args, kwargs or {})
        return self.tape.call(func, args, kwargs or {})


def _in_float32(tape: "StepTape", func: Any, args: tuple, kwargs: dict) -> Any:
    """One loss-code call with its float16/bfloat16 inputs as float32 copies and autocast off (an in-place
    call, or one given ``out=``, runs as written: a copy would not be written back)."""
    if not (_inplace_name(getattr(func, "__name__", "")) or kwargs.get("out") is not None):
        args, kwargs = to_float32(args), to_float32(kwargs)
    with torch.autocast("cpu", enabled=False), \
            (torch.autocast("cuda", enabled=False) if _cuda_available else _NULL):
        return tape.call(func, args, kwargs)


def _pop_mode(mode: TorchFunctionMode) -> bool:
    """Pop ``mode`` from wherever it sits in torch's function-mode stack, keeping the modes pushed after
    it (the user's) in order; False when it is not there. (Inside the mode's own handler torch has
    popped it and pushes it back on return: the tape then marks itself stale, and removes the mode
    at the next boundary; the handler ignores calls meanwhile.)"""
    n = torch._C._len_torch_function_stack()
    if n and torch._C._get_function_stack_at(n - 1) is mode:
        torch._C._pop_torch_function_stack()
        return True
    if not any(torch._C._get_function_stack_at(i) is mode for i in range(n)):
        return False
    above = []
    while torch._C._len_torch_function_stack():
        m = torch._C._pop_torch_function_stack()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
    return True


class StepTape:
    """The replayable record of the current step (see the module docstring)."""

    def __init__(self, max_entries: int = 256, max_calls: int = 256, max_pre_calls: int = 64) -> None:
        self.max_entries, self.max_calls, self.max_pre_calls = max_entries, max_calls, max_pre_calls
        self.frames = Frames()
        self._warn = _UserWarnings(self.frames)
        self.mode = _TapeMode(self)
        self.enabled = True
        self.off_reason: Optional[str] = None   # why the tape turned itself off for the run
        self.pre_off = False                    # the region before the first module call is no longer recorded
        self._over_budget = 0
        self._pre_over = 0
        self._pushed, self.zero_grads, self.zeroed_at = False, 0, -1  # the script's zero_grad calls, the last's step
        self._later: Optional[int] = None  # the thread whose region opens at its next profiler-range exit
        self._stale = False     # our mode may sit in the stack although closed (closed inside a handler)
        self._installed = False
        self._orig: Dict[str, Any] = {}
        self._pending: Optional[Entry] = None
        self._pending_new: Dict[int, tuple] = {}
        self.incomplete: Optional[str] = None
        self.entries: List[Entry] = []
        self.pre_truncated = False
        self.trained = False        # this step recorded a grad-enabled module call or a backward
        self.ever_trained = False   # a backward was recorded in this run
        self.window_left = 20_000   # calls an inference script may still have recorded (a sliding window)
        self.float32 = False        # recovery: the loss code runs in float32 (:meth:`loss_in_float32`)
        self.reset(0, open_region=False)

    def loss_in_float32(self) -> Optional[Dict[str, Any]]:
        """Recovery's upcast of an op outside every module (the loss code, under torch.autocast or on a
        half-precision model's output): from now on the calls between the model's output and backward run
        in float32. None when the tape is off (its region is where those calls are seen)."""
        if not self.enabled:
            return None
        self.float32 = True
        return {"dtype_before": "float16/bfloat16", "dtype_after": "float32", "module": None,
                "scope": "the loss code (the torch calls between the model's output and backward: their "
                         "half-precision inputs cast to float32, autocast off)"}

    # ------------------------------------------------------------------ state
    def reset(self, step: int, open_region: bool = True, later: bool = False) -> None:
        """A new step starts (after an optimizer step, or a backward pass in backward counting).
        ``later``: called from an optimizer's post hook: the region opens when the optimizer's profiler
        range exits (``record_function``), else at the next ``zero_grad`` or batch fetch."""
        self.close()
        self._adapt()
        self.step = step
        self.trained = False
        self._clear()
        self.pre_truncated = self.pre_off
        if open_region and not self.pre_off:  # the calls that build the batch, before the model's first call
            if later:
                self._later = _ident()
            else:
                self.open()

    def before_update(self, step: int) -> None:
        """An optimizer is about to update: close an open region, and number what the tape holds since the
        last update with that update's step (its failure must find its own step here)."""
        self._later = None
        if self._pushed or self._stale:
            self.close()
        self.step = step

    def _clear(self) -> None:
        self.entries = []
        self.ext: List[torch.Tensor] = []
        # version counters (None for an inference tensor: it has none, and cannot be written in place
        # outside inference mode, so it is a constant of the step)
        self.ext_ver: List[Optional[int]] = []
        self.ext_written: Dict[int, int] = {}         # external -> the position of its last in-place write
        self.writers: Dict[tuple, List[int]] = {}    # (entry, slot) -> calls that wrote that output in place
        self.param_writes: Dict[int, dict] = {}      # id(parameter) -> the last recorded in-place write to it
        self._ext_ids: Dict[int, int] = {}
        self._prod: Dict[int, Tuple[int, int, Any]] = {}  # id(tensor) -> (entry, slot, weakref)
        self._calls = 0
        self._rng_dirty = True
        self.incomplete = None

    def eval_reset(self) -> None:
        """Evaluation or inference (no training in this step): keep only what follows (a window)."""
        self._clear()
        self.pre_truncated = False

    def _adapt(self) -> None:
        """Budgets: a step over them is not replayable; three in a row turn the part off for the run."""
        if self.incomplete == "over budget":
            self._over_budget += 1
            if self._over_budget >= _OFF_AFTER and self.enabled:
                self.enabled = False
                self.off_reason = (f"the loss code made more than {self.max_calls} torch calls per step in "
                                   f"{_OFF_AFTER} steps in a row: the step tape is off for this run")
        elif self.entries:
            self._over_budget = 0
        if self.pre_truncated and not self.pre_off and self.entries:
            self._pre_over += 1
            if self._pre_over >= _OFF_AFTER:
                self.pre_off = True  # e.g. an EMA update of every parameter between steps
        elif self.entries:
            self._pre_over = 0

    def _mark(self, why: str) -> None:
        if self.incomplete is None:
            self.incomplete = why

    @property
    def recording(self) -> bool:
        return self.enabled and self.incomplete is None

    # ------------------------------------------------------------------ the function mode region
    def open(self) -> None:
        self._later = None
        if self._stale:
            self._remove()
        if not self._pushed and self.enabled and self.incomplete is None:  # (self.recording, inline)
            torch._C._push_on_torch_function_stack(self.mode)
            self._pushed = True

    def close(self) -> None:
        self._later = None
        if self._pushed or self._stale:
            self._pushed = False
            self._remove()

    def _remove(self) -> None:
        self._stale = not _pop_mode(self.mode)

    def pause(self) -> bool:
        was = self._pushed or self._later is not None
        if was:
            self.close()
        return was

    def resume(self, was: bool) -> None:
        if was:
            self._rng_dirty = True  # what ran unrecorded (a sampler) may have drawn random numbers
            self.open()

    # ------------------------------------------------------------------ templates
    # (The hot path: a handful of these run for every recorded call of every step. Tensors are looked up
    # inline and Ref/Ext objects made with object.__new__, so a template costs one Python call per
    # container, none per tensor or plain value.)
    def _tensor(self, t: torch.Tensor, new: Dict[int, tuple]) -> Any:
        tid = id(t)
        p = self._prod.get(tid)
        if p is not None and p[2]() is t:
            r = _new(Ref)
            r.entry, r.slot = p[0], p[1]
            return r
        i = self._ext_ids.get(tid)
        if i is not None:
            x = _new(Ext)
            x.i = i
            return x
        n = new.get(tid)
        if n is None:  # provisional: registered only if the call is recorded
            x = _new(Ext)
            x.i = len(self.ext) + len(new)
            try:
                ver = t._version
            except Exception:  # inference tensors have no version counter
                ver = None
            n = new[tid] = (x, t, ver)
        return n[0]

    def _template(self, obj: Any, new: Dict[int, tuple], depth: int = 0) -> Any:
        t = type(obj)
        if t in _PLAIN:
            return obj
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, new)
        if depth >= _MAX_DEPTH:
            return obj
        if t is tuple or t is list:
            out = []
            for o in obj:
                if type(o) in _PLAIN:
                    out.append(o)
                elif isinstance(o, torch.Tensor):
                    out.append(self._tensor(o, new))
                else:
                    out.append(self._template(o, new, depth + 1))
            return out if t is list else tuple(out)
        if t is dict:
            d = {}
            for k, v in obj.items():
                if type(v) in _PLAIN:
                    d[k] = v
                elif isinstance(v, torch.Tensor):
                    d[k] = self._tensor(v, new)
                else:
                    d[k] = self._template(v, new, depth + 1)
            return d
        return obj

    def _commit(self, new: Dict[int, tuple]) -> None:
        """The external tensors a recorded call read for the first time (with their version before it)."""
        for ref, t, ver in new.values():
            self._ext_ids[id(t)] = ref.i
            self.ext.append(t)
            self.ext_ver.append(ver)

    def _register(self, idx: int, leaves: list) -> None:
        """The outputs of entry ``idx``: (entry, slot, weak reference) by identity (a Ref is made only
        when a later call reads one)."""
        prod = self._prod
        for j, t in enumerate(leaves):
            prod[id(t)] = (idx, j, weakref.ref(t))

    def _add(self, e: Entry) -> Optional[int]:
        if len(self.entries) >= self.max_entries:
            self._mark("over budget")
            self.close()
            return None
        self.entries.append(e)
        return len(self.entries) - 1

    # ------------------------------------------------------------------ hooks (called by the watcher)
    def root_pre(self, module: torch.nn.Module, args: tuple, caller: Any = None) -> None:
        """An outermost module call starts. Always ends the region; records with grad enabled.
        ``caller``: the frame that made the module call (the walk to the user's line starts there;
        default: this method's caller)."""
        self._later = None
        if self._pushed or self._stale:
            self.close()
        self._pending = None
        if not self.enabled or self.incomplete is not None:  # (self.recording, inline)
            return
        if not torch.is_grad_enabled():
            if self.trained:  # e.g. a frozen teacher inside a training step: its output is data
                return
            self.eval_reset()  # evaluation: the tape keeps this call and what follows it
        new: Dict[int, tuple] = {}
        e = Entry("module", module, self._template(args, new), None,
                  self.frames.site_of(caller if caller is not None else sys._getframe(1)))
        e.rng = rng_now()
        self._pending = e
        self._pending_new = new

    def root_post(self, module: torch.nn.Module, kwargs: dict, output: Any) -> None:
        """The outermost module call returned: record it and open the loss region."""
        e, self._pending = self._pending, None
        if e is None or e.fn is not module or not self.enabled or self.incomplete is not None:
            return
        new = self._pending_new
        e.kwargs = self._template(kwargs, new) if kwargs else {}
        entries = self.entries
        if len(entries) >= self.max_entries:
            self._add(e)  # over budget: marked, the region closed
            return
        if new:
            self._commit(new)
        entries.append(e)
        self.trained = self.trained or e.grad
        self._register(len(entries) - 1, [output] if isinstance(output, torch.Tensor) else tensor_leaves(output))
        self._rng_dirty = False   # the replayed module call draws what the call drew
        self.open()

    def call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The mode handler: run the call, record it when it makes or writes a tensor. (Every recorded
        call of every step runs this: the budget test, the in-place test (cached per name), the warning
        swap, the leaves, the commit and the entry are inline.)"""
        name = getattr(func, "__name__", "")
        if not self._pushed or not self.enabled or self.incomplete is not None or name in _NOT_RECORDED \
                or name.startswith("_record_function"):
            return func(*args, **kwargs)
        self._calls += 1  # every call the handler sees counts against the budget (its cost is ours)
        if self.trained:
            if self._calls > self.max_calls:  # the loss code of a training step
                self._mark("over budget")
                self.close()
                return func(*args, **kwargs)
        elif self._calls > self.max_pre_calls:  # before the model's first call, or evaluation code
            if not self.ever_trained and self.window_left > 0:
                self.window_left -= self._calls   # an inference script: keep the latest calls only
                self.eval_reset()
                self._calls = 1
            else:
                self.pre_truncated = True  # the batch's own making is not all recorded: it is data from here
                self.close()
                return func(*args, **kwargs)
        inplace = _inplace_name(name) or (kwargs.get("out") is not None if kwargs else False)
        new: Dict[int, tuple] = {}
        targs, tkw = self._template(args, new), (self._template(kwargs, new) if kwargs else {})
        # the RNG state before the first call of a region, and before any call that may draw from it
        rng = rng_now() if (self._rng_dirty or _random(name)) else None
        w = self._warn  # (_UserWarnings.run, inline)
        w.orig, warnings.showwarning = warnings.showwarning, w.show
        try:
            out = func(*args, **kwargs)
        finally:
            warnings.showwarning = w.orig
        leaves = [out] if isinstance(out, torch.Tensor) else tensor_leaves(out)
        if not leaves and not inplace:
            return out
        target = (tkw.get("out") if tkw.get("out") is not None else targs[0] if targs else None) if inplace else None
        if new:
            self._commit(new)
        if isinstance(target, Ext):
            self._written(target.i, func)   # not re-executed: the replay reads the written values
            return out
        e = Entry("call", func, targs, tkw, self.frames.site_of(sys._getframe(2)))  # (1: the mode's handler)
        e.rng = rng
        self._rng_dirty = False
        entries = self.entries
        if len(entries) >= self.max_entries:
            self._add(e)  # over budget: marked, the region closed
            return out
        entries.append(e)
        idx = len(entries) - 1
        if isinstance(target, Ref):  # x[mask] = 0: readers of x need this call too
            self.writers.setdefault((target.entry, target.slot), []).append(idx)
        self._register(idx, leaves)
        return out

    def _written(self, i: int, func: Any) -> None:
        """An in-place call wrote external tensor ``i``. A replay cannot undo the write: it is not
        re-executed, and later calls read the written values (exact for the calls after it; a call
        the loss needs that read the tensor before the write makes the step not replayable, which
        :class:`~nanguard.pytorch.stepreplay.StepReplay` checks)."""
        t = self.ext[i]
        if t.requires_grad:  # a parameter written between steps: where, for a params-phase failure
            fr = self.frames.site_of(sys._getframe(2))[0]
            self.param_writes[id(t)] = {"api": api_name(func), "file": fr[0] if fr else None,
                                        "line": fr[1] if fr else None, "function": fr[2] if fr else None}
        self.ext_ver[i] = version(t)
        self.ext_written[i] = len(self.entries)

    def before_backward(self, tensors: List[torch.Tensor], a: tuple, k: dict, caller: Any = None) -> None:
        """``torch.autograd.backward(tensors, *a, **k)`` is about to run: end the region, record it.
        ``caller``: the frame that called it (default: this method's caller)."""
        self._later = None
        if self._pushed or self._stale:
            self.close()
        self.trained = self.ever_trained = True
        if not self.enabled or self.incomplete is not None:
            return
        made = bool(tensors)
        prod = self._prod
        for t in tensors:  # (a loop, not any(genexpr): no generator frame every step)
            p = prod.get(id(t))
            if p is None or p[2]() is not t:
                made = False
                break
        if not made:
            self._mark("the loss was not made by recorded calls (a model without module calls, or a loss "
                       "computed before the model's first call)")
            return
        new: Dict[int, tuple] = {}
        e = Entry("backward", None, self._template(list(tensors), new),
                  (self._template(a, new) if a else (), self._template(k, new) if k else {}),
                  self.frames.site_of(caller if caller is not None else sys._getframe(1)))
        e.loss = list(map(_detach, tensors))
        if new:
            self._commit(new)
        self._add(e)

    # ------------------------------------------------------------------ patches
    def install(self) -> None:
        """Wrap ``Tensor.backward`` (ends the region before torch's dispatch can see it), the
        zero_grad methods (O(parameters) attribute writes, never recorded) and ``record_function``'s
        exit (opens a deferred region)."""
        if self._installed:
            return
        self._installed = True
        self._orig = {"backward": torch.Tensor.backward, "opt_zero": torch.optim.Optimizer.zero_grad,
                      "mod_zero": torch.nn.Module.zero_grad, "range_exit": _RANGE.__exit__}
        torch.Tensor.backward = _region_closing(self, self._orig["backward"])
        _RANGE.__exit__ = _opening_after(self, self._orig["range_exit"])
        torch.optim.Optimizer.zero_grad = _unrecorded(self, self._orig["opt_zero"])
        torch.nn.Module.zero_grad = _unrecorded(self, self._orig["mod_zero"])

    def uninstall(self) -> None:
        self.close()
        if not self._installed:
            return
        self._installed = False
        torch.Tensor.backward = self._orig["backward"]
        torch.optim.Optimizer.zero_grad = self._orig["opt_zero"]
        torch.nn.Module.zero_grad = self._orig["mod_zero"]
        _RANGE.__exit__ = self._orig["range_exit"]

    # ------------------------------------------------------------------ replay
    def ref_of(self, t: torch.Tensor) -> Optional[Ref]:
        """The recorded call output ``t`` is, if any."""
        p = self._prod.get(id(t))
        return Ref(p[0], p[1]) if p is not None and p[2]() is t else None

    def why_not(self, step: int) -> Optional[str]:
        """None when the tape can replay step ``step``; else the reason in words."""
        if not self.enabled:
            return self.off_reason or "the step tape is off"
        if step != self.step:
            return f"the tape holds step {self.step}, not step {step} (the failure was seen one step late)"
        if self.incomplete is not None:
            return "over its call budget" if self.incomplete == "over budget" else self.incomplete
        if not any(e.kind == "backward" for e in self.entries):
            return "no backward pass was recorded in this step"
        return None
