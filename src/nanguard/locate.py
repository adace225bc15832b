"""Stage 2: find where the first non-finite value of one training step is born.

``OpRecorder`` records every ATen op of one armed training step (forward,
backward and optimizer update) with a ``TorchDispatchMode``, knows the torch
API call that issued each op (``TorchFunctionMode``), the module whose forward
is running (global module hooks) and, for backward ops, the forward op that
created the autograd node (anomaly-mode metadata plus our own tag on every
node).

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
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import _numerics as N
from ._numerics import jnum

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
REDUCE_OPS = {"sum", "mean", "count_nonzero", "nansum", "nanmean", "_foreach_sum", "bincount", "amax",
              "matmul", "mm", "bmm", "einsum", "prod"}
EPS_PRODUCERS = {"add", "sub", "rsub", "clamp", "clamp_min", "_foreach_add", "_foreach_sub",
                 "_foreach_clamp_min", "addcmul", "_foreach_addcmul"}
# Torch API entries that do not enclose forward ops (we must not attribute backward ops to them).
_API_SKIP_NAMES = {"backward", "grad", "__get__", "__set__", "__delete__", "run_backward", "_engine_run_backward"}

# Strong references are kept to inputs of these forward ops so that a backward origin can re-examine
# (and re-run) its forward op. Budget in elements.
_KEEP_FWD = LOG_OPS | SQRT_OPS | NORM_OPS | POW_OPS | TRIG_OPS | EXP_OPS | DIV_OPS | SOFTMAX_OPS | STDVAR_OPS
_KEEP_FWD_BUDGET = 64_000_000
_RING = 256          # strong refs to args of the most recent low-precision ops (float32 re-run chain)
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


def _default_user_file(fn: str, excluded: tuple[str, ...]) -> bool:
    if not fn:
        return False
    if fn.startswith("<"):
        return not fn.startswith(("<frozen", "<__array_function__"))
    if "site-packages" in fn or "dist-packages" in fn:
        return False
    try:
        real = os.path.realpath(fn)
    except Exception:
        real = fn
    return not any(real == p or real.startswith(p + os.sep) for p in excluded)


def _excluded_dirs() -> tuple[str, ...]:
    dirs = {os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__))}
    for key in ("stdlib", "platstdlib"):
        try:
            dirs.add(sysconfig.get_paths()[key])
        except Exception:
            pass
    return tuple(sorted({os.path.realpath(d) for d in dirs if d}))


def _flat_tensors(args: Sequence[Any], kwargs: dict) -> list[tuple[int | str, int | None, torch.Tensor]]:
    """(arg key, list position or None, tensor) for every tensor argument."""
    out = []
    for key, a in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(a, torch.Tensor):
            out.append((key, None, a))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, torch.Tensor):
                    out.append((key, j, b))
    return out


def _flat_scalars(args: Sequence[Any], kwargs: dict) -> list[tuple[int | str, int | None, float]]:
    out = []
    for key, a in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(a, float) or (isinstance(a, int) and not isinstance(a, bool)):
            out.append((key, None, a))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, float) or (isinstance(b, int) and not isinstance(b, bool)):
                    out.append((key, j, b))
    return out


def _nonfinite_scalar(x: Any) -> tuple[bool, bool]:
    if isinstance(x, float):
        return math.isnan(x), math.isinf(x)
    return False, False


class _Info:
    """What we know about one tensor object: finiteness at a version, taint, producer op."""
    __slots__ = ("ref", "ver", "nan", "inf", "taint", "prod")

    def __init__(self, ref, ver, nan, inf, taint, prod):
        self.ref, self.ver, self.nan, self.inf, self.taint, self.prod = ref, ver, nan, inf, taint, prod


class _Origin:
    """A taint source. kind: 'op' (real origin), 'constant', 'preexisting', 'untracked'."""
    __slots__ = ("seq", "kind", "soft", "op", "stage", "detail", "pre_kind", "name", "first_use")

    def __init__(self, seq, kind, soft, op=None, stage=None):
        self.seq, self.kind, self.soft, self.op, self.stage = seq, kind, soft, op, stage
        self.detail: dict | None = None
        self.pre_kind: str | None = None
        self.name: str | None = None
        self.first_use: dict | None = None

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
                with torch._C.DisableTorchFunction(), torch.no_grad():
                    rec._after(func, args, kwargs, out, pre)
            except Exception as e:
                rec._fail(e)
            finally:
                rec._busy = False
        return out


class OpRecorder:
    """Record every ATen op of one training step and find where a non-finite value is born."""

    def __init__(self, *, named_params: dict[str, torch.Tensor], named_buffers: dict[str, torch.Tensor],
                 roots: Sequence[torch.nn.Module] = (), optimizers: Sequence[torch.optim.Optimizer] = (),
                 user_file_filter: Callable[[str], bool] | None = None, max_records: int = 200_000):
        self.named_params = dict(named_params or {})
        self.named_buffers = dict(named_buffers or {})
        self.roots = list(roots)
        self.optimizers = list(optimizers)
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
        self._mod_names: dict[int, str] = {}
        self._mod_types: dict[int, str] = {}
        self._infos: dict[int, _Info] = {}
        self._by_storage: dict[int, _Origin] = {}
        self._origins: list[_Origin] = []
        self._n_ops = 0
        # light per-op records (parallel lists, up to max_records)
        self._op_name: list[str] = []
        self._op_stage: list[str] = []
        self._op_module: list[str | None] = []
        self._op_api: list[str | None] = []
        self._op_scalars: list[tuple] = []
        self._op_frame: list[tuple | None] = []
        self._op_outnf: list[bool] = []
        self._consumers: dict[int, list[tuple[int, str, bool]]] = {}
        self._ring: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._keep: dict[int, tuple] = {}
        self._keep_elems = 0
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

    def __enter__(self) -> "OpRecorder":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Arm: dispatch + function modes, anomaly metadata, global module hooks."""
        if self._started:
            return
        self._started = True
        self._index_known_tensors()
        for root in self.roots:
            self._register_module_tree(root)
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
                if self._stage == "optimizer" or self._opt_ops:
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
        self._ring.clear()

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
    def _index_known_tensors(self) -> None:
        def sptr(t):
            try:
                return t.untyped_storage().data_ptr()
            except Exception:
                return None
        for name, p in self.named_params.items():
            if isinstance(p, torch.Tensor):
                self._param_ids[id(p)] = name
                s = sptr(p)
                if s:
                    self._param_storage[s] = name
                if p.grad is not None:
                    self._grad_ids[id(p.grad)] = name
        for name, b in self.named_buffers.items():
            if isinstance(b, torch.Tensor):
                self._buffer_ids[id(b)] = name
                s = sptr(b)
                if s:
                    self._buffer_storage[s] = name
        # parameters of the optimizers that the caller did not name
        for opt in self.optimizers:
            for gi, g in enumerate(opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    if id(p) not in self._param_ids:
                        nm = f"param_groups[{gi}].params[{pi}]"
                        self._param_ids[id(p)] = nm
                        self.named_params[nm] = p
        self._index_optimizer_state()

    def _index_optimizer_state(self) -> None:
        for opt in self.optimizers:
            for p, st in list(opt.state.items()):
                pname = self._param_ids.get(id(p), "?")
                if isinstance(st, dict):
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor):
                            self._state_ids[id(v)] = (pname, k)

    # ------------------------------------------------------------------ module path
    def _register_module_tree(self, root: torch.nn.Module, prefix: str = "") -> None:
        try:
            for name, m in root.named_modules(remove_duplicate=False):
                full = f"{prefix}.{name}" if prefix and name else (prefix or name)
                self._mod_names.setdefault(id(m), full)
                self._mod_types[id(m)] = type(m).__name__
        except Exception:
            pass

    def _mod_pre(self, mod, args) -> None:
        if not self._armed:
            return
        name = self._mod_names.get(id(mod))
        if name is None:
            if not self._mod_stack:          # a module called at top level: a root
                self._register_module_tree(mod)
                name = self._mod_names.get(id(mod), "")
            else:                            # unregistered child: attribute to its caller
                name = self._mod_stack[-1]
                self._mod_names[id(mod)] = name
                self._mod_types[id(mod)] = type(mod).__name__
        self._mod_stack.append(name)

    def _mod_post(self, mod, args, out) -> None:
        if self._armed and self._mod_stack:
            self._mod_stack.pop()

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
        if info is not None and info.ref() is t:
            if ver is not None and info.ver == ver:
                return info.nan, info.inf, info.taint, info
            nan, inf = N.nonfinite_flags(t)
            taint = None
            if nan or inf:
                taint = info.taint if (info.nan or info.inf) else None
                taint = taint or self._storage_taint(t) or self._untracked(t)
            info.ver, info.nan, info.inf, info.taint = ver, nan, inf, taint
            return nan, inf, taint, info
        nan, inf = N.nonfinite_flags(t)
        taint = None
        if nan or inf:
            taint = self._storage_taint(t) or self._preexisting(t, nan, inf)
        info = _Info(weakref.ref(t), ver, nan, inf, taint, None)
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
        st = N.tensor_stats(t)
        st["bad_rows"] = N.bad_rows(t)
        o.detail = {"stats": st}
        self._origins.append(o)
        return o

    def _cur_stage(self) -> str:
        try:
            if torch._C._current_autograd_node() is not None:
                return "backward"
        except Exception:
            pass
        return self._stage

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
        tens = _flat_tensors(args, kwargs)
        ins = []
        for key, pos, t in tens:
            nan, inf, taint, info = self._lookup(t)
            ins.append((key, pos, t, nan, inf, taint, info.prod if info is not None else None))
        scal = [(k, p, v) for k, p, v in _flat_scalars(args, kwargs)]
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

        def add(t, pos):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                outs.append((pos, t))
        if isinstance(out, torch.Tensor):
            add(out, None)
        elif isinstance(out, (list, tuple)):
            for j, o in enumerate(out):
                if isinstance(o, (list, tuple)):
                    for jj, oo in enumerate(o):
                        add(oo, jj)
                else:
                    add(o, j if foreach else None)
        for _key, m in self._mutated(func, args, kwargs):
            if isinstance(m, torch.Tensor):
                add(m, None)
            elif isinstance(m, (list, tuple)):
                for j, mm in enumerate(m):
                    add(mm, j)
        if not foreach:
            outs = [(None if p is not None and len(outs) > 0 and not foreach else p, t) for p, t in outs]

        module = self._mod_stack[-1] if self._mod_stack else None
        api = self._api_stack[-1][0] if self._api_stack else None
        scalars = tuple(v for _k, _p, v in scal[:6])
        low = False
        any_nf = False
        results = []
        for pos, t in outs:
            if not N.is_checkable(t):
                continue
            if t.dtype in N.LOW_PRECISION:
                low = True
            nan, inf = N.nonfinite_flags(t)
            results.append((pos, t, nan, inf))
            any_nf = any_nf or nan or inf

        if record:
            self._op_name.append(name)
            self._op_stage.append(stage)
            self._op_module.append(module)
            self._op_api.append(api)
            self._op_scalars.append(scalars)
            self._op_outnf.append(any_nf)
            self._op_frame.append(self._user_frame() if stage == "forward" else None)
            if low:
                self._ring[idx] = (func, args, kwargs)
                if len(self._ring) > _RING:
                    self._ring.popitem(last=False)
            if stage == "forward" and name in _KEEP_FWD and self._keep_elems < _KEEP_FWD_BUDGET:
                n = sum(int(t.numel()) for _k, _p, t, *_ in ins)
                if self._keep_elems + n <= _KEEP_FWD_BUDGET:
                    self._keep[idx] = (func, args, kwargs)
                    self._keep_elems += n
        if stage == "optimizer" and record:
            self._opt_ops.append((idx, [(k, p, id(t)) for k, p, t, *_ in ins], [(p, id(t)) for p, t in outs]))

        # consumers of non-finite forward tensors (where-trap evidence)
        if stage == "forward":
            for _k, _p, _t, nan_i, inf_i, _tn, prod in ins:
                if (nan_i or inf_i) and prod is not None:
                    self._consumers.setdefault(prod[0], []).append((idx, name, any_nf))

        # taint decision per output
        new_origin: _Origin | None = None
        new_const: _Origin | None = None
        for pos, t, nan, inf in results:
            taint = None
            if nan or inf:
                rel = [i for i in ins if not foreach or i[1] is None or i[1] == pos]
                rel_s = [s for s in scal if not foreach or s[1] is None or s[1] == pos]
                taint = self._decide(nan, inf, rel, rel_s)
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
            self._set_info(t, nan, inf, taint, (idx, pos), mutated=_is_inplace(func) or t in_args(t, args, kwargs))
            if stage == "forward" and record:
                self._pending.append((weakref.ref(t), idx))
        if new_origin is not None:
            self._describe_origin(new_origin, func, name, args, kwargs, ins, scal, results, stage, module, api)
        if new_const is not None:
            fr = self._user_frame()
            new_const.detail = {"op": str(func), "api": api, "module": module, "stage": stage,
                                "file": fr[0] if fr else None, "line": fr[1] if fr else None,
                                "function": fr[2] if fr else None}

    def _decide(self, out_nan: bool, out_inf: bool, ins: list, scal: list):
        real = [i[5] for i in ins if i[5] is not None and i[5].real]
        if real:
            return min(real, key=lambda o: o.seq)
        s_nan = any(_nonfinite_scalar(v)[0] for _k, _p, v in scal)
        s_inf = any(_nonfinite_scalar(v)[1] for _k, _p, v in scal)
        in_nan = s_nan or any(i[3] for i in ins)
        in_inf = s_inf or any(i[4] for i in ins)
        if out_nan and not in_nan:
            return "new"                      # NaN out of NaN-free inputs (incl. softmax of all -inf)
        if out_inf and not out_nan and not in_inf:
            return "new"                      # overflow / division by zero / log(0) from finite inputs
        soft = [i[5] for i in ins if i[5] is not None]
        if soft:
            return min(soft, key=lambda o: o.seq)
        return "const"                        # introduced from a non-finite scalar constant

    def _set_info(self, t, nan, inf, taint, prod, mutated: bool) -> None:
        ver = N.version(t)
        if mutated and ver is not None:
            ver += 1   # ADInplaceOrView bumps the version after this mode returns
        info = self._infos.get(id(t))
        if info is not None and info.ref() is t:
            info.ver, info.nan, info.inf, info.taint, info.prod = ver, nan, inf, taint, prod
        else:
            self._infos[id(t)] = _Info(weakref.ref(t), ver, nan, inf, taint, prod)
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
    def _first_use(self, func, name, args, out, stage) -> dict:
        """Where a pre-existing non-finite tensor first enters the step (sample rows, source rows)."""
        fr = self._user_frame()
        d = {"op": str(func), "stage": stage, "file": fr[0] if fr else None, "line": fr[1] if fr else None,
             "function": fr[2] if fr else None, "samples": N.bad_rows(out), "source_rows": []}
        try:
            if name in INDEX_OPS and d["samples"]:
                index = None
                if name == "index" and len(args) > 1 and isinstance(args[1], (list, tuple)) and args[1]:
                    index = args[1][0]
                elif name == "index_select" and len(args) > 2 and args[1] == 0:
                    index = args[2]
                elif name == "embedding" and len(args) > 1:
                    index = args[1]
                elif name == "take" and len(args) > 1:
                    index = args[1]
                if isinstance(index, torch.Tensor):
                    if index.dtype == torch.bool:
                        index = aten.reshape.default(aten.nonzero.default(index)[:, 0], [-1])
                    if not index.dtype.is_floating_point and index.dim() >= 1:
                        flat = index if index.dim() == 1 else index.reshape(index.shape[0], -1)[:, 0]
                        d["source_rows"] = sorted({int(flat[r]) for r in d["samples"] if r < flat.shape[0]})
        except Exception as e:
            d["source_rows_error"] = str(e)[:100]
        return d

    def _describe_origin(self, o: _Origin, func, name, args, kwargs, ins, scal, results, stage, module, api) -> None:
        bad = [(pos, t, nan, inf) for pos, t, nan, inf in results if nan or inf]
        pos0, t0 = bad[0][0], bad[0][1]
        fr = self._user_frame()
        d: dict[str, Any] = {"op": str(func), "name": name, "api": api, "module": module, "stage": stage,
                             "file": fr[0] if fr else None, "line": fr[1] if fr else None,
                             "function": fr[2] if fr else None, "dtype": N.dtype_name(t0.dtype),
                             "shape": list(t0.shape), "positions": [p for p, *_ in bad if p is not None][:10]}
        # the module type is handy for reports
        d["autograd_node"] = None
        fwd_idx = None
        node = None
        if stage == "backward":
            try:
                node = torch._C._current_autograd_node()
            except Exception:
                node = None
            if node is not None:
                d["autograd_node"] = node.name()
                try:
                    md = node.metadata
                    fwd_idx = md.get("nanguard_fwd")
                    tb = md.get("traceback_")
                    ffr = self._frame_from_traceback(tb)
                except Exception:
                    ffr = None
                if fwd_idx is not None and fwd_idx < len(self._op_name):
                    d["forward_idx"] = fwd_idx
                    d["forward_op"] = self._op_full(fwd_idx)
                    d["forward_module"] = self._op_module[fwd_idx]
                    d["forward_api"] = self._op_api[fwd_idx]
                    if ffr is None:
                        ffr = self._op_frame[fwd_idx]
                if ffr is not None:
                    d["forward_file"], d["forward_line"], d["forward_function"] = ffr
        d["output"] = N.nonfinite_counts(t0)
        d["samples"] = N.bad_rows(t0)
        o.detail = d
        if o.seq >= _MAX_DETAILED:
            return
        rel = [i for i in ins if pos0 is None or i[1] is None or i[1] == pos0]
        d["inputs"] = []
        for key, pos, t, *_ in rel[:6]:
            st = N.tensor_stats(t)
            st["arg"] = key if pos is None else f"{key}[{pos}]"
            d["inputs"].append(st)
        d["scalars"] = [jnum(v) for _k, p, v in scal if pos0 is None or p is None or p == pos0][:6]
        try:
            d["facts"] = self._facts(func, name, args, kwargs, rel, scal, t0, pos0, stage, fwd_idx, api)
        except Exception as e:
            d["facts"] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}

    def _op_full(self, idx: int) -> str | None:
        return self._op_name_full.get(idx) if hasattr(self, "_op_name_full") else None
