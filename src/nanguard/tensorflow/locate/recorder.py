"""The TensorFlow op recorder: every eager op of one training step, with provenance.

How: the step runs **eagerly** (``tf.config.run_functions_eagerly(True)`` while armed, so a
``tf.function`` step or Keras' ``train_function`` executes its Python op by op) and TensorFlow's
op callback (``op_callbacks.add_op_callback``, the hook ``tf.debugging.enable_check_numerics`` and
tfdbg use) hands the recorder every executed op with its input and output tensors. The recorder
also registers a wrapper around the tape's gradient function (``TFE_Py_RegisterGradientFunction``)
so that each op run by a gradient function is known to belong to the backward of a given forward
op, and wraps ``Layer.__call__`` / ``Loss.__call__`` (:mod:`.naming`) to name layers and lines.

Provenance works like the PyTorch recorder: each non-finite tensor carries a taint that points to
the op that made non-finite values out of finite inputs (a real origin), to an intentional
non-finite constant (``tf.where(mask, s, -inf)``'s ``-inf``), or to a tensor that was already
non-finite before the step (the batch, a variable). The origin reported is the taint that reaches a
sink: the loss (``GradientTape.gradient``'s target), the gradients it returns, or the variables the
optimizer writes. Non-finite values masked away (an unselected ``tf.where`` branch, softmax rows
with some finite logits after a ``-inf`` mask) never reach a sink and are ignored. Eager
``EagerTensor``s are immutable, so a weak reference and the object id identify each value;
variables are followed through their handles (``ReadVariableOp`` / ``Assign*VariableOp``).
"""
from __future__ import annotations

import collections
import sys
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop
from tensorflow.python.framework import op_callbacks

from . import evidence as E
from . import naming
from . import numerics as N
from . import ops as O
from .numerics import jnum

_MAX_DETAILED = 64           # origins that get full input stats and facts
_KEEP_FWD_BUDGET = 16_000_000
_RING = 256
_RING_BUDGET = 16_000_000
_IN_PROD = 8


class _Info:
    """What we know about one tensor: finiteness, taint, producer (op index, output position)."""
    __slots__ = ("ref", "nan", "inf", "taint", "prod")

    def __init__(self, ref, nan, inf, taint, prod):
        self.ref, self.nan, self.inf, self.taint, self.prod = ref, nan, inf, taint, prod


class _Origin:
    """A taint source. kind: 'op' (real origin), 'constant', 'preexisting', 'untracked'."""
    __slots__ = ("seq", "kind", "soft", "op", "stage", "detail", "pre_kind", "name", "first_use", "tref", "hid")

    def __init__(self, seq, kind, soft, op=None, stage=None):
        self.seq, self.kind, self.soft, self.op, self.stage = seq, kind, soft, op, stage
        self.hid: Optional[int] = None     # the variable's handle id, for a variable
        self.detail: Optional[dict] = None
        self.pre_kind: Optional[str] = None
        self.name: Optional[str] = None
        self.first_use: Optional[dict] = None
        self.tref: Any = None

    @property
    def real(self) -> bool:
        return not self.soft


class _Var:
    __slots__ = ("name", "kind", "ref", "dtype")

    def __init__(self, name, kind, ref, dtype):
        self.name, self.kind, self.ref, self.dtype = name, kind, ref, dtype


def _np(t: Any) -> Optional[np.ndarray]:
    try:
        return t.numpy()
    except Exception:
        return None


def _is_eager(t: Any) -> bool:
    return hasattr(t, "numpy") and hasattr(t, "dtype") and not isinstance(t, tf.Variable) and \
        type(t).__name__ == "EagerTensor"


def _numel(t: Any) -> int:
    """Element count of an eager tensor without building a TensorShape (hot path)."""
    try:
        n = 1
        for d in t._shape_tuple():
            n *= int(d)
        return n
    except Exception:
        try:
            return int(t.shape.num_elements() or 0)
        except Exception:
            return 0


def _dtype_name(dt: Any) -> Optional[str]:
    try:
        return tf.as_dtype(dt).name
    except Exception:
        return None


