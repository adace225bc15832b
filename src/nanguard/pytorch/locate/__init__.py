"""Stage 2: find where the first non-finite value of one training step is born.

``OpRecorder`` records every ATen op of one armed training step (forward,
backward and optimizer update) with a ``TorchDispatchMode``, knows the torch
API call that issued each op (``TorchFunctionMode``), the module whose forward
is running (global module hooks) and, for backward ops, the forward op that
created the autograd node (every node created while armed is tagged with the
forward op in ``node.metadata``; anomaly-mode tracebacks are optional).

It tracks *provenance*, not just "the first NaN": every non-finite tensor
produced while armed carries a taint that points to the op that created the
non-finite values out of finite inputs (a real origin), to an intentional
non-finite constant (``masked_fill(mask, -inf)``) or to a tensor that was
already non-finite before the step (data, parameter, buffer). The reported
origin is the taint that reaches a sink: the loss, the parameter gradients, or
the parameters / optimizer state after the update. Non-finite values that are
masked away (``where``, ``masked_fill``, PyTorch's own norm backward) never
reach a sink and are ignored.
"""
from __future__ import annotations

import collections
import math
import os
import re
import sys
import sysconfig
import threading
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .. import numerics as N
from ..numerics import jnum

aten = torch.ops.aten

__all__ = ["OpRecorder"]

# ---------------------------------------------------------------------------
# op families (ATen op names without overload, in-place "_" suffix stripped)

LOG_OPS = {"log", "log2", "log10", "log1p", "xlogy", "special_xlog1py", "special_entr", "_foreach_log",
           "_foreach_log2", "_foreach_log10", "_foreach_log1p", "logit", "special_logit", "lgamma", "digamma"}
SQRT_OPS = {"sqrt", "rsqrt", "_foreach_sqrt", "_foreach_rsqrt"}
NORM_OPS = {"linalg_vector_norm", "norm", "_foreach_norm", "linalg_norm", "frobenius_norm", "cdist",
            "_cdist_forward", "_cdist_backward", "pdist", "_pdist_forward", "_euclidean_dist"}
POW_OPS = {"pow", "_foreach_pow", "float_power"}
TRIG_OPS = {"acos", "asin", "atanh", "arccos", "arcsin", "arctanh", "acosh", "arccosh"}
EXP_OPS = {"exp", "exp2", "expm1", "sinh", "cosh", "_foreach_exp", "_foreach_expm1", "special_exp2",
           "logsumexp", "softplus"}
DIV_OPS = {"div", "true_divide", "reciprocal", "addcdiv", "_foreach_div", "_foreach_addcdiv",
           "_foreach_reciprocal", "remainder", "fmod", "floor_divide", "divide"}
SOFTMAX_OPS = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "_masked_softmax",
               "special_softmax", "special_log_softmax"}
STDVAR_OPS = {"std", "var", "std_mean", "var_mean"}
WHERE_OPS = {"where", "masked_fill", "masked_scatter", "index_put", "masked_select", "nan_to_num",
             "clamp", "clamp_min", "clamp_max", "clip", "index", "gather", "index_select"}
PASS_OPS = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "t", "transpose", "permute",
            "unsqueeze", "squeeze", "alias", "detach", "clone", "contiguous", "as_strided", "split",
            "split_with_sizes", "chunk", "unbind", "narrow", "_to_copy", "lift_fresh", "view_as",
            "expand_as", "flatten", "unflatten", "_reshape_alias", "movedim", "mT", "mH", "copy"}
INDEX_OPS = {"index", "index_select", "embedding", "_embedding_bag", "embedding_bag", "take",
             "_embedding_bag_forward_only"}
# Ops that write a scalar into some positions only (a mask), and reductions that can carry it out.
_MASK_WRITERS = {"masked_fill", "masked_fill_", "where", "index_put", "index_put_", "masked_scatter",
                 "masked_scatter_", "fill_diagonal_"}
_MASK_SINKS = {"sum", "mean", "nansum", "nanmean", "dot", "mul_sum", "linalg_vector_norm", "norm"}
REDUCE_OPS = {"sum", "mean", "count_nonzero", "nansum", "nanmean", "_foreach_sum", "bincount", "amax",
              "matmul", "mm", "bmm", "einsum", "prod"}
EPS_PRODUCERS = {"add", "sub", "rsub", "clamp", "clamp_min", "_foreach_add", "_foreach_sub",
                 "_foreach_clamp_min", "addcmul", "_foreach_addcmul"}
# In-place ops that overwrite their first argument without reading it (its old values cannot taint the result).
OVERWRITE_OPS = {"fill", "zero", "uniform", "normal", "random", "bernoulli", "exponential", "geometric",
                 "cauchy", "log_normal", "copy", "set", "resize", "resize_as", "_foreach_copy", "_foreach_zero",
                 "_copy_from", "_copy_from_and_resize", "trunc_normal", "full", "_foreach_fill"}
# Ops whose output is uninitialised memory: garbage NaNs there are not an origin.
EMPTY_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
# Torch API entries that do not enclose forward ops (we must not attribute backward ops to them).
_API_SKIP_NAMES = {"backward", "grad", "__get__", "__set__", "__delete__", "run_backward", "_engine_run_backward"}

# Strong references are kept to inputs of these forward ops so that a backward origin can re-examine
# (and re-run) its forward op. Budget in elements.
_KEEP_FWD = LOG_OPS | SQRT_OPS | NORM_OPS | POW_OPS | TRIG_OPS | EXP_OPS | DIV_OPS | SOFTMAX_OPS | STDVAR_OPS
_KEEP_FWD_BUDGET = 16_000_000
_RING = 256                  # strong refs to args of the most recent low-precision ops (float32 re-run chain)
_RING_BUDGET = 16_000_000    # ... and at most this many elements held by them
_MAX_DETAILED = 64   # origins that get full input stats and facts
_FRAME_RE = re.compile(r'File "(.*?)", line (\d+), in (.*)')


def _opname(func: Any) -> str:
    """'add' for aten.add.Tensor and aten.add_.Tensor (in-place suffix dropped)."""
    try:
        n = func._opname
    except AttributeError:
        n = getattr(func, "__name__", str(func)).split(".")[0]
    return n[:-1] if n.endswith("_") and not n.endswith("__") else n


def _is_inplace(func: Any) -> bool:
    try:
        n = func._opname
        return n.endswith("_") and not n.endswith("__")
    except AttributeError:
        return False


_API_MODULES = {"torch._C._VariableFunctions": "torch", "torch._C._VariableFunctionsClass": "torch",
                "torch._C._nn": "torch.nn.functional", "torch._C._linalg": "torch.linalg",
                "torch._C._special": "torch.special", "torch._C._fft": "torch.fft"}


def _api_name(func: Any) -> str:
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


# nanguard's own examples (the demo) are user code, wherever nanguard is installed.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
_EXAMPLES_DIR = os.path.join(_PACKAGE_DIR, "examples")


def _default_user_file(fn: str, excluded: tuple[str, ...]) -> bool:
    if not fn:
        return False
    if fn.startswith("<"):
        return not fn.startswith(("<frozen", "<__array_function__"))
    try:
        real = os.path.realpath(fn)
    except Exception:
        real = fn
    if real.startswith(_EXAMPLES_DIR + os.sep):
        return True
    if "site-packages" in fn or "dist-packages" in fn:
        return False
    return not any(real == p or real.startswith(p + os.sep) for p in excluded)


def _excluded_dirs() -> tuple[str, ...]:
    dirs = {os.path.dirname(torch.__file__), _PACKAGE_DIR}
    for key in ("stdlib", "platstdlib"):
        try:
            dirs.add(sysconfig.get_paths()[key])
        except Exception:
            pass
    return tuple(sorted({os.path.realpath(d) for d in dirs if d}))


def _flatten(args: Sequence[Any], kwargs: dict) -> tuple[list, list]:
    """(tensors, scalars) as (arg key, list position or None, value), in one pass."""
    tens, scal = [], []
    items = enumerate(args) if not kwargs else list(enumerate(args)) + list(kwargs.items())
    for key, a in items:
        if isinstance(a, torch.Tensor):
            tens.append((key, None, a))
        elif isinstance(a, float) or (isinstance(a, int) and not isinstance(a, bool)):
            scal.append((key, None, a))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, torch.Tensor):
                    tens.append((key, j, b))
                elif isinstance(b, float) or (isinstance(b, int) and not isinstance(b, bool)):
                    scal.append((key, j, b))
    return tens, scal


def _flat_tensors(args: Sequence[Any], kwargs: dict) -> list[tuple[int | str, int | None, torch.Tensor]]:
    """(arg key, list position or None, tensor) for every tensor argument."""
    return _flatten(args, kwargs)[0]


def _has_nan(t: torch.Tensor) -> bool:
    return bool(N.nonfinite_counts(t)["nan"])


def _nonfinite_scalar(x: Any) -> tuple[bool, bool]:
    if isinstance(x, float):
        return math.isnan(x), math.isinf(x)
    return False, False


class _Info:
    """What we know about one tensor object: finiteness at a version (and storage), taint, producer op."""
    __slots__ = ("ref", "ver", "nan", "inf", "taint", "prod", "where")

    def __init__(self, ref, ver, nan, inf, taint, prod, where=None):
        self.ref, self.ver, self.nan, self.inf, self.taint, self.prod = ref, ver, nan, inf, taint, prod
        self.where = where


