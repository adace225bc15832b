"""The TensorFlow op recorder: every eager op of one training step, with provenance.

How: the step runs **eagerly** (``tf.config.run_functions_eagerly(True)`` while armed, so a
``tf.function`` step or Keras' ``train_function`` executes its Python op by op) and TensorFlow's
op callback (the hook ``tf.debugging.enable_check_numerics`` and tfdbg use) hands the recorder every
executed op with its input and output tensors (:mod:`.hooks`). A wrapper around the tape's gradient
function tells which ops belong to the backward of which forward op, and ``Layer.__call__`` /
``Loss.__call__`` are tracked to name layers and lines (:mod:`.naming`).

Per op (:meth:`TFRecorder.on_op`): the inputs' finiteness and taints (:mod:`.provenance`), the op
record (:mod:`.oplog`), variable reads and writes (:mod:`.variables`), the outputs' taints, and for
a new origin its description and evidence (:mod:`.describe`, :mod:`.evidence`). The sinks are the
loss (``GradientTape.gradient``'s target), the gradients it returns and the variables the optimizer
writes; :mod:`.result` reports the origin whose taint reaches the first non-finite sink. Values
masked away (an unselected ``tf.where`` branch, softmax rows with some finite logits after a
``-inf`` mask) never reach a sink and are not origins.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import tensorflow as tf

from ...core.locate.result import failed_result
from ...core.locate.taint import absorbed
from . import hooks
from . import naming
from . import numerics as N
from . import ops as O
from .describe import Describer
from .numerics import jnum
from .oplog import OpLog, is_eager, numel
from .provenance import Origin, Provenance, dtype_name, np_value
from .result import Sinks, build_result
from .variables import Variables

__all__ = ["TFRecorder"]

_STAGES = ("forward", "backward", "optimizer")


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
                 max_records: int = 200_000, detail_limit: int = 64):
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
        self.armed = False
        self.busy = False
        self._started = self._stopped = False
        self._stage = "forward"
        self.thread: Optional[int] = None
        self.grad_ctx: list[Optional[int]] = []
        self.n_ops = 0
        self.notes: list[str] = []
        self._errors = 0
        self._result: Optional[dict] = None
        self._undo: list[Callable[[], None]] = []
        self.comps = naming.ComponentStack()
        self.log = OpLog(self.max_records)
        self.prov = Provenance(self.stage, self._where)
        self.vars = Variables(self.log, self.prov, self.paused)
        self.describer = Describer(self.log, self.prov, self.detail_limit)
        self.sinks = Sinks()
        self._marked: list = []   # gradient tensors marked as sinks (kept alive: compared by identity)
        # the batch's own NaN/+inf (a hard pre-existing data taint) once an op of ops.NAN_DROPPERS read it
        # and gave finite outputs (a max-pool window of NaN gives the lowest float): a later non-finite
        # value made from finite inputs descends from it, so it inherits this taint
        self.batch_taint: Optional[Origin] = None
        self._laundered = False
        self._own_update_seen = False

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
        self.thread = threading.get_ident()
        try:
            self.vars.index_models(self.models, self.optimizer, self.given_variables)
            self.comps.on_root = self._on_root
            self.comps.install()
            self._undo.append(self.comps.uninstall)
            self._undo.append(hooks.install_gradient_wrapper(self))
            self._undo.append(hooks.install_op_callback(self))
            if self.run_eagerly:
                self._undo.append(hooks.run_eagerly())
            if self.hooks:
                self._undo += hooks.install_step_hooks(self)
        except Exception:
            self._teardown()
            raise
        self.armed = True

    def stop(self) -> None:
        """Disarm (idempotent), evaluate the variable sink, remove every hook. The variable sink is
        read whether or not the update ran: a parameter already non-finite that the step's batch did
        not touch (an unread embedding row) shows there only."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        self.armed = False
        try:
            with self.paused():
                self.sinks.opt = self.vars.nonfinite_after_update(self.n_ops)
        except Exception as e:
            self.fail(e)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        while self._undo:
            f = self._undo.pop()
            try:
                f()
            except Exception as e:
                self.notes.append(f"teardown: {type(e).__name__}: {e}"[:200])
        self.log.clear_ring()

    # ------------------------------------------------------------------ caller API
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run your own TF code while armed without it being recorded."""
        prev, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = prev

    def stage(self) -> str:
        """The current stage ("backward" inside a gradient function)."""
        return "backward" if self.grad_ctx else self._stage

    def set_stage(self, stage: str) -> None:
        if stage not in _STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        if stage == "backward" and self._stage != "backward":
            self.log.start_backward()
        if stage == "optimizer":
            if self.optimizer is not None:
                self.vars.index_optimizer(self.optimizer)
        self._stage = stage

    def adopt_optimizer(self, opt: Any) -> None:
        """The optimizer whose update runs (when none was given)."""
        if self.optimizer is None:
            self.optimizer = opt
            self.vars.index_optimizer(opt)

    def mark_loss(self, loss: Any) -> None:
        """A tensor ``GradientTape.gradient`` differentiates (forward sink); may be called several times."""
        with self.paused():
            try:
                for t in tf.nest.flatten(loss):
                    a = _float_value(t)
                    if a is None:
                        continue
                    nan, inf = N.nonfinite_flags(a)
                    if not (nan or inf):
                        self.sinks.note_loss(True)
                        continue
                    self.sinks.note_loss(False, self.prov.taint_of(t, self.n_ops),
                                         jnum(a.reshape(-1)[0]) if a.size else None, [int(s) for s in a.shape])
            except Exception as e:
                self.fail(e)

    def mark_grads(self, grads: Any, sources: Any) -> None:
        """What ``GradientTape.gradient`` returned, with its sources (variables): the gradient sink. Also the
        gradients the optimizer is given (what the script did between the two, a clip, may have made them
        non-finite); a gradient already marked is not marked again."""
        with self.paused():
            try:
                self.sinks.grad_marked = True
                g_flat = tf.nest.flatten(grads, expand_composites=False)
                s_flat = tf.nest.flatten(sources, expand_composites=False)
                for i, g in enumerate(g_flat):
                    if g is None:
                        continue
                    vals = getattr(g, "values", g)   # IndexedSlices
                    if any(vals is m for m in self._marked):
                        continue
                    self._marked.append(vals)
                    a = _float_value(vals)
                    if a is not None and any(N.nonfinite_flags(a)):
                        src = s_flat[i] if i < len(s_flat) else None
                        self.sinks.grad.append((self.vars.source_name(src, i), self.prov.taint_of(vals, self.n_ops)))
            except Exception as e:
                self.fail(e)

    def result(self) -> dict:
        """The localization (JSON-serialisable). Call after stop()."""
        if self._result is not None:
            return self._result
        with self.paused():
            try:
                res = build_result(self)
            except Exception as e:
                res = failed_result(self.n_ops, self.notes, e, backend="tensorflow")
        if self._stopped:
            self._result = res
        return res

    # ------------------------------------------------------------------ internals
    def fail(self, e: BaseException) -> None:
        self._errors += 1
        if self._errors <= 5:
            self.notes.append(f"recorder error (ignored): {type(e).__name__}: {str(e)[:200]}")

    def _where(self) -> Optional[naming.Location]:
        try:
            return naming.resolve(sys._getframe(1), self.comps, self.users)
        except Exception:
            return None

    def _on_root(self, layer: Any) -> None:
        """An outermost layer called while armed (the model): name its variables if nobody did."""
        if any(m is layer for m in self.models):
            return
        self.models.append(layer)
        self.vars.index_layer(layer, only_new=True)

    def on_op(self, op_type: Any, inputs: Sequence[Any], attrs: Any, outputs: Sequence[Any]) -> None:
        """One executed op (the op callback; the recorder is busy while this runs)."""
        t_op = O.op_type_str(op_type)
        idx = self.n_ops
        self.n_ops += 1
        record = idx < self.max_records
        if idx == self.max_records:
            self.notes.append(f"more than {self.max_records} ops: later ops are tracked but not recorded")
        stage = self.stage()
        fwd = self.grad_ctx[-1] if self.grad_ctx else None
        if t_op.startswith("__inference") or t_op.startswith("__forward"):
            self.notes.append(f"a tf.function ran as one op ({t_op}); its inner ops were not recorded")
        inputs = tuple(inputs or ())
        outputs = tuple(outputs or ())
        ins, handles, scal = self._inputs(t_op, idx, inputs, record)
        results, any_nf, low = self._outputs(outputs)
        if self.batch_taint is None and not any_nf and t_op in O.NAN_DROPPERS and stage == "forward":
            self._note_batch_read(t_op, ins, inputs, outputs, stage)
        loc = None
        if record:
            if stage == "forward" or (stage == "optimizer" and any_nf):
                loc = self._where()
            float_out = any(N.is_float_dtype(r[1].dtype) for r in results)
            self.log.add(idx, t_op, stage, fwd, loc, inputs, attrs, len(outputs), ins, scal, any_nf, float_out, low)
        if handles and (t_op in O.VAR_READS or t_op in O.VAR_WRITES or t_op.startswith(O.VAR_WRITE_PREFIXES)):
            self._on_var_op(t_op, idx, stage, handles, ins, results, inputs)
            return
        new_origin: Optional[Origin] = None
        carries = stage != "optimizer" and t_op not in O.WHERE_OPS and t_op not in O.GATHER_OPS and \
            any(i[6] is not None or (i[4] is not None and i[4].real) for i in ins)
        for pos, o, nan, inf, a in results:
            taint = None
            if nan or inf:
                if t_op in O.DATA_OPS or not ins:
                    taint = self.prov.preexisting(o, a, nan, "data", None, idx)
                else:
                    taint = self.prov.decide(nan, inf, ins, t_op, o)
                    if taint == "new" and self.batch_taint is not None:
                        taint = self._from_batch(t_op)
                    if taint == "new":
                        if new_origin is None:
                            new_origin = self.prov.new_origin("op", False, idx, stage)
                        taint = new_origin
                    elif taint.kind == "preexisting" and taint.first_use is None:
                        taint.first_use = self.describer.first_use(t_op, inputs, o, a, stage, loc or self._where(),
                                                                   taint)
            carried = absorbed([i[4] for i in ins if i[2] or i[3]], [i[6] for i in ins]) \
                if carries and not (nan or inf) else None   # a finite value made from an earlier failure's values
            self.prov.set_info(o, nan, inf, taint, (idx, pos), carried)
        if new_origin is not None:
            own = naming.custom_gradient_frame(sys._getframe(1), self.users) if stage == "backward" else None
            self.describer.origin(new_origin, t_op, idx, inputs, attrs, outputs, ins, results, stage, fwd, loc, own)

    def update_seen(self, opt: Any) -> None:
        """A replayed ``train_step`` reached an optimizer's update (not applied). Before the failing
        optimizer's own update (``self.optimizer``), an update of another optimizer (a GAN's
        discriminator, before its generator failed) closes a part of the step that is not the failing
        update: its loss and gradients are no sinks (they ran from the variables as captured, after
        that update had run in the original step)."""
        mine = self.optimizer
        if mine is None or self._own_update_seen:
            return
        if opt is mine or getattr(mine, "inner_optimizer", None) is opt or getattr(opt, "inner_optimizer", None) is mine:
            self._own_update_seen = True
            return
        self.sinks, self._marked = Sinks(), []
        self.notes.append(f"the replayed step's update by {type(opt).__name__} before the failing optimizer's "
                          "ran from the captured variables (after it, in the original step): its loss and "
                          "gradients are not the failing update's")

    def _note_batch_read(self, t_op: str, ins: list, inputs: tuple, outputs: tuple, stage: str) -> None:
        """A forward op that may drop NaN read the batch's own NaN/+inf and gave finite outputs: keep that
        taint (see ``batch_taint``; an intentional handler, ``tf.where``, a slice that leaves the bad
        column out, is not such an op)."""
        for _pos, _x, _nan, _inf, taint, _prod, _carried in ins:
            if getattr(taint, "kind", None) != "preexisting" or taint.soft or taint.pre_kind != "data":
                continue
            self.batch_taint = taint
            if taint.first_use is None and outputs:
                taint.first_use = self.describer.first_use(t_op, inputs, outputs[0], None, stage, self._where(), taint)
            return

    def _from_batch(self, t_op: str) -> Origin:
        """A non-finite value made from finite inputs after the batch's NaN/+inf was read."""
        t = self.batch_taint
        assert t is not None
        if not self._laundered:
            self._laundered = True
            self.notes.append(f"{t_op} made a non-finite value from finite inputs after the batch's non-finite "
                              "values were read (an op in between turned them finite): counted as the batch's")
        return t

    def _inputs(self, t_op: str, idx: int, inputs: tuple, record: bool) -> tuple[list, list, list]:
        """(ins: (pos, tensor, nan, inf, taint, producer, carried origin) of eager inputs, resource handles,
        float scalars)."""
        ins, handles, scal = [], [], []
        for pos, x in enumerate(inputs):
            dt = getattr(x, "dtype", None)
            if dt == tf.resource:
                handles.append((pos, x))
                continue
            if dt == tf.variant or not is_eager(x):
                continue
            nan, inf, taint, info = self.prov.lookup(x, t_op, idx)
            ins.append((pos, x, nan, inf, taint, info.prod if info is not None else None,
                        info.carried if info is not None else None))
            if record and N.is_float_dtype(dt):
                try:
                    if numel(x) == 1:
                        scal.append((pos, float(np_value(x).reshape(-1)[0])))
                except Exception:
                    pass
        return ins, handles, scal

    @staticmethod
    def _outputs(outputs: tuple) -> tuple[list, bool, bool]:
        """(results: (pos, tensor, nan, inf, array if non-finite), any non-finite, any low precision)."""
        results, any_nf, low = [], False, False
        for pos, o in enumerate(outputs):
            if not is_eager(o):
                continue
            if N.is_float_dtype(o.dtype):
                a = np_value(o)
                if a is None:
                    continue
                nan, inf = N.nonfinite_flags(a)
                low = low or dtype_name(o.dtype) in N.LOW_PRECISION
                results.append((pos, o, nan, inf, a if (nan or inf) else None))
                any_nf = any_nf or nan or inf
            else:
                results.append((pos, o, False, False, None))
        return results, any_nf, low

    def _on_var_op(self, t_op: str, idx: int, stage: str, handles: list, ins: list, results: list,
                   inputs: tuple) -> None:
        h = handles[0][1]
        if t_op in ("ReadVariableOp", "ResourceGather", "ResourceGatherNd"):
            def first_use(taint: Origin, out: Any, a: Any) -> dict:
                return self.describer.first_use(t_op, [h] + [i[1] for i in ins], out, a, stage, self._where(),
                                                taint)
            self.vars.on_read(t_op, idx, h, results, first_use)
            return
        for pos, o, nan, inf, a in results:
            self.prov.set_info(o, nan, inf, None, (idx, pos))
        if t_op in O.VAR_WRITES or t_op.startswith(O.VAR_WRITE_PREFIXES):
            self.vars.on_write(t_op, idx, stage, handles, ins,
                               lambda o, var, new: self.describer.var_write(o, t_op, idx, ins, new, stage, var))


def _float_value(t: Any) -> Any:
    """The host copy of an eager float tensor (None for anything else)."""
    if not is_eager(t) or not N.is_float_dtype(t.dtype):
        return None
    return np_value(t)