class TFRecorder:
    """Record every op of one eager training step and find where the first non-finite value is born.

    Call order (the watcher's replay hooks, or ``hooks=True`` for the recorder's own)::

        rec.start()                       # before the step's forward
        ... forward ...; rec.mark_loss(loss)           # GradientTape.gradient's target(s)
        rec.set_stage("backward"); grads = tape.gradient(...); rec.mark_grads(grads, sources)
        rec.set_stage("optimizer"); optimizer.apply(...)  # when apply_update
        rec.set_stage("forward")
        rec.stop()
        loc = rec.result()

    ``hooks=True`` wraps ``tf.GradientTape.gradient`` and Keras' ``BaseOptimizer.apply`` while
    armed to make those calls itself (for use without nanguard's watcher). With ``apply_update``
    False those hooks skip the optimizer's update.
    """

    def __init__(self, *, model: Any = None, models: Sequence[Any] = (), optimizer: Any = None,
                 variables: Any = None, hooks: bool = False, apply_update: bool = True,
                 run_eagerly: bool = True, user_file_filter: Optional[Callable[[str], bool]] = None,
                 max_records: int = 200_000, detail_limit: int = _MAX_DETAILED):
        self.model = model
        self.models = [m for m in ([model] if model is not None else []) + list(models or ()) if m is not None]
        self.optimizer = optimizer
        self.given_variables = variables
        self.hooks = bool(hooks)
        self.apply_update = bool(apply_update)
        self.run_eagerly = bool(run_eagerly)
        self.users = naming.UserFiles(user_file_filter) if user_file_filter else naming.default_user_files()
        self.max_records = int(max_records)
        self.detail_limit = int(detail_limit)
        self._reset()

    # ------------------------------------------------------------------ lifecycle
    def _reset(self) -> None:
        self._armed = False
        self._busy = False
        self._started = False
        self._stopped = False
        self._stage = "forward"
        self._thread: Optional[int] = None
        self._comps = naming.ComponentStack()
        self._grad_ctx: list[Optional[int]] = []
        self._claimed: set[int] = set()
        self._infos: dict[int, _Info] = {}
        self._origins: list[_Origin] = []
        self._n_ops = 0
        # per-op records (parallel lists, up to max_records)
        self.op_type: list[str] = []
        self.op_canon: list[str] = []
        self.op_stage: list[str] = []
        self.op_fwd: list[Optional[int]] = []
        self.op_loc: list[Optional[naming.Location]] = []
        self.op_inprod: list[tuple] = []
        self.op_in_ids: list[tuple] = []
        self.op_scalars: list[tuple] = []
        self.op_outnf: list[bool] = []
        self._fwd_by_type: dict[str, list[int]] = {}
        self._consumers: dict[int, list[tuple[int, str, bool, bool]]] = {}
        self._keep: dict[int, tuple] = {}
        self._keep_elems = 0
        self._ring: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._ring_elems = 0
        self._vars: dict[int, _Var] = {}
        self._var_start_nf: dict[int, tuple[bool, bool]] = {}
        self._var_taint: dict[int, Optional[_Origin]] = {}
        self._var_pre: dict[int, _Origin] = {}
        self._opt_written: dict[int, Any] = {}
        self._opt_seen = False
        self._loss_sinks: list[tuple[Optional[_Origin], dict]] = []
        self._grad_sink: list[tuple[str, Optional[_Origin]]] = []
        self._grad_marked = False
        self._opt_sink: list[tuple[str, str, Optional[_Origin]]] = []
        self._notes: list[str] = []
        self._errors = 0
        self._result: Optional[dict] = None
        self._undo: list[Callable[[], None]] = []
        self._prev_eager: Optional[bool] = None
        self._escaped_mask: Optional[_Origin] = None
        self._cb = None

    def __enter__(self) -> "TFRecorder":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Arm: op callback, gradient-function wrapper, layer/loss call tracking, eager functions."""
        if self._started:
            return
        self._started = True
        self._thread = threading.get_ident()
        try:
            self._index_variables()
            self._comps.on_root = self._on_root
            self._comps.install()
            self._undo.append(self._comps.uninstall)
            rec = self

            def grad_fn(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip, scope):
                fwd = None
                if rec._armed and threading.get_ident() == rec._thread:
                    try:
                        fwd = rec._match_forward(O.op_type_str(op_name), inputs, outputs)
                    except Exception as e:
                        rec._fail(e)
                rec._grad_ctx.append(fwd)
                try:
                    return backprop._gradient_function(op_name, attr_tuple, num_inputs, inputs, outputs,
                                                       out_grads, skip, scope)
                finally:
                    rec._grad_ctx.pop()
            pywrap_tfe.TFE_Py_RegisterGradientFunction(grad_fn)
            self._undo.append(lambda: pywrap_tfe.TFE_Py_RegisterGradientFunction(backprop._gradient_function))

            def cb(op_type, inputs, attrs, outputs, op_name=None, graph=None):
                if graph is not None or rec._busy or not rec._armed:
                    return None
                rec._busy = True
                try:
                    rec._on_op(op_type, inputs, attrs, outputs)
                except Exception as e:  # the recorder must never break training
                    rec._fail(e)
                finally:
                    rec._busy = False
                return None
            self._cb = cb
            op_callbacks.add_op_callback(cb)
            self._undo.append(lambda: op_callbacks.remove_op_callback(cb))
            if self.run_eagerly:
                self._prev_eager = tf.config.functions_run_eagerly()
                tf.config.run_functions_eagerly(True)
                prev = self._prev_eager
                self._undo.append(lambda: tf.config.run_functions_eagerly(prev))
            if self.hooks:
                self._install_hooks()
        except Exception:
            self._teardown()
            raise
        self._armed = True

    def stop(self) -> None:
        """Disarm (idempotent), evaluate the optimizer sink, remove every hook."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._armed = False
        try:
            self._busy = True
            try:
                if self._opt_seen or self._opt_written:
                    self._eval_opt_sink()
            except Exception as e:
                self._fail(e)
            finally:
                self._busy = False
        finally:
            self._teardown()

    def _teardown(self) -> None:
        while self._undo:
            f = self._undo.pop()
            try:
                f()
            except Exception as e:
                self._notes.append(f"teardown: {type(e).__name__}: {e}"[:200])
        self._ring.clear()
        self._ring_elems = 0

    def _install_hooks(self) -> None:
        """Own GradientTape.gradient / Optimizer.apply hooks (when nanguard's watcher is not there)."""
        rec = self
        orig_grad = tf.GradientTape.gradient

        def gradient(tape, target, sources, *a, **k):
            if not rec._armed or threading.get_ident() != rec._thread:
                return orig_grad(tape, target, sources, *a, **k)
            for t in tf.nest.flatten(target):
                if isinstance(t, tf.Tensor):
                    rec.mark_loss(t)
            rec.set_stage("backward")
            try:
                out = orig_grad(tape, target, sources, *a, **k)
            finally:
                rec.set_stage("forward")
            rec.mark_grads(out, sources)
            return out
        tf.GradientTape.gradient = gradient
        self._undo.append(lambda: setattr(tf.GradientTape, "gradient", orig_grad))
        try:
            from keras.src.optimizers.base_optimizer import BaseOptimizer
        except Exception:
            return
        orig_apply = BaseOptimizer.__dict__["apply"]
        depth = [0]

        def apply(opt, grads, trainable_variables=None):
            if not rec._armed or threading.get_ident() != rec._thread or depth[0]:
                return orig_apply(opt, grads, trainable_variables)
            if rec.optimizer is None:
                rec.optimizer = opt
                rec._index_optimizer(opt)
            rec.set_stage("optimizer")
            depth[0] += 1
            try:
                if rec.apply_update:
                    return orig_apply(opt, grads, trainable_variables)
                return None
            finally:
                depth[0] -= 1
                rec.set_stage("forward")
        BaseOptimizer.apply = apply
        self._undo.append(lambda: setattr(BaseOptimizer, "apply", orig_apply))
        # LossScaleOptimizer overrides apply; wrap it too so that its checks count as the update
        try:
            from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
            orig_lso = LossScaleOptimizer.__dict__["apply"]

            def lso_apply(opt, grads, trainable_variables=None):
                if not rec._armed or threading.get_ident() != rec._thread or depth[0]:
                    return orig_lso(opt, grads, trainable_variables)
                if rec.optimizer is None:
                    rec.optimizer = opt
                    rec._index_optimizer(opt)
                rec.set_stage("optimizer")
                depth[0] += 1
                try:
                    if rec.apply_update:
                        return orig_lso(opt, grads, trainable_variables)
                    return None
                finally:
                    depth[0] -= 1
                    rec.set_stage("forward")
            LossScaleOptimizer.apply = lso_apply
            self._undo.append(lambda: setattr(LossScaleOptimizer, "apply", orig_lso))
        except Exception:
            pass

    # ------------------------------------------------------------------ caller API
    def paused(self):
        """Context manager: run your own TF code while armed without it being recorded."""
        rec = self

        class _P:
            def __enter__(self_inner):
                self_inner.prev = rec._busy
                rec._busy = True

            def __exit__(self_inner, *exc):
                rec._busy = self_inner.prev
        return _P()

    def set_stage(self, stage: str) -> None:
        if stage not in ("forward", "backward", "optimizer"):
            raise ValueError(f"unknown stage {stage!r}")
        if stage == "backward" and self._stage != "backward":
            self._claimed = set()
        if stage == "optimizer":
            self._opt_seen = True
            if self.optimizer is not None:
                self._index_optimizer(self.optimizer)
        self._stage = stage

    def mark_loss(self, loss: Any) -> None:
        """A tensor ``GradientTape.gradient`` differentiates (forward sink); may be called several times."""
        prev, self._busy = self._busy, True
        try:
            for t in tf.nest.flatten(loss):
                if not _is_eager(t) or not N.is_float_dtype(t.dtype):
                    continue
                a = _np(t)
                if a is None:
                    continue
                nan, inf = N.nonfinite_flags(a)
                if not (nan or inf):
                    self._loss_sinks.append((None, {"finite": True}))
                    continue
                taint = self._taint_of(t)
                self._loss_sinks.append((taint, {"finite": False, "value": jnum(a.reshape(-1)[0]) if a.size else None,
                                                 "shape": [int(s) for s in a.shape]}))
        except Exception as e:
            self._fail(e)
        finally:
            self._busy = prev

    def mark_grads(self, grads: Any, sources: Any) -> None:
        """What ``GradientTape.gradient`` returned, with its sources (variables): the gradient sink."""
        prev, self._busy = self._busy, True
        try:
            self._grad_marked = True
            g_flat = tf.nest.flatten(grads, expand_composites=False)
            s_flat = tf.nest.flatten(sources, expand_composites=False)
            for i, g in enumerate(g_flat):
                if g is None:
                    continue
                src = s_flat[i] if i < len(s_flat) else None
                vals = getattr(g, "values", g)   # IndexedSlices
                if not _is_eager(vals) or not N.is_float_dtype(vals.dtype):
                    continue
                a = _np(vals)
                if a is None:
                    continue
                nan, inf = N.nonfinite_flags(a)
                if nan or inf:
                    self._grad_sink.append((self._source_name(src, i), self._taint_of(vals)))
        except Exception as e:
            self._fail(e)
        finally:
            self._busy = prev

    # ------------------------------------------------------------------ variables
    def _add_var(self, v: Any, name: Optional[str], kind: str) -> None:
        h = self._handle(v)
        if h is None:
            return
        cur = self._vars.get(id(h))
        rank = {"param": 3, "buffer": 2, "optimizer_state": 1}
        if cur is not None and rank.get(cur.kind, 0) >= rank.get(kind, 0) and cur.name:
            return
        nm = name or getattr(v, "path", None) or getattr(v, "name", None)
        try:
            ref = weakref.ref(v)
        except TypeError:
            ref = (lambda v=v: v)
        self._vars[id(h)] = _Var(str(nm) if nm is not None else None, kind, ref, getattr(v, "dtype", None))
        if id(h) not in self._var_start_nf:
            self._var_start_nf[id(h)] = self._scan_var(h, getattr(v, "dtype", None))

    def _scan_var(self, h: Any, dtype: Any) -> tuple[bool, bool]:
        """(nan, inf) of a variable when it becomes known (before the step writes it)."""
        try:
            dt = tf.as_dtype(dtype)
        except Exception:
            return False, False
        if not dt.is_floating:
            return False, False
        prev, self._busy = self._busy, True
        try:
            a = self._read_var(h, dt)
        finally:
            self._busy = prev
        return N.nonfinite_flags(a) if a is not None else (False, False)

    @staticmethod
    def _handle(v: Any) -> Any:
        for get in (lambda: v.handle, lambda: v.value.handle, lambda: v._value.handle):
            try:
                h = get()
                if h is not None and getattr(h, "dtype", None) == tf.resource:
                    return h
            except Exception:
                continue
        return None

    def _index_variables(self) -> None:
        for m in self.models:
            for v in getattr(m, "trainable_variables", []) or []:
                self._add_var(v, None, "param")
            for v in getattr(m, "non_trainable_variables", []) or []:
                self._add_var(v, None, "buffer")
        if self.optimizer is not None:
            self._index_optimizer(self.optimizer)
        given = self.given_variables
        if isinstance(given, dict):
            items = list(given.items())
        else:
            items = [(None, v) for v in (given or [])]
        for name, v in items:
            kind = "param" if getattr(v, "trainable", False) else "buffer"
            h = self._handle(v)
            if h is not None and id(h) in self._vars and self._vars[id(h)].kind == "optimizer_state":
                kind = "optimizer_state"
            self._add_var(v, name, kind)

    def _on_root(self, layer: Any) -> None:
        """An outermost layer called while armed (the model): name its variables if nobody did."""
        if any(m is layer for m in self.models):
            return
        self.models.append(layer)
        for v in getattr(layer, "trainable_variables", []) or []:
            h = self._handle(v)
            if h is not None and id(h) not in self._vars:
                self._add_var(v, None, "param")
        for v in getattr(layer, "non_trainable_variables", []) or []:
            h = self._handle(v)
            if h is not None and id(h) not in self._vars:
                self._add_var(v, None, "buffer")

    def _index_optimizer(self, opt: Any) -> None:
        seen = set()
        o = opt
        while o is not None and id(o) not in seen:
            seen.add(id(o))
            for v in list(getattr(o, "variables", []) or []):
                h = self._handle(v)
                if h is None or id(h) in self._vars:
                    continue
                self._add_var(v, None, "optimizer_state")
            for v in list(getattr(o, "_trainable_variables", []) or []):
                h = self._handle(v)
                if h is not None and id(h) not in self._vars:
                    self._add_var(v, None, "param")
            o = getattr(o, "inner_optimizer", None)

    def _source_name(self, src: Any, i: int) -> str:
        if src is None:
            return f"source[{i}]"
        h = self._handle(src)
        if h is not None and id(h) in self._vars and self._vars[id(h)].name:
            return self._vars[id(h)].name
        return str(getattr(src, "path", None) or getattr(src, "name", None) or f"source[{i}]")

    def _var_of(self, handle: Any) -> Optional[_Var]:
        return self._vars.get(id(handle))

    # ------------------------------------------------------------------ per-op core
    def _fail(self, e: BaseException) -> None:
        self._errors += 1
        if self._errors <= 5:
            self._notes.append(f"recorder error (ignored): {type(e).__name__}: {str(e)[:200]}")

    def _cur_stage(self) -> str:
        if self._grad_ctx:
            return "backward"
        return self._stage

    def _lookup(self, t: Any, first_op: str, idx: int) -> tuple[bool, bool, Optional[_Origin], Optional[_Info]]:
        """Finiteness + taint of an input tensor, checking it when unseen."""
        info = self._infos.get(id(t))
        if info is not None and info.ref() is t:
            return info.nan, info.inf, info.taint, info
        nan = inf = False
        taint = None
        if N.is_float_dtype(t.dtype):
            a = _np(t)
            if a is not None:
                nan, inf = N.nonfinite_flags(a)
                if nan or inf:
                    taint = self._unknown_nonfinite(t, a, nan, inf, first_op, idx)
        try:
            ref = weakref.ref(t)
        except TypeError:
            return nan, inf, taint, None
        info = _Info(ref, nan, inf, taint, None)
        self._infos[id(t)] = info
        return nan, inf, taint, info

    def _unknown_nonfinite(self, t: Any, a: np.ndarray, nan: bool, inf: bool, first_op: str, idx: int) -> _Origin:
        """A non-finite tensor made before the step (or by code outside the recorder)."""
        if a.size <= 1:   # a scalar constant (x * nan, tf.where(m, s, -inf)'s -inf)
            o = _Origin(len(self._origins), "constant", True, op=idx, stage=self._cur_stage())
            fr = self._loc_now()
            o.detail = {"op": first_op, "name": first_op, "api": first_op, "module": fr.module if fr else None,
                        "stage": self._cur_stage(), "file": fr.file if fr else None,
                        "line": fr.line if fr else None, "function": fr.function if fr else None,
                        "constant": True, "scalars": [jnum(a.reshape(-1)[0])] if a.size else []}
            self._origins.append(o)
            return o
        return self._preexisting(t, a, nan, inf, "data", None, idx)

    def _preexisting(self, t: Any, a: np.ndarray, nan: bool, inf: bool, kind: str, name: Optional[str],
                     idx: int) -> _Origin:
        soft = False
        if not nan and kind in ("data", "buffer") and a.dtype.kind in "fV":
            soft = not bool(np.isposinf(N.as_float(a)).any())   # only -inf: most likely an intentional mask
        o = _Origin(len(self._origins), "preexisting", soft, op=idx, stage=self._cur_stage())
        o.pre_kind, o.name = kind, name
        try:
            o.tref = weakref.ref(t)
        except TypeError:
            o.tref = None
        st = N.tensor_stats(a, _dtype_name(getattr(t, "dtype", None)) or str(a.dtype))
        st["bad_rows"] = N.bad_rows(a)
        o.detail = {"stats": st}
        self._origins.append(o)
        return o

    def _loc_now(self) -> Optional[naming.Location]:
        try:
            return naming.resolve(sys._getframe(2), self._comps, self.users)
        except Exception:
            return None

    def _match_forward(self, op_type: str, inputs: Any, outputs: Any) -> Optional[int]:
        """The recorded forward op whose gradient function is about to run."""
        cands = self._fwd_by_type.get(op_type)
        if not cands:
            return None
        for t in outputs or ():
            if t is None:
                continue
            info = self._infos.get(id(t))
            if info is not None and info.ref() is t and info.prod is not None:
                i = info.prod[0]
                if i < len(self.op_type) and self.op_type[i] == op_type:
                    self._claimed.add(i)
                    return i
        given = [(p, id(x)) for p, x in enumerate(inputs or ()) if x is not None]
        free = [i for i in reversed(cands) if i not in self._claimed]
        if given:
            for i in free:
                ids = self.op_in_ids[i]
                if all(p < len(ids) and ids[p] == x for p, x in given):
                    self._claimed.add(i)
                    return i
        if free:
            self._claimed.add(free[0])
            return free[0]
        return None

    def _on_op(self, op_type: Any, inputs: Sequence[Any], attrs: Any, outputs: Sequence[Any]) -> None:
        t_op = O.op_type_str(op_type)
        idx = self._n_ops
        self._n_ops += 1
        record = idx < self.max_records
        if idx == self.max_records:
            self._notes.append(f"more than {self.max_records} ops: later ops are tracked but not recorded")
        stage = self._cur_stage()
        fwd = self._grad_ctx[-1] if self._grad_ctx else None
        if t_op.startswith("__inference") or t_op.startswith("__forward"):
            self._notes.append(f"a tf.function ran as one op ({t_op}); its inner ops were not recorded")
        inputs = tuple(inputs or ())
        outputs = tuple(outputs or ())

        ins = []          # (pos, tensor, nan, inf, taint, prod)
        handles = []      # (pos, handle tensor)
        scal = []         # (pos, value) of float scalar inputs
        for pos, x in enumerate(inputs):
            dt = getattr(x, "dtype", None)
            if dt == tf.resource:
                handles.append((pos, x))
                continue
            if dt == tf.variant or not _is_eager(x):
                continue
            nan, inf, taint, info = self._lookup(x, t_op, idx)
            ins.append((pos, x, nan, inf, taint, info.prod if info is not None else None))
            if N.is_float_dtype(dt) and record:
                try:
                    if _numel(x) == 1:
                        scal.append((pos, float(_np(x).reshape(-1)[0])))
                except Exception:
                    pass

        # outputs
        results = []      # (pos, tensor, nan, inf, arr)
        any_nf = False
        low = False
        for pos, o in enumerate(outputs):
            if not _is_eager(o):
                continue
            dt = o.dtype
            if N.is_float_dtype(dt):
                a = _np(o)
                if a is None:
                    continue
                nan, inf = N.nonfinite_flags(a)
                if _dtype_name(dt) in N.LOW_PRECISION:
                    low = True
                results.append((pos, o, nan, inf, a if (nan or inf) else None))
                any_nf = any_nf or nan or inf
            else:
                results.append((pos, o, False, False, None))

        loc = None
        if record:
            if stage == "forward" or (stage == "optimizer" and any_nf):
                loc = self._loc_now()
            self.op_type.append(t_op)
            self.op_canon.append(O.canonical(t_op))
            self.op_stage.append(stage)
            self.op_fwd.append(fwd)
            self.op_loc.append(loc)
            self.op_inprod.append(tuple(i[5][0] if i[5] is not None else -1 for i in ins[:_IN_PROD]))
            self.op_in_ids.append(tuple(id(x) for x in inputs) if stage == "forward" else ())
            self.op_scalars.append(tuple(scal[:6]))
            self.op_outnf.append(any_nf)
            if stage == "forward":
                self._fwd_by_type.setdefault(t_op, []).append(idx)
                if t_op in O.KEEP_FWD and self._keep_elems < _KEEP_FWD_BUDGET:
                    n = sum(_numel(x) for x in inputs if _is_eager(x))
                    if self._keep_elems + n <= _KEEP_FWD_BUDGET:
                        self._keep[idx] = (t_op, inputs, attrs, len(outputs))
                        self._keep_elems += n
                # consumers of non-finite forward tensors and of domain-sensitive ops' outputs (where traps)
                float_out = any(N.is_float_dtype(r[1].dtype) for r in results)
                for i in ins:
                    p = i[5]
                    if p is not None and p[0] < len(self.op_type) and (
                            i[2] or i[3] or self.op_type[p[0]] in O.KEEP_FWD):
                        self._consumers.setdefault(p[0], []).append((idx, t_op, any_nf, float_out))
            if low:
                n = sum(_numel(x) for x in inputs if _is_eager(x))
                if n <= _RING_BUDGET:
                    self._ring[idx] = (t_op, inputs, attrs, len(outputs), n)
                    self._ring_elems += n
                    while self._ring and (len(self._ring) > _RING or self._ring_elems > _RING_BUDGET):
                        self._ring_elems -= self._ring.popitem(last=False)[1][4]

        # variables: reads and writes
        if handles and (t_op in O.VAR_READS or t_op in O.VAR_WRITES or t_op.startswith(O.VAR_WRITE_PREFIXES)):
            self._on_var_op(t_op, idx, stage, handles, ins, results, attrs)
            return

        new_origin: Optional[_Origin] = None
        for pos, o, nan, inf, a in results:
            taint = None
            if nan or inf:
                if t_op in O.DATA_OPS or not ins:
                    taint = self._preexisting(o, a, nan, inf, "data", None, idx)
                    taint.first_use = None
                else:
                    taint = self._decide(nan, inf, ins, t_op, o)
                    if taint == "new":
                        if new_origin is None:
                            new_origin = _Origin(len(self._origins), "op", False, op=idx, stage=stage)
                            self._origins.append(new_origin)
                        taint = new_origin
                    elif taint.kind == "preexisting" and taint.first_use is None:
                        taint.first_use = self._first_use(t_op, inputs, o, a, stage, loc, taint)
            self._set_info(o, nan, inf, taint, (idx, pos))
        if new_origin is not None:
            self._describe_origin(new_origin, t_op, idx, inputs, attrs, outputs, ins, results, stage, fwd, loc)

    def _decide(self, out_nan: bool, out_inf: bool, ins: list, t_op: str, out: Any) -> Any:
        """Taint of a non-finite output: inherit a real origin, start a new one, or inherit a soft one."""
        real = [i[4] for i in ins if i[4] is not None and i[4].real]
        if real:
            return min(real, key=lambda o: o.seq)
        in_nan = any(i[2] for i in ins)
        in_inf = any(i[3] for i in ins)
        if out_nan and not in_nan:
            return "new"       # NaN out of NaN-free inputs (incl. softmax of an all -inf row)
        if out_inf and not out_nan and not in_inf:
            return "new"       # overflow, x/0, log(0) from finite inputs
        soft = [i[4] for i in ins if i[4] is not None]
        if soft:
            mask = self._mask_escape(t_op, out, ins, soft)
            if mask is not None:
                self._escaped_mask = mask
                return "new"   # masked entries summed into a result: the bug is this reduction
            return min(soft, key=lambda o: o.seq)
        return "new"

    def _mask_escape(self, t_op: str, out: Any, ins: list, soft: list) -> Optional[_Origin]:
        """A sum/mean over positions a mask filled with +-inf, giving a non-finite result."""
        if t_op not in O.MASK_SINKS or self._cur_stage() != "forward":
            return None
        big = max((_numel(i[1]) for i in ins), default=0)
        if _numel(out) >= big:
            return None
        consts = [o for o in soft if o.kind == "constant" or (o.kind == "preexisting" and o.soft)]
        if len(consts) != len(soft):
            return None
        masks = [o for o in consts if o.kind == "constant" and (o.detail or {}).get("name") in O.MASK_WRITERS]
        return min(masks, key=lambda o: o.seq) if masks and len(masks) == len(consts) else None

    def _set_info(self, t: Any, nan: bool, inf: bool, taint: Optional[_Origin], prod: tuple) -> None:
        try:
            ref = weakref.ref(t)
        except TypeError:
            return
        self._infos[id(t)] = _Info(ref, nan, inf, taint, prod)

    def _taint_of(self, t: Any) -> Optional[_Origin]:
        info = self._infos.get(id(t))
        if info is not None and info.ref() is t:
            return info.taint
        a = _np(t)
        if a is None:
            return None
        nan, inf = N.nonfinite_flags(a)
        if nan or inf:
            return self._unknown_nonfinite(t, a, nan, inf, "sink", self._n_ops)
        return None

    # ------------------------------------------------------------------ variables in ops
    def _read_var(self, handle: Any, dtype: Any) -> Optional[np.ndarray]:
        try:
            from tensorflow.python.ops import gen_resource_variable_ops as R
            return R.read_variable_op(handle, dtype).numpy()
        except Exception:
            return None

    def _var_taint_or_pre(self, h: Any, dtype: Any, nan: bool, inf: bool, idx: int, out: Any = None) -> _Origin:
        """Taint of a non-finite value read from the variable behind handle ``h``: what the step wrote
        into it, else the variable itself (non-finite before the step)."""
        if self._var_taint.get(id(h)) is not None:
            return self._var_taint[id(h)]
        o = self._var_pre.get(id(h))
        if o is None:
            var = self._var_of(h)
            kind = var.kind if var is not None else "param"
            name = var.name if var is not None else None
            full = self._read_var(h, dtype)
            if full is None:
                full = _np(out) if out is not None else np.zeros(0, np.float32)
            o = self._preexisting(out, full, nan, inf, kind, name, idx)
            o.hid = id(h)
            self._var_pre[id(h)] = o
            self._var_taint[id(h)] = o
        return o

    def _on_var_op(self, t_op: str, idx: int, stage: str, handles: list, ins: list, results: list,
                   attrs: Any) -> None:
        h = handles[0][1]
        if t_op in ("ReadVariableOp", "ResourceGather", "ResourceGatherNd"):
            for pos, o, nan, inf, a in results:
                taint = None
                if nan or inf:
                    taint = self._var_taint_or_pre(h, o.dtype, nan, inf, idx, o)
                    if taint.kind == "preexisting" and taint.first_use is None and t_op != "ReadVariableOp":
                        taint.first_use = self._first_use(t_op, [h] + [i[1] for i in ins], o, a, stage, None, taint)
                self._set_info(o, nan, inf, taint, (idx, pos))
            return
        for pos, o, nan, inf, a in results:
            self._set_info(o, nan, inf, None, (idx, pos))
        if t_op in O.VAR_WRITES or t_op.startswith(O.VAR_WRITE_PREFIXES):
            targets = [handles[0]] if t_op in O.VAR_WRITES else handles
            for _p, hh in targets:
                dt = None
                var = self._var_of(hh)
                if var is not None and var.dtype is not None:
                    dt = var.dtype
                if dt is None:
                    val = next((i[1] for i in ins if N.is_float_dtype(i[1].dtype)), None)
                    dt = val.dtype if val is not None else None
                if dt is None or not N.is_float_dtype(tf.as_dtype(dt)):
                    continue
                new = self._read_var(hh, tf.as_dtype(dt))
                if new is None:
                    continue
                nan, inf = N.nonfinite_flags(new)
                taint = None
                vt = [i[4] for i in ins if i[4] is not None and i[4].real]
                external = all(t.op == idx for t in vt)   # the value's taint was born here: made outside the step
                if (nan or inf) and stage != "optimizer" and external and \
                        not any(self._var_start_nf.get(id(hh), (False, False))):
                    # the program itself wrote non-finite values into a variable (an assign between updates,
                    # a warm start, a bad re-initialisation): for the step that reads it, a corrupted variable
                    taint = self._written_var(hh, var, new, nan, inf, t_op, idx, ins, stage)
                elif nan or inf:
                    real = [i[4] for i in ins if i[4] is not None and i[4].real]
                    old = self._var_taint.get(id(hh))
                    if real:
                        taint = min(real, key=lambda o: o.seq)
                    elif t_op != "AssignVariableOp" and old is not None:
                        taint = old
                    elif t_op != "AssignVariableOp" and any(self._var_start_nf.get(id(hh), (False, False))):
                        # non-finite before the step, never read as such: the update carried it along
                        taint = self._var_taint_or_pre(hh, tf.as_dtype(dt), nan, inf, idx)
                    soft = [i[4] for i in ins if i[4] is not None]
                    if taint is None and soft:
                        taint = min(soft, key=lambda o: o.seq)
                    if taint is None:
                        taint = _Origin(len(self._origins), "op", False, op=idx, stage=stage)
                        self._origins.append(taint)
                        self._describe_var_write(taint, t_op, idx, ins, new, stage, var)
                self._var_taint[id(hh)] = taint
                if stage == "optimizer":
                    self._opt_written[id(hh)] = hh

    def _written_var(self, h: Any, var: Optional[_Var], new: np.ndarray, nan: bool, inf: bool, t_op: str,
                     idx: int, ins: list, stage: str) -> _Origin:
        """A variable the program wrote non-finite values into outside the optimizer's update: reported
        as that variable (``param_corruption``), with the write as ``written_by``."""
        o = _Origin(len(self._origins), "preexisting", False, op=idx, stage=stage)
        o.pre_kind = var.kind if var is not None else "param"
        o.name = var.name if var is not None else None
        o.hid = id(h)
        st = N.tensor_stats(new, str(new.dtype))
        st["bad_rows"] = N.bad_rows(new)
        loc = self.op_loc[idx] if idx < len(self.op_loc) else None
        vt = [i[4] for i in ins if i[4] is not None]
        wb: dict[str, Any] = {"op": O.canonical(t_op), "tf_op": t_op, "api": t_op, "stage": stage,
                              "kind": vt[0].kind if vt else "op", "value_kind": vt[0].pre_kind if vt else None,
                              "input_numel": [_numel(i[1]) for i in ins[:4]]}
        if loc is not None:
            wb.update(file=loc.file, line=loc.line, function=loc.function, module=loc.module)
        o.detail = {"stats": st, "written_by": wb}
        self._origins.append(o)
        self._var_pre[id(h)] = o
        return o

    def _describe_var_write(self, o: _Origin, t_op: str, idx: int, ins: list, new: np.ndarray, stage: str,
                            var: Optional[_Var]) -> None:
        loc = self.op_loc[idx] if idx < len(self.op_loc) else None
        d = {"op": O.canonical(t_op), "tf_op": t_op, "name": t_op, "api": t_op, "stage": stage,
             "dtype": str(new.dtype), "shape": [int(s) for s in new.shape], "output": N.nonfinite_counts(new),
             "samples": N.bad_rows(new), "variable": var.name if var is not None else None,
             "inputs": [dict(N.tensor_stats(_np(i[1]), _dtype_name(i[1].dtype)), arg=i[0]) for i in ins[:6]],
             "facts": {}}
        if loc is not None:
            d.update(loc.as_dict())
        o.detail = d

    # ------------------------------------------------------------------ origin description
    def _first_use(self, t_op: str, inputs: Sequence[Any], out: Any, a: Optional[np.ndarray], stage: str,
                   loc: Optional[naming.Location], pre: Optional[_Origin] = None) -> dict:
        """Where a pre-existing non-finite tensor first enters the step (sample rows, source rows)."""
        if loc is None:
            loc = self._loc_now()
        if a is None:
            a = _np(out)
        gather = t_op in ("GatherV2", "ResourceGather")
        if not gather and pre is not None and pre.tref is not None and pre.tref() is not None:
            rows = N.bad_rows(_np(pre.tref()))     # the batch itself: its rows are the sample rows
        else:
            rows = N.bad_rows(a) if a is not None else []   # a gather's output rows are the batch rows
        d: dict[str, Any] = {"op": O.canonical(t_op), "tf_op": t_op, "stage": stage,
                             "file": loc.file if loc else None, "line": loc.line if loc else None,
                             "function": loc.function if loc else None, "module": loc.module if loc else None,
                             "layer": loc.layer if loc else None, "samples": rows, "source_rows": []}
        try:
            if gather and d["samples"] and len(inputs) > 1:
                index = _np(inputs[1])
                if index is not None and index.dtype.kind in "iu" and index.ndim >= 1:
                    flat = index if index.ndim == 1 else index.reshape(index.shape[0], -1)[:, 0]
                    d["source_rows"] = sorted({int(flat[r]) for r in d["samples"] if r < flat.shape[0]})[:10]
        except Exception as e:
            d["source_rows_error"] = str(e)[:100]
        return d

    def _describe_origin(self, o: _Origin, t_op: str, idx: int, inputs: tuple, attrs: Any, outputs: tuple,
                         ins: list, results: list, stage: str, fwd: Optional[int],
                         loc: Optional[naming.Location]) -> None:
        bad = [(pos, t, nan, inf, a) for pos, t, nan, inf, a in results if nan or inf]
        pos0, t0, _n, _i, a0 = bad[0]
        d: dict[str, Any] = {"op": O.canonical(t_op), "tf_op": t_op, "name": t_op, "api": t_op, "stage": stage,
                             "dtype": _dtype_name(t0.dtype), "shape": [int(s) for s in a0.shape],
                             "positions": [p for p, *_ in bad][:10] if len(outputs) > 1 else [],
                             "autograd_node": None, "file": None, "line": None, "function": None,
                             "module": None, "layer": None, "module_type": None}
        if loc is not None:
            d.update(loc.as_dict())
        if stage == "backward":
            d["autograd_node"] = (f"{self.op_type[fwd]}Grad" if fwd is not None and fwd < len(self.op_type)
                                  else "tape")
            d["backward_op"] = t_op
            if fwd is not None and fwd < len(self.op_type):
                d["forward_idx"] = fwd
                d["forward_op"] = self.op_canon[fwd]
                d["forward_tf_op"] = self.op_type[fwd]
                d["forward_api"] = self.op_type[fwd]
                fl = self.op_loc[fwd]
                if fl is not None:
                    d["forward_file"], d["forward_line"], d["forward_function"] = fl.file, fl.line, fl.function
                    d["forward_module"], d["forward_layer"] = fl.module, fl.layer
                    d["forward_module_type"], d["forward_line_source"] = fl.module_type, fl.line_source
                    d["forward_layer_stack"] = list(fl.layer_stack)
        d["output"] = N.nonfinite_counts(a0)
        d["samples"] = N.bad_rows(a0)
        mask, self._escaped_mask = self._escaped_mask, None
        if mask is not None:
            md = mask.detail or {}
            d["mask_escape"] = {"mask_op": md.get("name"), "mask_api": md.get("api"), "file": md.get("file"),
                                "line": md.get("line"), "constant": (md.get("scalars") or [None])[0]}
        o.detail = d
        if o.seq >= self.detail_limit:
            return
        d["inputs"] = []
        for i in ins[:6]:
            a = _np(i[1])
            if a is None:
                continue
            st = N.tensor_stats(a, _dtype_name(i[1].dtype))
            st["arg"] = i[0]
            d["inputs"].append(st)
        d["scalars"] = [jnum(v) for _p, v in (self.op_scalars[idx] if idx < len(self.op_scalars) else ())]
        try:
            d["facts"] = E.facts(self, t_op, idx, inputs, attrs, outputs, pos0, t0, a0, stage, fwd)
        except Exception as e:
            d["facts"] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}

    # ------------------------------------------------------------------ sinks
    def _eval_opt_sink(self) -> None:
        res = []
        handles = dict(self._opt_written)
        for hid, var in self._vars.items():
            if var.kind in ("param", "optimizer_state"):
                v = var.ref()
                h = self._handle(v) if v is not None else None
                if h is not None:
                    handles.setdefault(id(h), h)
        for hid, h in handles.items():
            var = self._vars.get(hid)
            dt = var.dtype if var is not None else None
            if dt is None or not N.is_float_dtype(tf.as_dtype(dt)):
                continue
            a = self._read_var(h, tf.as_dtype(dt))
            if a is None:
                continue
            nan, inf = N.nonfinite_flags(a)
            if not (nan or inf):
                continue
            taint = self._var_taint.get(hid)
            if taint is None:
                taint = self._var_taint_or_pre(h, tf.as_dtype(dt), nan, inf, self._n_ops)
            name = var.name if var is not None else None
            if var is not None and var.kind == "optimizer_state":
                res.append((self._state_owner(name), name, taint))
            else:
                res.append((name, None, taint))
        self._opt_sink = res

    def _state_owner(self, name: Optional[str]) -> Optional[str]:
        return name

    # ------------------------------------------------------------------ result
    def result(self) -> dict:
        """The localization (JSON-serialisable). Call after stop()."""
        if self._result is not None:
            return self._result
        prev, self._busy = self._busy, True
        try:
            res = self._build_result()
        except Exception as e:
            res = {"reproduced": False, "phase": None, "origin": None, "preexisting": None, "optimizer": None,
                   "facts": {}, "n_ops": self._n_ops, "backend": "tensorflow",
                   "notes": self._notes + [f"result failed: {e!r}"[:200]]}
        finally:
            self._busy = prev
        if self._stopped:
            self._result = res
        return res

    @staticmethod
    def _earliest(taints: list) -> Optional[_Origin]:
        ts = [t for t in taints if t is not None]
        real = [t for t in ts if t.real]
        pool = real or ts
        return min(pool, key=lambda o: o.seq) if pool else None

    def _fallback(self, stage: str) -> Optional[_Origin]:
        real = [o for o in self._origins if o.real and o.kind in ("op", "preexisting")]
        same = [o for o in real if o.stage == stage]
        return (same or real or [None])[0]

    def _build_result(self) -> dict:
        notes = list(self._notes)
        sink_kind, sink_names, taint = None, [], None
        fb_stage = "forward"
        bad_loss = [(t, info) for t, info in self._loss_sinks if not info.get("finite", True)]
        if bad_loss:
            sink_kind = "loss"
            taint = self._earliest([t for t, _ in bad_loss])
            sink_names = [info.get("value") for _, info in bad_loss][:3]
        elif self._grad_sink:
            sink_kind = "grad"
            taint = self._earliest([t for _, t in self._grad_sink])
            sink_names = [n for n, _ in self._grad_sink][:10]
            fb_stage = "backward"
        elif self._opt_sink:
            sink_kind = "optimizer"
            taint = self._earliest([t for *_, t in self._opt_sink])
            sink_names = [n if k is None or k == n else f"{n}:{k}" for n, k, _ in self._opt_sink][:10]
            fb_stage = "optimizer"
        reproduced = sink_kind is not None
        if reproduced and taint is None:
            taint = self._fallback(fb_stage)
            notes.append("the non-finite sink could not be traced to an op; using the earliest real origin")
        res: dict[str, Any] = {"reproduced": reproduced, "phase": None, "origin": None, "preexisting": None,
                               "optimizer": None, "facts": {}, "n_ops": self._n_ops, "notes": notes,
                               "sink": {"kind": sink_kind, "names": sink_names}, "backend": "tensorflow",
                               "instrumentation": "eager op callbacks",
                               "origins_seen": sum(1 for o in self._origins if o.kind == "op"),
                               "masked_nonfinite_origins": 0}
        if not self._loss_sinks and not self._grad_marked:
            notes.append("no loss or gradient was marked during the replay (no GradientTape.gradient call seen)")
        scale = self._loss_scale()
        if scale is not None:
            res["loss_scale"] = scale
            if sink_kind == "grad" and self._loss_sinks:
                notes.append(f"the loss is finite and only the gradients of the loss scaled by {scale:g} are "
                             "non-finite: a LossScaleOptimizer skips such a step and lowers its scale")
        if not reproduced:
            res["masked_nonfinite_origins"] = sum(1 for o in self._origins if o.kind in ("op", "constant"))
            if res["masked_nonfinite_origins"]:
                notes.append(f"{res['masked_nonfinite_origins']} non-finite intermediate(s) appeared but were "
                             "masked before reaching the loss, gradients or variables")
            return res
        if taint is None:
            res["phase"] = {"loss": "forward", "grad": "backward", "optimizer": "optimizer"}[sink_kind]
            return res
        if taint.kind == "preexisting":
            if taint.hid is not None and taint.hid in self._vars:   # named after the fact (model seen later)
                var = self._vars[taint.hid]
                taint.name = taint.name or var.name
                if taint.pre_kind in ("data", "param", None):
                    taint.pre_kind = var.kind
            st = (taint.detail or {}).get("stats", {})
            fu = taint.first_use or {}
            is_data = taint.pre_kind == "data"
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
            notes.append("a non-finite constant written by the program (e.g. tf.where(mask, x, -inf)) reached the "
                         + sink_kind)
            facts["intentional_constant"] = True
        stage = d.get("stage") or taint.stage
        if "where_trap" not in facts and taint.kind == "op" and sink_kind == "grad" and stage == "forward":
            facts["where_trap"] = E.where_trap(self, taint.op)
        keys = ("op", "tf_op", "api", "module", "layer", "module_type", "layer_stack", "line_source", "component",
                "file", "line", "function", "dtype", "shape", "stage", "autograd_node", "backward_op",
                "forward_op", "forward_tf_op", "forward_api", "forward_file", "forward_line", "forward_function",
                "forward_module", "forward_layer", "inputs", "output", "samples", "scalars", "variable")
        origin = {k: d.get(k) for k in keys}
        origin["stage"] = stage
        origin["kind"] = taint.kind
        if stage == "backward" and d.get("forward_idx") is not None:
            origin["backward_file"], origin["backward_line"] = d.get("file"), d.get("line")
            origin["file"], origin["line"] = d.get("forward_file"), d.get("forward_line")
            origin["function"] = d.get("forward_function")
            origin["module"], origin["layer"] = d.get("forward_module"), d.get("forward_layer")
            origin["module_type"] = d.get("forward_module_type")
            origin["line_source"] = d.get("forward_line_source")
            origin["layer_stack"] = d.get("forward_layer_stack")
        for k, default in (("inputs", []), ("output", {"nan": 0, "posinf": 0, "neginf": 0}), ("samples", []),
                           ("layer_stack", [])):
            if origin.get(k) is None:
                origin[k] = default
        res["origin"] = origin
        res["facts"] = facts
        if stage == "optimizer" or sink_kind == "optimizer":
            res["optimizer"] = self._optimizer_info(taint)
        return res

    def _loss_scale(self) -> Optional[float]:
        """The dynamic loss scale of a LossScaleOptimizer (as it was when the replay ended), else None."""
        opt = self.optimizer
        ds = getattr(opt, "dynamic_scale", None) if opt is not None else None
        if ds is None:
            return None
        try:
            return float(ds.numpy()) if hasattr(ds, "numpy") else float(ds)
        except Exception:
            return None

    def _optimizer_info(self, taint: _Origin) -> Optional[dict]:
        opt = self.optimizer
        info: dict[str, Any] = {"param": None, "state": None, "inputs": []}
        for n, k, _t in self._opt_sink:
            if k is None and info["param"] is None:
                info["param"] = n
            if k is not None and info["state"] is None:
                info["state"] = k
        info["nonfinite_after_step"] = [n if k is None else k for n, k, _ in self._opt_sink][:10]
        d = taint.detail or {}
        if d.get("variable") and info["param"] is None:
            info["param"] = d["variable"]
        if opt is None:
            return info
        inner = getattr(opt, "inner_optimizer", None) or opt
        info["optimizer"] = type(inner).__name__
        for key, attr in (("lr", "learning_rate"), ("eps", "epsilon"), ("weight_decay", "weight_decay"),
                          ("momentum", "momentum"), ("beta_1", "beta_1"), ("beta_2", "beta_2")):
            v = getattr(inner, attr, None)
            if v is None:
                continue
            try:
                v = float(v.numpy()) if hasattr(v, "numpy") else float(v)
            except Exception:
                continue
            info[key] = jnum(v)
        pdt = None
        for var in self._vars.values():
            if var.name == info["param"] and var.dtype is not None:
                pdt = _dtype_name(var.dtype)
        if pdt:
            info["param_dtype"] = pdt
            if isinstance(info.get("eps"), float):
                info["eps_fact"] = N.eps_fact(info["eps"], pdt)
        return info