def _where_stored(t: torch.Tensor) -> tuple | None:
    """Storage and dtype of ``t``: ``param.data = ...`` (e.g. ``model.half()``) swaps both
    without bumping the version counter, so the version alone cannot say "unchanged"."""
    try:
        return (t.untyped_storage().data_ptr(), t.dtype)
    except Exception:
        return None


class _Origin:
    """A taint source. kind: 'op' (real origin), 'constant', 'preexisting', 'untracked'."""
    __slots__ = ("seq", "kind", "soft", "op", "stage", "detail", "pre_kind", "name", "first_use", "tref")

    def __init__(self, seq, kind, soft, op=None, stage=None):
        self.seq, self.kind, self.soft, self.op, self.stage = seq, kind, soft, op, stage
        self.detail: dict | None = None
        self.pre_kind: str | None = None
        self.name: str | None = None
        self.first_use: dict | None = None
        self.tref: Any = None

    @property
    def real(self) -> bool:
        return not self.soft


class _FunctionMode(TorchFunctionMode):
    """Remembers the torch API call that encloses the ATen ops (F.kl_div, torch.log, Tensor.__truediv__)."""

    def __init__(self, rec: "OpRecorder"):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if rec._busy or not rec._armed or getattr(func, "__name__", "") in _API_SKIP_NAMES:
            return func(*args, **kwargs)
        name = rec._api_names.get(func)
        if name is None:
            try:
                name = rec._api_names[func] = _api_name(func)
            except TypeError:  # unhashable callable
                name = _api_name(func)
        rec._api_stack.append((name, args, kwargs))
        try:
            return func(*args, **kwargs)
        finally:
            rec._api_stack.pop()


class _DispatchMode(TorchDispatchMode):
    """Sees every ATen op (the mode is popped by PyTorch while this runs, so our checks are not recorded)."""

    def __init__(self, rec: "OpRecorder"):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if rec._busy or not rec._armed:
            return func(*args, **kwargs)
        pre = None
        rec._busy = True
        try:
            with torch._C.DisableTorchFunction():
                pre = rec._before(func, args, kwargs)
        except Exception as e:  # the recorder must never break training
            rec._fail(e)
        finally:
            rec._busy = False
        out = func(*args, **kwargs)
        if pre is not None:
            rec._busy = True
            try:
                with torch._C.DisableTorchFunction():   # autograd is already below this mode
                    rec._after(func, args, kwargs, out, pre)
            except Exception as e:
                rec._fail(e)
            finally:
                rec._busy = False
        return out


class OpRecorder:
    """Record every ATen op of one training step and find where a non-finite value is born.

    Call order for one step (``start``/``stop`` may run in different hooks, same thread)::

        rec.start()                      # before the step's forward (or before the script for step 0)
        loss = model(batch) ...
        rec.mark_loss(loss)              # each tensor .backward() is called on
        rec.set_stage("backward"); loss.backward()
        rec.set_stage("optimizer"); opt.step()   # evaluates the gradient sink first
        rec.stop()                       # evaluates the parameter/state sink, removes modes and hooks
        loc = rec.result()

    Ops inside the autograd engine are "backward" whatever the stage says; other ops are "forward"
    until ``set_stage("optimizer")``. ``with rec.paused(): ...`` runs the caller's own checks unrecorded.
    """

    def __init__(self, *, named_params: dict[str, torch.Tensor], named_buffers: dict[str, torch.Tensor],
                 roots: Sequence[torch.nn.Module] = (), optimizers: Sequence[torch.optim.Optimizer] = (),
                 user_file_filter: Callable[[str], bool] | None = None, max_records: int = 200_000,
                 anomaly_tracebacks: bool = False):
        """``anomaly_tracebacks``: also turn on autograd anomaly mode (check_nan=False) so every node keeps
        ``metadata["traceback_"]``. Off by default: every node is already tagged with the forward op that
        created it (op, module, user frame), and the traceback capture costs ~0.1-0.3 ms per node."""
        self.anomaly_tracebacks = bool(anomaly_tracebacks)
        # the caller's dicts are kept by reference (they may be filled after start()) and never mutated
        self.named_params = named_params if isinstance(named_params, dict) else dict(named_params or {})
        self.named_buffers = named_buffers if isinstance(named_buffers, dict) else dict(named_buffers or {})
        self.roots = list(roots)
        # kept by reference when a list: a caller may register optimizers created after start()
        self.optimizers = optimizers if isinstance(optimizers, list) else list(optimizers)
        self.user_file_filter = user_file_filter
        self.max_records = int(max_records)
        self._excluded = _excluded_dirs()
        self._user_cache: dict[str, bool] = {}
        self._api_names: dict[Any, str] = {}
        self._reset()

    # ------------------------------------------------------------------ lifecycle
    def _reset(self) -> None:
        self._armed = False
        self._busy = False
        self._started = False
        self._stopped = False
        self._stage = "forward"
        self._fmode: _FunctionMode | None = None
        self._dmode: _DispatchMode | None = None
        self._hooks: list[Any] = []
        self._anomaly_prev: tuple[bool, bool] | None = None
        self._api_stack: list[tuple[str, tuple, dict]] = []
        self._mod_stack: list[str] = []
        self._mod_type_stack: list[str] = []
        self._mod_names: dict[int, str] = {}
        self._mod_types: dict[int, str] = {}
        self._infos: dict[int, _Info] = {}
        self._by_storage: dict[int, _Origin] = {}
        self._origins: list[_Origin] = []
        self._n_ops = 0
        # light per-op records (parallel lists, up to max_records)
        self._op_func: list[Any] = []
        self._op_name: list[str] = []
        self._op_stage: list[str] = []
        self._op_module: list[str | None] = []
        self._op_api: list[str | None] = []
        self._op_scalars: list[tuple] = []
        self._op_frame: list[tuple | None] = []
        self._op_outnf: list[bool] = []
        self._op_inprod: list[tuple[int, ...]] = []   # producer op of each tensor input (-1: none)
        self._consumers: dict[int, list[tuple[int, str, bool]]] = {}
        self._ring: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._keep: dict[int, tuple] = {}
        self._keep_elems = 0
        self._ring_elems = 0
        self._thread: int | None = None
        self._pending: list[tuple[Any, int]] = []
        self._opt_ops: list[tuple[int, list, list]] = []   # optimizer-stage op graph by tensor id
        self._loss_sinks: list[tuple[_Origin | None, dict]] = []
        self._grad_sink: list[tuple[str, _Origin | None]] | None = None
        self._opt_sink: list[tuple[str, str | None, _Origin | None]] | None = None
        self._notes: list[str] = []
        self._errors = 0
        self._result: dict | None = None
        self._param_ids: dict[int, str] = {}
        self._buffer_ids: dict[int, str] = {}
        self._param_storage: dict[int, str] = {}
        self._buffer_storage: dict[int, str] = {}
        self._grad_ids: dict[int, str] = {}
        self._state_ids: dict[int, tuple[str, str]] = {}
        self._wrapped: dict[Any, _Origin] = {}
        self._param_versions: dict[int, int | None] = {}
        self._params: dict[int, torch.Tensor] = {}     # every known parameter, by id
        self._param_prio: dict[int, int] = {}          # 3: caller's name, 2: module path, 1: optimizer slot

    def __enter__(self) -> "OpRecorder":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Arm: dispatch + function modes, global module hooks (and anomaly metadata if asked for)."""
        if self._started:
            return
        self._started = True
        self._thread = threading.get_ident()
        self._index_known_tensors()
        self._param_versions = {pid: N.version(p) for pid, p in self._params.items()}
        for root in self.roots:
            self._register_module_tree(root)
        if self.anomaly_tracebacks:
            try:
                self._anomaly_prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
                torch.set_anomaly_enabled(True, False)
            except Exception as e:
                self._notes.append(f"anomaly metadata unavailable: {e}")
        try:
            from torch.nn.modules import module as _m
            self._hooks.append(_m.register_module_forward_pre_hook(self._mod_pre))
            try:
                self._hooks.append(_m.register_module_forward_hook(self._mod_post, always_call=True))
            except TypeError:
                self._hooks.append(_m.register_module_forward_hook(self._mod_post))
            self._fmode = _FunctionMode(self)
            self._fmode.__enter__()
            self._dmode = _DispatchMode(self)
            self._dmode.__enter__()
        except Exception:
            self.stop()
            raise
        self._armed = True

    def stop(self) -> None:
        """Disarm (idempotent) and evaluate the sinks; never leaves modes or hooks installed."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._armed = False
        try:
            self._busy = True
            try:
                self._resolve_pending()
                if self._grad_sink is None:
                    self._eval_grad_sink()
                self._sync_given()
                updated = any(N.version(p) != self._param_versions.get(pid, N.version(p))
                              for pid, p in self._params.items())
                if self._stage == "optimizer" or self._opt_ops or updated:
                    self._eval_opt_sink()
            except Exception as e:
                self._fail(e)
            finally:
                self._busy = False
        finally:
            self._teardown()

    def _teardown(self) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        for mode, getter, popper, pusher in (
                (self._dmode, _get_current_dispatch_mode_stack, self._pop_dispatch, self._push_dispatch),
                (self._fmode, self._fn_stack, self._pop_fn, self._push_fn)):
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
                self._notes.append(f"mode teardown: {type(e).__name__}: {e}")
        self._dmode = self._fmode = None
        for h in self._hooks:
            try:
                h.remove()
            except Exception:
                pass
        self._hooks = []
        if self._anomaly_prev is not None:
            try:
                torch.set_anomaly_enabled(*self._anomaly_prev)
            except Exception:
                pass
            self._anomaly_prev = None
        self._api_stack = []
        self._mod_stack = []
        self._mod_type_stack = []
        self._ring.clear()
        self._ring_elems = 0

    @staticmethod
    def _fn_stack() -> list:
        from torch.overrides import _get_current_function_mode_stack
        return _get_current_function_mode_stack()

    @staticmethod
    def _pop_fn():
        from torch._C import _pop_torch_function_stack
        return _pop_torch_function_stack()

    @staticmethod
    def _push_fn(m) -> None:
        from torch._C import _push_on_torch_function_stack
        _push_on_torch_function_stack(m)

    @staticmethod
    def _pop_dispatch():
        from torch.utils._python_dispatch import _pop_mode
        return _pop_mode()

    @staticmethod
    def _push_dispatch(m) -> None:
        from torch.utils._python_dispatch import _push_mode
        _push_mode(m)

    def paused(self):
        """Context manager: run your own torch code while armed without it being recorded."""
        rec = self

        class _P:
            def __enter__(self_inner):
                self_inner.prev = rec._busy
                rec._busy = True

            def __exit__(self_inner, *exc):
                rec._busy = self_inner.prev
        return _P()

    def set_stage(self, stage: str) -> None:
        """'forward' | 'backward' | 'optimizer' (set by the caller around backward() and step())."""
        if stage not in ("forward", "backward", "optimizer"):
            raise ValueError(f"unknown stage {stage!r}")
        prev_busy, self._busy = self._busy, True
        try:
            self._resolve_pending()
            self._sync_given()
            if stage == "optimizer" and self._stage != "optimizer":
                self._eval_grad_sink()
                self._index_optimizer_state()
            self._stage = stage
        except Exception as e:
            self._fail(e)
        finally:
            self._busy = prev_busy

    def mark_loss(self, loss: torch.Tensor) -> None:
        """The tensor .backward() is called on (forward sink); may be called several times."""
        prev_busy, self._busy = self._busy, True
        try:
            with torch._C.DisableTorchFunction(), torch.no_grad():
                self._resolve_pending()
                if not isinstance(loss, torch.Tensor) or not N.is_checkable(loss):
                    return
                nan, inf = N.nonfinite_flags(loss)
                if not (nan or inf):
                    self._loss_sinks.append((None, {"finite": True}))
                    return
                taint = self._taint_of(loss, stage="forward")
                info = {"finite": False, "value": jnum(loss.detach().reshape(-1)[0].item()) if loss.numel() else None,
                        "shape": list(loss.shape)}
                self._loss_sinks.append((taint, info))
        except Exception as e:
            self._fail(e)
        finally:
            self._busy = prev_busy

    # ------------------------------------------------------------------ indexing known tensors
    def _name_param(self, p: Any, name: str, prio: int) -> None:
        """Remember a parameter's name; a better source (higher prio) replaces a worse one."""
        if not isinstance(p, torch.Tensor) or self._param_prio.get(id(p), 0) > prio:
            return
        self._param_ids[id(p)] = name
        self._param_prio[id(p)] = prio
        self._params[id(p)] = p
        try:
            sp = p.untyped_storage().data_ptr()
            if sp:
                self._param_storage[sp] = name
        except Exception:
            pass

    def _name_buffer(self, b: Any, name: str, prio: int) -> None:
        if not isinstance(b, torch.Tensor) or (id(b) in self._buffer_ids and prio < 3):
            return
        self._buffer_ids[id(b)] = name
        try:
            sp = b.untyped_storage().data_ptr()
            if sp:
                self._buffer_storage[sp] = name
        except Exception:
            pass

    def _sync_given(self) -> None:
        """Pick up names the caller added to its dicts after construction."""
        for name, p in list(self.named_params.items()):
            if self._param_ids.get(id(p)) != name:
                self._name_param(p, name, 3)
        for name, b in list(self.named_buffers.items()):
            if self._buffer_ids.get(id(b)) != name:
                self._name_buffer(b, name, 3)

    def _index_known_tensors(self) -> None:
        self._sync_given()
        for pid, p in list(self._params.items()):
            if p.grad is not None:
                self._grad_ids[id(p.grad)] = self._param_ids[pid]
        for opt in self.optimizers:
            self._name_optimizer_params(opt)
        self._index_optimizer_state()

    def _name_optimizer_params(self, opt: torch.optim.Optimizer) -> None:
        """Parameters of an optimizer that nobody named get their slot as name."""
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                self._name_param(p, f"param_groups[{gi}].params[{pi}]", 1)

    def _discover_optimizer(self) -> None:
        """The optimizer whose step() is running (found on the Python stack), if the caller did not pass it."""
        f = sys._getframe(1)
        while f is not None:
            obj = f.f_locals.get("self")
            if isinstance(obj, torch.optim.Optimizer):
                if not any(o is obj for o in self.optimizers):
                    self.optimizers.append(obj)
                    self._notes.append(f"optimizer {type(obj).__name__} found on the stack")
                    self._name_optimizer_params(obj)
                    self._index_optimizer_state()
                return
            f = f.f_back

    def _index_optimizer_state(self) -> None:
        for opt in self.optimizers:
            for p, st in list(opt.state.items()):
                pname = self._param_ids.get(id(p), "?")
                if isinstance(st, dict):
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor):
                            self._state_ids[id(v)] = (pname, k)

    # ------------------------------------------------------------------ module path
    def _register_module_tree(self, root: torch.nn.Module, overwrite: bool = False) -> None:
        """Module paths (and, when the caller named no parameters, parameter names) under ``root``."""
        try:
            for name, m in root.named_modules(remove_duplicate=False):
                if overwrite:
                    self._mod_names[id(m)] = name
                else:
                    self._mod_names.setdefault(id(m), name)
                self._mod_types[id(m)] = type(m).__name__
            for name, p in root.named_parameters(remove_duplicate=False):
                self._name_param(p, name, 2)
            for name, b in root.named_buffers(remove_duplicate=False):
                self._name_buffer(b, name, 2)
        except Exception:
            pass

    def _mod_pre(self, mod, args) -> None:
        if not self._armed or threading.get_ident() != self._thread:
            return
        name = self._mod_names.get(id(mod))
        if name is None:
            if not self._mod_stack:          # a module called at top level: a root
                self._register_module_tree(mod, overwrite=True)
                name = self._mod_names.get(id(mod), "")
            else:                            # unregistered child: attribute to its caller
                name = self._mod_stack[-1]
                self._mod_names[id(mod)] = name
                self._mod_types[id(mod)] = type(mod).__name__
        self._mod_stack.append(name)
        self._mod_type_stack.append(type(mod).__name__)

    def _mod_post(self, mod, args, out) -> None:
        if self._armed and self._mod_stack and threading.get_ident() == self._thread:
            self._mod_stack.pop()
            if self._mod_type_stack:
                self._mod_type_stack.pop()

    # ------------------------------------------------------------------ frames
    def _is_user(self, fn: str) -> bool:
        u = self._user_cache.get(fn)
        if u is None:
            try:
                u = bool(self.user_file_filter(fn)) if self.user_file_filter else _default_user_file(fn, self._excluded)
            except Exception:
                u = False
            self._user_cache[fn] = u
        return u

    def _user_frame(self) -> tuple[str, int, str] | None:
        f = sys._getframe(1)
        while f is not None:
            fn = f.f_code.co_filename
            if self._is_user(fn):
                return fn, f.f_lineno, f.f_code.co_name
            f = f.f_back
        return None

    def _frame_from_traceback(self, tb: Any) -> tuple[str, int, str] | None:
        """Innermost user frame of anomaly metadata (list of formatted stack strings)."""
        if not tb:
            return None
        entries = tb if isinstance(tb, (list, tuple)) else [tb]
        for entry in reversed(list(entries)):
            for m in reversed(list(_FRAME_RE.finditer(str(entry)))):
                fn, line, func = m.group(1), int(m.group(2)), m.group(3).strip()
                if self._is_user(fn):
                    return fn, line, func
        return None

    # ------------------------------------------------------------------ per-op core
    def _fail(self, e: BaseException) -> None:
        self._errors += 1
        if self._errors <= 5:
            self._notes.append(f"recorder error (ignored): {type(e).__name__}: {str(e)[:200]}")

    def _lookup(self, t: torch.Tensor) -> tuple[bool, bool, _Origin | None, _Info | None]:
        """Finiteness + taint of an input tensor, checking it if unseen or modified since."""
        if not N.is_checkable(t):
            return False, False, None, None
        key = id(t)
        info = self._infos.get(key)
        ver = N.version(t)
        where = _where_stored(t)
        if info is not None and info.ref() is t:
            if ver is not None and info.ver == ver and info.where == where:
                return info.nan, info.inf, info.taint, info
            nan, inf = N.nonfinite_flags(t)
            taint = None
            if nan or inf:
                taint = info.taint if (info.nan or info.inf) else None
                taint = taint or self._storage_taint(t) or self._untracked(t)
            info.ver, info.nan, info.inf, info.taint, info.where = ver, nan, inf, taint, where
            return nan, inf, taint, info
        nan, inf = N.nonfinite_flags(t)
        taint = None
        if nan or inf:
            taint = self._storage_taint(t) or self._preexisting(t, nan, inf)
        info = _Info(weakref.ref(t), ver, nan, inf, taint, None, where)
        self._infos[key] = info
        return nan, inf, taint, info

    def _storage_taint(self, t: torch.Tensor) -> _Origin | None:
        if not self._by_storage:
            return None
        try:
            return self._by_storage.get(t.untyped_storage().data_ptr())
        except Exception:
            return None

    def _untracked(self, t: torch.Tensor) -> _Origin:
        o = _Origin(len(self._origins), "untracked", False, op=self._n_ops, stage=self._cur_stage())
        self._origins.append(o)
        self._notes.append("a tensor became non-finite through a mutation the recorder did not see")
        return o

    def _preexisting(self, t: torch.Tensor, nan: bool, inf: bool) -> _Origin:
        kind, name = "data", None
        try:
            sp = t.untyped_storage().data_ptr()
        except Exception:
            sp = None
        if id(t) in self._param_ids:
            kind, name = "param", self._param_ids[id(t)]
        elif id(t) in self._buffer_ids:
            kind, name = "buffer", self._buffer_ids[id(t)]
        elif id(t) in self._grad_ids:
            kind, name = "param", self._grad_ids[id(t)] + ".grad"
        elif id(t) in self._state_ids:
            kind, name = "optimizer_state", "{}:{}".format(*self._state_ids[id(t)])
        elif sp and sp in self._param_storage:
            kind, name = "param", self._param_storage[sp]
        elif sp and sp in self._buffer_storage:
            kind, name = "buffer", self._buffer_storage[sp]
        # A tensor that only holds -inf and is not a parameter is most likely an intentional mask.
        soft = False
        if not nan and kind in ("data", "buffer"):
            soft = not bool(N._scalar(aten.any.default(aten.isposinf.default(t))))
        o = _Origin(len(self._origins), "preexisting", soft, op=self._n_ops, stage=self._cur_stage())
        o.pre_kind, o.name = kind, name
        o.tref = weakref.ref(t)
        st = N.tensor_stats(t)
        st["bad_rows"] = N.bad_rows(t)
        o.detail = {"stats": st}
        self._origins.append(o)
        return o

    def _param_name(self, t: torch.Tensor) -> tuple[str, str | None] | None:
        """('param'|'buffer', name) when ``t`` is (a view of) a known parameter or buffer."""
        if id(t) in self._param_ids:
            return "param", self._param_ids[id(t)]
        if id(t) in self._buffer_ids:
            return "buffer", self._buffer_ids[id(t)]
        try:
            sp = t.untyped_storage().data_ptr()
        except Exception:
            sp = None
        if sp and sp in self._param_storage:
            return "param", self._param_storage[sp]
        if sp and sp in self._buffer_storage:
            return "buffer", self._buffer_storage[sp]
        if isinstance(t, torch.nn.Parameter):
            return "param", None
        return None

    def _param_written(self, t: torch.Tensor, taint: _Origin, info: _Info | None) -> _Origin | None:
        """A parameter read while holding non-finite values written by an op (e.g. a bad init under
        no_grad): it is a corrupted parameter; the writing op is kept as ``written_by``."""
        pn = self._param_name(t)
        if pn is None:
            return None
        try:
            key = ("written", pn[0], pn[1] if pn[1] is not None else t.untyped_storage().data_ptr())
        except Exception:
            key = ("written", pn[0], pn[1] if pn[1] is not None else id(t))
        o = self._wrapped.get(key)
        if o is None:
            o = _Origin(len(self._origins), "preexisting", False, op=self._n_ops, stage=self._cur_stage())
            o.pre_kind, o.name = pn
            o.tref = weakref.ref(t)
            st = N.tensor_stats(t)
            st["bad_rows"] = N.bad_rows(t)
            wd = dict(taint.detail or {})
            wb = {k: wd.get(k) for k in ("op", "api", "module", "file", "line", "function", "stage", "facts",
                                          "output")}
            wb["input_numel"] = [i.get("numel") for i in wd.get("inputs") or []]
            wb["kind"] = taint.kind
            o.detail = {"stats": st, "written_by": wb}
            self._origins.append(o)
            self._wrapped[key] = o
        if info is not None:
            info.taint = o
        return o

    def _cur_stage(self) -> str:
        """'backward' inside the autograd engine; 'optimizer' after set_stage('optimizer'); else 'forward'
        (ops between backward() and step(), or the next micro-batch's forward, run outside the engine)."""
        try:
            if torch._C._current_autograd_node() is not None:
                return "backward"
        except Exception:
            pass
        return "optimizer" if self._stage == "optimizer" else "forward"

    def _resolve_pending(self) -> None:
        """Tag the autograd node of each recent forward output with the op that created it."""
        if not self._pending:
            return
        pend, self._pending = self._pending, []
        with torch._C.DisableTorchFunction():
            for ref, idx in pend:
                t = ref()
                if t is None:
                    continue
                try:
                    gf = t.grad_fn
                    if gf is not None:
                        md = gf.metadata
                        if "nanguard_fwd" not in md:
                            md["nanguard_fwd"] = idx
                except Exception:
                    pass

    def _before(self, func, args, kwargs):
        self._resolve_pending()
        stage = self._cur_stage()
        tens, scal = _flatten(args, kwargs)
        over = _opname(func) in OVERWRITE_OPS
        ins = []
        for key, pos, t in tens:
            if key == "out" or (over and key == 0):
                continue    # written, not read: its old values do not matter
            nan, inf, taint, info = self._lookup(t)
            if taint is not None and taint.real and stage != "optimizer" and not (
                    taint.kind == "preexisting" and taint.pre_kind in ("param", "buffer")):
                taint = self._param_written(t, taint, info) or taint
            ins.append((key, pos, t, nan, inf, taint, info.prod if info is not None else None))
        return stage, ins, scal

    def _mutated(self, func, args, kwargs) -> list[tuple[int | str, Any]]:
        try:
            cache = self.__dict__.setdefault("_mut_cache", {})
            pos = cache.get(func)
            if pos is None:
                pos = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
                cache[func] = pos
        except Exception:
            return []
        out = []
        for i, name in pos:
            if i < len(args):
                out.append((i, args[i]))
            elif name in kwargs:
                out.append((name, kwargs[name]))
        return out

    def _after(self, func, args, kwargs, out, pre) -> None:
        stage, ins, scal = pre
        idx = self._n_ops
        self._n_ops += 1
        name = _opname(func)
        foreach = name.startswith("_foreach_")
        record = idx < self.max_records
        if idx == self.max_records:
            self._notes.append(f"more than {self.max_records} ops: later ops are tracked but not recorded")

        # outputs: returned tensors plus arguments the op writes to (in-place / out=)
        outs: list[tuple[int | None, torch.Tensor]] = []
        seen: set[int] = set()
        mut_ids: set[int] = set()

        def add(t: Any, pos: int | None) -> None:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                outs.append((pos if foreach else None, t))
        if isinstance(out, torch.Tensor):
            add(out, None)
        elif isinstance(out, (list, tuple)):
            for j, o in enumerate(out):
                if isinstance(o, (list, tuple)):
                    for jj, oo in enumerate(o):
                        add(oo, jj)
                else:
                    add(o, j)
        for _key, m in self._mutated(func, args, kwargs):
            if isinstance(m, torch.Tensor):
                mut_ids.add(id(m))
                add(m, None)
            elif isinstance(m, (list, tuple)):
                for j, mm in enumerate(m):
                    if isinstance(mm, torch.Tensor):
                        mut_ids.add(id(mm))
                        add(mm, j)

        module = self._mod_stack[-1] if self._mod_stack else None
        api = self._api_stack[-1][0] if self._api_stack else None
        low = False
        any_nf = False
        results = []
        garbage = name in EMPTY_OPS
        for pos, t in outs:
            if not N.is_checkable(t):
                continue
            if t.dtype in N.LOW_PRECISION:
                low = True
            nan, inf = (False, False) if garbage else N.nonfinite_flags(t)
            results.append((pos, t, nan, inf))
            any_nf = any_nf or nan or inf

        if record:
            self._op_func.append(func)
            self._op_name.append(name)
            self._op_stage.append(stage)
            self._op_module.append(module)
            self._op_api.append(api)
            self._op_scalars.append(tuple(v for _k, _p, v in scal[:6]))
            self._op_outnf.append(any_nf)
            self._op_inprod.append(tuple(i[6][0] if i[6] is not None else -1 for i in ins[:8]))
            self._op_frame.append(self._user_frame() if stage == "forward" else None)
            if low:
                n = sum(int(i[2].numel()) for i in ins)
                if n <= _RING_BUDGET:
                    self._ring[idx] = (func, args, kwargs, n)
                    self._ring_elems += n
                    while self._ring and (len(self._ring) > _RING or self._ring_elems > _RING_BUDGET):
                        self._ring_elems -= self._ring.popitem(last=False)[1][3]
            if stage == "forward" and name in _KEEP_FWD and self._keep_elems < _KEEP_FWD_BUDGET:
                n = sum(int(i[2].numel()) for i in ins)
                if self._keep_elems + n <= _KEEP_FWD_BUDGET:
                    self._keep[idx] = (func, args, kwargs)
                    self._keep_elems += n
            if stage == "optimizer":
                if not self._opt_ops:
                    self._discover_optimizer()
                self._opt_ops.append((idx, [(i[0], i[1], id(i[2])) for i in ins], [(p, id(t)) for p, t in outs]))

        # consumers of non-finite forward tensors and of domain-sensitive ops' outputs (where-trap evidence)
        if stage == "forward":
            float_out = bool(results)
            n_rec = len(self._op_name)
            for i in ins:
                p = i[6]
                if p is not None and (i[3] or i[4] or (p[0] < n_rec and self._op_name[p[0]] in _KEEP_FWD)):
                    self._consumers.setdefault(p[0], []).append((idx, name, any_nf, float_out))

        new_origin: _Origin | None = None
        new_const: _Origin | None = None
        for pos, t, nan, inf in results:
            taint = None
            if nan or inf:
                rel = [i for i in ins if not foreach or i[1] is None or i[1] == pos]
                rel_s = [s for s in scal if not foreach or s[1] is None or s[1] == pos]
                taint = self._decide(nan, inf, rel, rel_s, name, t)
                if taint == "new":
                    if new_origin is None:
                        new_origin = _Origin(len(self._origins), "op", False, op=idx, stage=stage)
                        self._origins.append(new_origin)
                    taint = new_origin
                elif taint == "const":
                    if new_const is None:
                        new_const = _Origin(len(self._origins), "constant", True, op=idx, stage=stage)
                        self._origins.append(new_const)
                    taint = new_const
                elif taint.kind == "preexisting" and taint.first_use is None:
                    taint.first_use = self._first_use(func, name, args, t, stage)
            self._set_info(t, nan, inf, taint, (idx, pos), mutated=id(t) in mut_ids)
            if stage == "forward" and record:
                self._pending.append((weakref.ref(t), idx))
        if new_origin is not None:
            self._describe_origin(new_origin, func, name, args, kwargs, ins, scal, results, stage, module, api)
        if new_const is not None:
            fr = self._user_frame()
            new_const.detail = {"op": str(func), "name": name, "api": api, "module": module, "stage": stage,
                                "file": fr[0] if fr else None, "line": fr[1] if fr else None,
                                "function": fr[2] if fr else None, "constant": True,
                                "scalars": [jnum(v) for _k, _p, v in scal][:6]}

    def _decide(self, out_nan: bool, out_inf: bool, ins: list, scal: list, name: str | None = None,
                out: torch.Tensor | None = None) -> Any:
        """Taint of a non-finite output: inherit a real origin, start a new one, or a constant."""
        real = [i[5] for i in ins if i[5] is not None and i[5].real]
        if real:
            return min(real, key=lambda o: o.seq)
        s_nan = any(_nonfinite_scalar(v)[0] for _k, _p, v in scal)
        s_inf = any(_nonfinite_scalar(v)[1] for _k, _p, v in scal)
        in_nan = s_nan or any(i[3] for i in ins)
        in_inf = s_inf or any(i[4] for i in ins)
        if out_nan and not in_nan:
            return "new"       # NaN out of NaN-free inputs (incl. softmax of an all -inf row)
        if out_inf and not out_nan and not in_inf:
            return "new"       # overflow, x/0, log(0) from finite inputs
        soft = [i[5] for i in ins if i[5] is not None]
        if soft:
            mask = self._mask_escape(name, out, ins, soft)
            if mask is not None:
                self._escaped_mask = mask
                return "new"   # masked entries summed into a result: the bug is this reduction
            return min(soft, key=lambda o: o.seq)
        return "const"         # introduced from a non-finite scalar constant

    def _mask_escape(self, name: str | None, out: Any, ins: list, soft: list) -> _Origin | None:
        """A sum/mean over positions that a mask filled with +-inf, giving a non-finite result
        (e.g. label smoothing or a mean log-prob over -inf-masked logits). Masks are meant to be
        absorbed (softmax, logsumexp, max turn them into finite values); a reduction that keeps
        them is where the intended infinity becomes a real failure. The mask's origin, or None."""
        if name not in _MASK_SINKS or not isinstance(out, torch.Tensor) or self._cur_stage() != "forward":
            return None
        big = max((int(i[2].numel()) for i in ins if isinstance(i[2], torch.Tensor)), default=0)
        if out.numel() >= big:
            return None
        consts = [o for o in soft if o.kind == "constant"]
        if len(consts) != len(soft):
            return None
        masks = [o for o in consts if (o.detail or {}).get("name") in _MASK_WRITERS]
        return min(masks, key=lambda o: o.seq) if masks and len(masks) == len(consts) else None

    def _set_info(self, t: torch.Tensor, nan: bool, inf: bool, taint: _Origin | None, prod: tuple,
                  mutated: bool) -> None:
        ver = N.version(t)
        if mutated and ver is not None:
            ver += 1   # ADInplaceOrView bumps the version after this mode returns
        info = self._infos.get(id(t))
        if info is not None and info.ref() is t:
            info.ver, info.nan, info.inf, info.taint, info.prod = ver, nan, inf, taint, prod
            info.where = _where_stored(t)
        else:
            self._infos[id(t)] = _Info(weakref.ref(t), ver, nan, inf, taint, prod, _where_stored(t))
        if taint is not None:
            try:
                self._by_storage[t.untyped_storage().data_ptr()] = taint
            except Exception:
                pass
        elif self._by_storage:
            try:
                st = t.untyped_storage()
                if st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
                    self._by_storage.pop(st.data_ptr(), None)
            except Exception:
                pass

    # ------------------------------------------------------------------ origin description
    def _first_use(self, func: Any, name: str, args: Sequence[Any], out: torch.Tensor, stage: str) -> dict:
        """Where a pre-existing non-finite tensor first enters the step (sample rows, source rows)."""
        fr = self._user_frame()
        d: dict[str, Any] = {"op": str(func), "stage": stage, "file": fr[0] if fr else None,
                             "line": fr[1] if fr else None, "function": fr[2] if fr else None,
                             "module": self._mod_stack[-1] if self._mod_stack else None,
                             "samples": N.bad_rows(out), "source_rows": []}
        try:
            if name in INDEX_OPS and d["samples"]:
                index = None
                if name == "index" and len(args) > 1 and isinstance(args[1], (list, tuple)) and args[1]:
                    index = args[1][0]
                elif name == "index_select" and len(args) > 2 and args[1] == 0:
                    index = args[2]
                elif name in ("embedding", "take") and len(args) > 1:
                    index = args[1]
                if isinstance(index, torch.Tensor):
                    if index.dtype == torch.bool:
                        index = aten.select.int(aten.nonzero.default(index), 1, 0)
                    if not index.dtype.is_floating_point and index.dim() >= 1:
                        flat = index if index.dim() == 1 else aten.reshape.default(index, [index.shape[0], -1])[:, 0]
                        d["source_rows"] = sorted({int(flat[r]) for r in d["samples"] if r < flat.shape[0]})[:10]
        except Exception as e:
            d["source_rows_error"] = str(e)[:100]
        return d

    def _describe_origin(self, o: _Origin, func, name, args, kwargs, ins, scal, results, stage, module,
                         api) -> None:
        bad = [(pos, t, nan, inf) for pos, t, nan, inf in results if nan or inf]
        pos0, t0 = bad[0][0], bad[0][1]
        fr = self._user_frame()
        d: dict[str, Any] = {"op": str(func), "name": name, "api": api, "module": module, "stage": stage,
                             "file": fr[0] if fr else None, "line": fr[1] if fr else None,
                             "function": fr[2] if fr else None, "dtype": N.dtype_name(t0.dtype),
                             "shape": list(t0.shape), "positions": [p for p, *_ in bad if p is not None][:10],
                             "autograd_node": None,
                             "module_type": self._mod_type_stack[-1] if self._mod_type_stack else None}
        fwd_idx = None
        if stage == "backward":
            try:
                node = torch._C._current_autograd_node()
            except Exception:
                node = None
            ffr = None
            if node is not None:
                d["autograd_node"] = node.name()
                try:
                    md = node.metadata
                    fwd_idx = md.get("nanguard_fwd")
                    ffr = self._frame_from_traceback(md.get("traceback_"))
                except Exception:
                    pass
            if fwd_idx is not None and fwd_idx < len(self._op_name):
                d["forward_idx"] = fwd_idx
                d["forward_op"] = str(self._op_func[fwd_idx])
                d["forward_name"] = self._op_name[fwd_idx]
                d["forward_module"] = self._op_module[fwd_idx]
                d["forward_api"] = self._op_api[fwd_idx]
                if ffr is None:
                    ffr = self._op_frame[fwd_idx]
            if ffr is not None:
                d["forward_file"], d["forward_line"], d["forward_function"] = ffr
        d["output"] = N.nonfinite_counts(t0)
        d["samples"] = N.bad_rows(t0)
        mask, self._escaped_mask = getattr(self, "_escaped_mask", None), None
        if mask is not None:
            md = mask.detail or {}
            d["mask_escape"] = {"mask_op": md.get("name"), "mask_api": md.get("api"), "file": md.get("file"),
                                "line": md.get("line"), "constant": (md.get("scalars") or [None])[0]}
        o.detail = d
        if o.seq >= _MAX_DETAILED:
            return
        rel = [i for i in ins if pos0 is None or i[1] is None or i[1] == pos0]
        d["inputs"] = []
        for i in rel[:6]:
            st = N.tensor_stats(i[2])
            st["arg"] = i[0] if i[1] is None else f"{i[0]}[{i[1]}]"
            d["inputs"].append(st)
        d["scalars"] = [jnum(v) for _k, p, v in scal if pos0 is None or p is None or p == pos0][:6]
        try:
            d["facts"] = self._facts(func, name, args, kwargs, rel, t0, pos0, stage, fwd_idx)
        except Exception as e:
            d["facts"] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}

    # ------------------------------------------------------------------ evidence facts
    def _producer(self, t: Any) -> tuple[int, int | None] | None:
        info = self._infos.get(id(t)) if isinstance(t, torch.Tensor) else None
        if info is not None and info.ref() is t:
            return info.prod
        return None

    def _producer_chain(self, t: Any, depth: int = 3) -> list[int]:
        """Op indices that produced ``t``, walking up first tensor inputs (innermost first); view-like
        ops do not count towards ``depth``."""
        prod = self._producer(t)
        chain: list[int] = []
        i = prod[0] if prod is not None else -1
        real = 0
        while 0 <= i < len(self._op_name) and real < depth and len(chain) < depth + 6:
            chain.append(i)
            if self._op_name[i] not in PASS_OPS:
                real += 1
            ps = [p for p in self._op_inprod[i] if p >= 0]
            i = ps[0] if ps else -1
        return chain

    def _eps_constants(self, tensors: list[torch.Tensor]) -> list[dict]:
        """Small constants added to (or clamped into) the inputs right before they reached the op."""
        out = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                continue
            for p in self._producer_chain(t, depth=2):
                nm = self._op_name[p]
                if nm in EPS_PRODUCERS:
                    for c in self._op_scalars[p]:
                        if isinstance(c, (int, float)) and not isinstance(c, bool) and c != 0 and abs(c) < 1e-2:
                            f = N.eps_fact(float(c), t.dtype)
                            f["op"] = str(self._op_func[p])
                            out.append(f)
        return out[:10]

    @staticmethod
    def _cast_args(args: Any, kwargs: dict, dtype: torch.dtype, subst: dict | None = None) -> tuple:
        def cv(a):
            if isinstance(a, torch.Tensor):
                if subst and id(a) in subst:
                    return subst[id(a)]
                if a.dtype.is_floating_point and a.layout == torch.strided:
                    return aten._to_copy.default(a.detach(), dtype=dtype)
                return a.detach()
            if isinstance(a, (list, tuple)):
                return type(a)(cv(b) for b in a)
            if isinstance(a, torch.dtype) and a.is_floating_point:
                return dtype
            return a
        return tuple(cv(a) for a in args), {k: cv(v) for k, v in kwargs.items()}

    def _rerun(self, func: Any, args: Any, kwargs: dict, dtype: torch.dtype, pos: int | None,
               subst: dict | None = None) -> list[torch.Tensor]:
        a, k = self._cast_args(args, kwargs, dtype, subst)
        if "out" in k:
            return []
        out = func(*a, **k)
        mut = [m for _k, m in self._mutated(func, a, k)]
        res = []
        for o in ([out] if isinstance(out, torch.Tensor) else list(out or ())) + mut:
            if isinstance(o, (list, tuple)):
                if pos is not None and pos < len(o):
                    o = o[pos]
                else:
                    continue
            if isinstance(o, torch.Tensor) and o.dtype.is_floating_point:
                res.append(o)
        return res

    def _rerun_fact(self, func, args, kwargs, dtype, pos, subst=None) -> dict:
        try:
            outs = self._rerun(func, args, kwargs, dtype, pos, subst)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        if not outs:
            return {"error": "no floating output"}
        fin = all(not any(N.nonfinite_flags(o)) for o in outs)
        mx = max((N.tensor_stats(o).get("max_abs") for o in outs), key=lambda v: v if isinstance(v, float) else -1)
        return {"op": str(func), "dtype": N.dtype_name(dtype), "finite": fin, "max_abs": mx}

    def _rerun32_tensor(self, t: Any, depth: int) -> Any:
        """float32 version of ``t``, recomputed from its producers' inputs when they are still held."""
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.dtype not in N.LOW_PRECISION:
            return t
        prod = self._producer(t)
        if depth <= 0 or prod is None or prod[0] not in self._ring:
            return aten._to_copy.default(t.detach(), dtype=torch.float32)
        func, args, kwargs, _n = self._ring[prod[0]]
        if _is_inplace(func) or self._mutated(func, args, kwargs):
            return aten._to_copy.default(t.detach(), dtype=torch.float32)
        subst = {}
        for _k, _p, a in _flat_tensors(args, kwargs):
            if a.dtype in N.LOW_PRECISION:
                subst[id(a)] = self._rerun32_tensor(a, depth - 1)
        try:
            outs = self._rerun(func, args, kwargs, torch.float32, prod[1], subst)
        except Exception:
            outs = []
        match = [o for o in outs if tuple(o.shape) == tuple(t.shape)]
        self._chain_ops.append(self._op_name[prod[0]])
        return match[0] if match else aten._to_copy.default(t.detach(), dtype=torch.float32)

    def _facts(self, func, name, args, kwargs, rel, t0, pos0, stage, fwd_idx) -> dict:
        f: dict[str, Any] = {}
        dt = t0.dtype
        # the op whose semantics matter: the forward op of a backward origin when we still hold its inputs
        e_func, e_name, e_args, e_kwargs, e_pos = func, name, args, kwargs, pos0
        if stage == "backward" and fwd_idx is not None and fwd_idx in self._keep:
            e_func, e_args, e_kwargs = self._keep[fwd_idx]
            e_name, e_pos = _opname(e_func), None
            f["examined"] = "forward_op"
        elif stage == "backward":
            f["examined"] = "backward_op"
        ftens = [a for _k, _p, a in _flat_tensors(e_args, e_kwargs) if a.dtype.is_floating_point]

        f["float64_rerun"] = self._rerun_fact(func, args, kwargs, torch.float64, pos0)
        if e_func is not func:
            f["forward_float64_rerun"] = self._rerun_fact(e_func, e_args, e_kwargs, torch.float64, None)
            fo = self._rerun(e_func, e_args, e_kwargs, ftens[0].dtype if ftens else dt, None) if ftens else []
            if fo:
                f["forward_output"] = N.tensor_stats(fo[0])
        if dt in N.LOW_PRECISION and stage != "backward":
            direct = self._rerun_fact(func, args, kwargs, torch.float32, pos0)
            self._chain_ops: list[str] = []
            subst = {}
            for i in rel:
                if i[2].dtype in N.LOW_PRECISION:
                    subst[id(i[2])] = self._rerun32_tensor(i[2], 2)
            chain = self._rerun_fact(func, args, kwargs, torch.float32, pos0, subst)
            f["float32_rerun"] = {"direct_finite": direct.get("finite"), "chain_finite": chain.get("finite"),
                                  "chain_ops": self._chain_ops[:10], "max_abs": direct.get("max_abs")}
        f["dtype_info"] = N.finfo_facts(dt)
        f["producers"] = [[self._op_name[p] for p in self._producer_chain(a, depth=3)] for a in ftens[:4]]
        eps = self._eps_constants(ftens)
        if eps:
            f["eps_constants"] = eps

        def pick(v, p=e_pos):
            if isinstance(v, (list, tuple)):
                return v[p] if p is not None and p < len(v) else None
            return v

        def arg(i, kw=None):
            if i < len(e_args):
                return pick(e_args[i])
            return pick(e_kwargs.get(kw)) if kw else None

        x = arg(0, "self")
        # domain facts
        if e_name in LOG_OPS:
            src = arg(1, "other") if e_name in ("xlogy", "special_xlog1py") else x
            if isinstance(src, torch.Tensor):
                lim = -1.0 if e_name in ("log1p", "_foreach_log1p", "special_xlog1py") else 0.0
                f["log_domain"] = {"le_limit": self._count(aten.le.Scalar(src, lim)), "limit": lim,
                                   "zeros": self._count(aten.eq.Scalar(src, 0)),
                                   "negatives": self._count(aten.lt.Scalar(src, 0)),
                                   "min": N.tensor_stats(src).get("min"), "numel": int(src.numel())}
        if e_name in SQRT_OPS or e_name in NORM_OPS or e_name in POW_OPS:
            if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
                d = {"zeros": self._count(aten.eq.Scalar(x, 0)), "negatives": self._count(aten.lt.Scalar(x, 0)),
                     "numel": int(x.numel())}
                if e_name in POW_OPS:
                    ex = arg(1, "exponent")
                    if isinstance(ex, (int, float)):
                        d["exponent"] = jnum(ex)
                        d["fractional"] = float(ex) != int(float(ex)) if math.isfinite(float(ex)) else False
                    elif isinstance(ex, torch.Tensor) and ex.dtype.is_floating_point:
                        # element-wise exponents: a negative base under a non-integer exponent is NaN
                        # (the sqrt-like domain), a zero base under a negative one is 1/0
                        non_int = aten.ne.Tensor(ex, aten.floor.default(ex))
                        d["neg_base_fractional_exp"] = self._count(
                            aten.logical_and.default(aten.lt.Scalar(x, 0), non_int))
                        d["zero_base_negative_exp"] = self._count(
                            aten.logical_and.default(aten.eq.Scalar(x, 0), aten.lt.Scalar(ex, 0)))
                        d["fractional"] = d["neg_base_fractional_exp"] > 0
                        d["exponent_range"] = [N.tensor_stats(ex).get("min"), N.tensor_stats(ex).get("max")]
                if e_name in NORM_OPS and "forward_output" in f:
                    d["norm_zeros"] = f["forward_output"].get("zeros")
                f["sqrt_domain"] = d
        if e_name in TRIG_OPS and isinstance(x, torch.Tensor):
            ax = aten.abs.default(x)
            lim_ok = e_name in ("acosh", "arccosh")
            f["trig_domain"] = {"abs_ge_1": self._count(aten.ge.Scalar(ax, 1.0)),
                                "abs_gt_1": self._count(aten.gt.Scalar(ax, 1.0)),
                                "lt_1": self._count(aten.lt.Scalar(x, 1.0)) if lim_ok else None,
                                "max_abs": N.tensor_stats(x).get("max_abs"), "numel": int(x.numel())}
        if (e_name in EXP_OPS or (e_name in POW_OPS and isinstance(arg(1, "exponent"), torch.Tensor))) and \
                isinstance(x, torch.Tensor):
            src = arg(1, "exponent") if e_name in POW_OPS else x
            st = N.tensor_stats(src)
            f["exp_input_max"] = st.get("max")
            f["overflow_threshold"] = jnum(math.log(torch.finfo(src.dtype).max))
        if e_name in DIV_OPS:
            f["zero_denominator"] = self._div_facts(e_name, e_args, e_pos)
        if e_name in SOFTMAX_OPS and isinstance(x, torch.Tensor):
            dim = arg(1, "dim")
            if isinstance(dim, int):
                allm = aten.all.dim(aten.eq.Scalar(x, float("-inf")), dim)
                rows = N.mask_rows(allm)
                f["softmax_all_masked_rows"] = {"count": self._count(allm), "batch_rows": rows,
                                                "rows_total": int(allm.numel()),
                                                "rows_with_neginf": self._count(aten.any.dim(
                                                    aten.eq.Scalar(x, float("-inf")), dim))}
        if ("attention" in e_name or "scaled_dot_product" in e_name) and _has_nan(t0):
            mask = e_kwargs.get("attn_mask")
            if mask is None:
                mask = next((a for a in e_args[3:5] if isinstance(a, torch.Tensor)), None)
            if isinstance(mask, torch.Tensor) and mask.dim() >= 1:
                blocked = aten.logical_not.default(mask) if mask.dtype == torch.bool else \
                    aten.eq.Scalar(mask, float("-inf"))
                allm = aten.all.dim(blocked, -1)
                f["softmax_all_masked_rows"] = {"count": self._count(allm), "batch_rows": N.mask_rows(allm),
                                                "rows_total": int(allm.numel()), "from": "attn_mask"}
        if e_name in STDVAR_OPS and isinstance(x, torch.Tensor):
            f["std_var"] = self._stdvar_facts(e_func, e_args, e_kwargs, x)
        # overflow facts: non-finite from finite inputs, infinities only
        outc = N.nonfinite_counts(t0)
        range_ok = f["float64_rerun"].get("finite") or (f.get("float32_rerun") or {}).get("direct_finite")
        if (outc["posinf"] or outc["neginf"]) and not outc["nan"] and range_ok:
            f["overflow"] = {"dtype_max": jnum(torch.finfo(dt).max),
                             "input_max_abs": max([s for s in (N.tensor_stats(i[2]).get("max_abs") for i in rel
                                                               if i[2].dtype.is_floating_point)
                                                   if isinstance(s, float)], default=None)}
        kl = self._kl_facts()
        if kl:
            f["kl_div"] = kl
        if stage == "backward" and fwd_idx is not None:
            f["where_trap"] = self._where_trap(fwd_idx)
        return f

    @staticmethod
    def _count(mask: torch.Tensor) -> int:
        return int(N._scalar(aten.sum.default(mask)))

    def _div_facts(self, e_name: str, e_args: Sequence[Any], pos: int | None) -> dict:
        def pick(v):
            if isinstance(v, (list, tuple)):
                return v[pos] if pos is not None and pos < len(v) else None
            return v
        if e_name in ("reciprocal", "_foreach_reciprocal"):
            num, den = 1.0, pick(e_args[0]) if e_args else None
        elif e_name in ("addcdiv", "_foreach_addcdiv"):
            num = pick(e_args[1]) if len(e_args) > 1 else None
            den = pick(e_args[2]) if len(e_args) > 2 else None
        else:
            num = pick(e_args[0]) if e_args else None
            den = pick(e_args[1]) if len(e_args) > 1 else None
        d: dict[str, Any] = {}
        if isinstance(den, (int, float)):
            d["scalar_denominator"] = jnum(den)
            d["zeros"] = int(den == 0)
            return d
        if not isinstance(den, torch.Tensor):
            return d
        dz = aten.eq.Scalar(den, 0)
        d["zeros"] = self._count(dz)
        d["numel"] = int(den.numel())
        if isinstance(num, torch.Tensor):
            try:
                nz = aten.eq.Scalar(num, 0)
                both = aten.logical_and.default(dz, nz)
                d["zero_over_zero"] = self._count(both)
                d["nonzero_over_zero"] = self._count(aten.logical_and.default(dz, aten.logical_not.default(nz)))
            except Exception:
                pass
        chain = self._producer_chain(den, depth=3)
        names = [self._op_name[p] for p in chain]
        d["producer_chain"] = names[:6]
        real = [n for n in names if n not in PASS_OPS]
        d["from_reduction"] = bool(real) and real[0] in REDUCE_OPS
        d["from_std_var"] = any(n in STDVAR_OPS for n in real[:3])
        d["min"] = N.tensor_stats(den).get("min")
        return d

    @staticmethod
    def _stdvar_facts(func, args, kwargs, x) -> dict:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        corr = kwargs.get("correction", None)
        unbiased = None
        if len(args) > 2 and isinstance(args[2], bool):
            unbiased = args[2]
        if "unbiased" in kwargs:
            unbiased = kwargs["unbiased"]
        if corr is None:
            corr = 1 if unbiased is None or unbiased else 0
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            n = int(x.numel())
        else:
            dims = [dims] if isinstance(dims, int) else list(dims)
            n = 1
            for d in dims:
                n *= int(x.shape[d]) if x.dim() else 1
        corr = float(corr)
        return {"n": n, "correction": jnum(corr), "n_minus_correction": jnum(n - corr), "degenerate": n - corr <= 0}

    def _kl_facts(self) -> dict | None:
        for nm, a, k in reversed(self._api_stack):
            if nm.endswith("kl_div"):
                inp = a[0] if len(a) > 0 else k.get("input")
                tgt = a[1] if len(a) > 1 else k.get("target")
                log_target = k.get("log_target", a[5] if len(a) > 5 else False)
                if not isinstance(tgt, torch.Tensor):
                    return {"log_target": bool(log_target)}
                tg = tgt.detach()
                st = N.tensor_stats(tg)
                d = {"log_target": bool(log_target), "target_min": st.get("min"), "target_max": st.get("max"),
                     "target_negatives": st.get("negatives"), "target_all_le_0": st.get("max") is not None and
                     isinstance(st.get("max"), float) and st["max"] <= 0}
                try:
                    if tg.dim() >= 1 and tg.dtype.is_floating_point:
                        lse = aten.logsumexp.default(aten._to_copy.default(tg, dtype=torch.float64), [-1])
                        dev = N._scalar(aten.max.default(aten.abs.default(lse)))
                        d["target_rows_logsumexp_max_abs"] = jnum(dev)
                        ssum = aten.sum.dim_IntList(aten._to_copy.default(tg, dtype=torch.float64), [-1])
                        d["target_rows_sum_max_dev_from_1"] = jnum(
                            N._scalar(aten.max.default(aten.abs.default(aten.sub.Scalar(ssum, 1.0)))))
                        d["target_looks_like_log_probs"] = bool(d["target_all_le_0"] and abs(dev) < 1e-3)
                except Exception:
                    pass
                if isinstance(inp, torch.Tensor):
                    ist = N.tensor_stats(inp.detach())
                    d["input_min"], d["input_max"] = ist.get("min"), ist.get("max")
                return d
        return None

    def _where_trap(self, fwd_idx: int) -> bool:
        """True when the forward op's output only reached where/masked_fill-like selections (through views):
        the forward discarded the bad entries, but their gradient (0 from the selection) still flows into
        the op's backward, where 0 * inf or 0/0 gives NaN."""
        if fwd_idx >= len(self._op_name):
            return False
        seen_where = False

        def walk(i: int, depth: int) -> bool:
            nonlocal seen_where
            for cidx, cname, c_nf, c_float in self._consumers.get(i, []):
                if cname in PASS_OPS and depth < 6:
                    if not walk(cidx, depth + 1):
                        return False
                elif cname in WHERE_OPS:
                    if c_nf:
                        return False     # the selection kept the non-finite entries
                    seen_where = True
                elif c_float:
                    return False         # used by arithmetic, not only selected
            return True
        ok = walk(fwd_idx, 0)
        return bool(ok and seen_where)

    # ------------------------------------------------------------------ sinks
    def _taint_of(self, t: torch.Tensor, stage: str) -> _Origin | None:
        info = self._infos.get(id(t))
        if info is not None and info.ref() is t:
            return self._lookup(t)[2]
        return self._storage_taint(t)

    def _eval_grad_sink(self) -> None:
        res = []
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for pid, p in list(self._params.items()):
                name = self._param_ids[pid]
                g = getattr(p, "grad", None)
                if g is None or not N.is_checkable(g):
                    continue
                nan, inf = N.nonfinite_flags(g)
                if nan or inf:
                    res.append((name, self._taint_of(g, "backward")))
        self._grad_sink = res

    def _eval_opt_sink(self) -> None:
        res = []
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for pid, p in list(self._params.items()):
                name = self._param_ids[pid]
                if N.is_checkable(p) and any(N.nonfinite_flags(p)):
                    res.append((name, None, self._taint_of(p, "optimizer")))
            for opt in self.optimizers:
                for p, st in list(opt.state.items()):
                    if not isinstance(st, dict):
                        continue
                    pname = self._param_ids.get(id(p), "?")
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor) and N.is_checkable(v) and any(N.nonfinite_flags(v)):
                            res.append((pname, k, self._taint_of(v, "optimizer")))
        self._opt_sink = res

    # ------------------------------------------------------------------ result
    def result(self) -> dict:
        """The localisation (JSON-serialisable). Call after stop()."""
        if self._result is not None:
            return self._result
        prev_busy, self._busy = self._busy, True
        try:
            with torch._C.DisableTorchFunction(), torch.no_grad():
                self._sync_given()
                res = self._build_result()
        except Exception as e:
            res = {"reproduced": False, "phase": None, "origin": None, "preexisting": None, "optimizer": None,
                   "facts": {}, "n_ops": self._n_ops, "notes": self._notes + [f"result failed: {e!r}"[:200]]}
        finally:
            self._busy = prev_busy
        if self._stopped:
            self._result = res
        return res

    def _earliest(self, taints: list, stage: str | None = None) -> _Origin | None:
        ts = [t for t in taints if t is not None]
        real = [t for t in ts if t.real]
        pool = real or ts
        return min(pool, key=lambda o: o.seq) if pool else None

    def _fallback(self, stage: str) -> _Origin | None:
        real = [o for o in self._origins if o.real and o.kind in ("op", "preexisting")]
        same = [o for o in real if o.stage == stage]
        return (same or real or [None])[0]

    def _build_result(self) -> dict:
        notes = list(self._notes)
        sink_kind, sink_names, taint = None, [], None
        bad_loss = [(t, info) for t, info in self._loss_sinks if not info.get("finite", True)]
        if bad_loss:
            sink_kind = "loss"
            taint = self._earliest([t for t, _ in bad_loss])
            sink_names = [info.get("value") for _, info in bad_loss][:3]
            fb_stage = "forward"
        elif self._grad_sink:
            sink_kind = "grad"
            taint = self._earliest([t for _, t in self._grad_sink])
            sink_names = [n for n, _ in self._grad_sink][:10]
            fb_stage = "backward"
        elif self._opt_sink:
            sink_kind = "optimizer"
            taint = self._earliest([t for *_, t in self._opt_sink])
            sink_names = [n if k is None else f"{n}:{k}" for n, k, _ in self._opt_sink][:10]
            fb_stage = "optimizer"
        reproduced = sink_kind is not None
        if reproduced and taint is None:
            taint = self._fallback(fb_stage)
            notes.append("the non-finite sink could not be traced to an op; using the earliest real origin")
        res: dict[str, Any] = {"reproduced": reproduced, "phase": None, "origin": None, "preexisting": None,
                               "optimizer": None, "facts": {}, "n_ops": self._n_ops, "notes": notes,
                               "sink": {"kind": sink_kind, "names": sink_names},
                               "origins_seen": sum(1 for o in self._origins if o.kind == "op"),
                               "masked_nonfinite_origins": 0}
        if not reproduced:
            res["masked_nonfinite_origins"] = sum(1 for o in self._origins if o.kind in ("op", "constant"))
            if res["masked_nonfinite_origins"]:
                notes.append(f"{res['masked_nonfinite_origins']} non-finite intermediate(s) appeared but were "
                             "masked before reaching the loss, gradients or parameters")
            return res
        if taint is None:
            res["phase"] = {"loss": "forward", "grad": "backward", "optimizer": "optimizer"}[sink_kind]
            return res
        if taint.kind == "preexisting":
            t = taint.tref() if taint.tref is not None else None
            if t is not None and taint.pre_kind in ("param", "buffer", "data"):
                pn = self._param_name(t)    # names may have been learnt (or improved) after the first read
                if pn is not None and pn[1] is not None:
                    taint.pre_kind, taint.name = pn
            st = (taint.detail or {}).get("stats", {})
            fu = taint.first_use or {}
            is_data = taint.pre_kind == "data"   # batch rows only mean something for data
            res["preexisting"] = {"kind": taint.pre_kind, "name": taint.name,
                                  "samples": fu.get("samples", []) if is_data else [],
                                  "source_rows": fu.get("source_rows", []) if is_data else [], "stats": st,
                                  "rows_in_tensor": st.get("bad_rows", []), "first_use": fu or None,
                                  "written_by": (taint.detail or {}).get("written_by")}
            res["phase"] = {"data": "data", "param": "params", "buffer": "params",
                            "optimizer_state": "optimizer"}.get(taint.pre_kind, "data")
            res["facts"] = {"preexisting": {"kind": taint.pre_kind, "name": taint.name,
                                            "nonfinite": st.get("nonfinite"), "numel": st.get("numel")}}
            return res
        res["phase"] = {"loss": "forward", "grad": "backward", "optimizer": "optimizer"}[sink_kind]
        d = dict(taint.detail or {})
        facts = dict(d.pop("facts", {}) or {})
        if d.get("mask_escape"):
            facts["mask_escape"] = d["mask_escape"]
        if taint.kind == "constant":
            notes.append("a non-finite constant written by the program (e.g. masked_fill with -inf) reached the "
                         + sink_kind)
            facts["intentional_constant"] = True
        if taint.kind == "untracked":
            notes.append("the origin is a mutation outside the recorded ops")
        stage = d.get("stage") or taint.stage
        if "where_trap" not in facts and taint.kind == "op" and sink_kind == "grad" and stage == "forward":
            facts["where_trap"] = self._where_trap(taint.op)
        origin = {k: d.get(k) for k in ("op", "api", "module", "file", "line", "function", "dtype", "shape",
                                        "stage", "autograd_node", "forward_op", "forward_file", "forward_line",
                                        "forward_function", "forward_module", "inputs", "output", "samples")}
        origin["stage"] = stage
        origin["kind"] = taint.kind
        origin["forward_api"] = d.get("forward_api")
        origin["scalars"] = d.get("scalars")
        origin["module_type"] = d.get("module_type")
        if stage == "backward" and d.get("forward_line") is not None:
            origin["backward_file"], origin["backward_line"] = d.get("file"), d.get("line")
            origin["file"], origin["line"] = d.get("forward_file"), d.get("forward_line")
            origin["function"] = d.get("forward_function")
            if d.get("forward_module") is not None:
                origin["module"] = d.get("forward_module")
        if origin["inputs"] is None:
            origin["inputs"] = []
        if origin["output"] is None:
            origin["output"] = {"nan": 0, "posinf": 0, "neginf": 0}
        if origin["samples"] is None:
            origin["samples"] = []
        res["origin"] = origin
        res["facts"] = facts
        if stage == "optimizer" or sink_kind == "optimizer":
            res["optimizer"] = self._optimizer_info(taint)
        return res

    def _optimizer_info(self, taint: _Origin) -> dict | None:
        if not self.optimizers and not self._opt_sink:
            return None
        ident: dict[int, tuple[str, str | None]] = {}
        for pid in self._params:
            ident[pid] = (self._param_ids[pid], None)
        for opt in self.optimizers:
            for p, st in list(opt.state.items()):
                if isinstance(st, dict):
                    pname = self._param_ids.get(id(p), "?")
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor):
                            ident[id(v)] = (pname, k)
        assoc = dict(ident)
        d = taint.detail or {}
        pos0 = (d.get("positions") or [None])[0]
        found: list[tuple[Any, tuple]] = []
        for idx, ins, outs in self._opt_ops:
            by_pos: dict[Any, list] = {}
            for k, p, tid in ins:
                a = assoc.get(tid)
                if a is not None:
                    by_pos.setdefault(p, []).append((k, a))
            if idx == taint.op:
                for p in ([pos0] if pos0 is not None else list(by_pos)):
                    found += by_pos.get(p, [])
                if pos0 is not None:
                    found += by_pos.get(None, [])
            for p, tid in outs:
                if tid in ident:
                    continue
                cand = by_pos.get(p) or by_pos.get(None) or [x for v in by_pos.values() for x in v]
                if cand:
                    withkey = [c for c in cand if c[1][1] is not None]
                    assoc[tid] = (withkey or cand)[0][1]
        name = d.get("name") or ""
        den_key = {"addcdiv": 2, "_foreach_addcdiv": 2, "div": 1, "_foreach_div": 1, "reciprocal": 0,
                   "_foreach_reciprocal": 0}.get(name)
        param = next((a[0] for _k, a in found if a[0] and a[0] != "?"), None)
        state = next((a[1] for k, a in found if k == den_key and a[1] is not None), None) if den_key is not None \
            else None
        state = state or next((a[1] for _k, a in found if a[1] is not None and a[1] != "step"), None)
        info: dict[str, Any] = {"param": param, "state": state, "inputs": [
            {"arg": str(k), "param": a[0], "state": a[1]} for k, a in found][:10]}
        if self._opt_sink:
            info["nonfinite_after_step"] = [n if k is None else f"{n}:{k}" for n, k, _ in self._opt_sink][:10]
            if info["param"] is None:
                info["param"] = self._opt_sink[0][0]
            if info["state"] is None:
                info["state"] = next((k for _n, k, _t in self._opt_sink if k), None)
        for opt in self.optimizers:
            info["optimizer"] = type(opt).__name__
            g = opt.param_groups[0]
            for key in ("lr", "eps", "weight_decay", "betas", "momentum"):
                if key in g:
                    v = g[key]
                    if isinstance(v, torch.Tensor):
                        v = v.item()
                    info[key] = [jnum(x) for x in v] if isinstance(v, (list, tuple)) else jnum(v)
            by_name = {self._param_ids[pid]: p for pid, p in self._params.items()}
            if param and param in by_name:
                pdt = by_name[param].dtype
                info["param_dtype"] = N.dtype_name(pdt)
                if "eps" in g and isinstance(g["eps"], (int, float)) and pdt.is_floating_point:
                    info["eps_fact"] = N.eps_fact(float(g["eps"]), pdt)
            break
        return info
