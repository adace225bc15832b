"""The host side of the check: read the stash once after the outermost ``tf.function`` call that ran a
guarded update (or the eager vector), decide each step (:class:`.detect.StepDecider`), name what is
non-finite on a failure (slow path), and act: record, hand to recovery, or stop."""
from __future__ import annotations

import math
from typing import Any, Dict

import numpy as np
import tensorflow as tf

from tensorflow.python.ops.gen_resource_variable_ops import read_variable_op as _read_variable_op

from ..core.events import Detection
from . import detect as D
from .state import FN_STATES, OptState, StopRun

__all__ = ["HostReader", "var_name", "finite_var"]


def var_name(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or f"variable{tuple(v.shape)}")


def read_host(var: Any) -> np.ndarray:
    """The value of a ``tf.Variable`` on the host, read with one eager ``ReadVariableOp`` (the stash's read,
    every step: ``var.numpy()`` goes through ``read_value``'s identity, tape notification and handle-data
    bookkeeping, ~35 Python calls; this, 3)."""
    try:
        return _read_variable_op(var.handle, var.dtype)._numpy().copy()  # _numpy() may alias the variable
    except Exception:  # anything unexpected: the public way
        return var.numpy()


def scale_lr_slots(optimizers: Any, factor: float) -> int:
    """A learning rate scaled by ``factor``: scale the optimizer slots that hold steps already multiplied by the
    rate too. Keras's SGD and RMSprop keep their momentum as a velocity (``m = momentum * m - lr * g;
    p += m``), so after a cut the stored velocity would go on moving the weights at the old rate for ~1 /
    (1 - momentum) steps (a rollback with the rate cut x0.001 still diverged); Adam-like moments are in
    gradient units and stay. Returns the number of slots scaled."""
    n = 0
    for o in optimizers:
        inner = getattr(o, "inner_optimizer", None) or o
        try:
            if not float(getattr(inner, "momentum", 0.0) or 0.0):
                continue
        except (TypeError, ValueError):
            continue
        for m in list(getattr(inner, "momentums", None) or getattr(inner, "_momentums", None) or []):
            if hasattr(m, "assign"):
                m.assign(m * factor)
                n += 1
    return n


def finite_var(v: Any) -> bool:
    try:
        a = np.asarray(v.numpy() if hasattr(v, "numpy") else v)
    except Exception:
        return True
    if a.dtype.kind != "f":
        return True
    return bool(np.isfinite(a).all())


def per_batch(w: Any, updates: int) -> None:
    """A ``fit`` call ran ``updates`` updates: the updates per batch (its ``steps_per_execution`` batches)."""
    model = w.fitting()
    spe = int(getattr(model, "steps_per_execution", 1) or 1) if model is not None else 1
    w.fit_now["per_batch"] = max(updates // max(spe, 1), 1)


class HostReader:
    """Reads and decides the steps of one watcher ``w`` (its config, decider, states, observers)."""

    def __init__(self, w: Any) -> None:
        self.w = w
        self._released = False   # the states released after the guard disabled itself
        # per optimizer state: 0, 1, ... in the order its steps were first read (the history records'
        # ``optimizer``: a GAN's discriminator and generator steps interleave, the diagnosis reads each apart)
        self.opt_index: Dict[int, int] = {}

    def after_function(self, fn: Any) -> None:
        """The outermost ``tf.function`` call ``fn`` returned: read the stashes of the updates it ran."""
        w = self.w
        sts = FN_STATES.get(fn)
        if sts and not w.disabled:
            keep = getattr(w.policy, "keep_call", None) if w.recovering else None
            if keep is not None:  # the call as a step an early warning's change can be replayed on (.recover_tried)
                w._guarded(lambda: keep(w, w.steps_watched))
            rows: list = []
            start = w.steps_watched
            for st in list(sts):
                if not w._claim(st):
                    continue  # an earlier watcher's that did not run here, or an unknown one
                w._guarded(lambda st=st: rows.extend((r, st) for r in self.read_stash(st)))
            if w.fit_now is not None and rows:  # updates per batch, for the report's fit position
                w._guarded(lambda: per_batch(w, len(rows)))
            # every optimizer's rows in the order the updates ran (a GAN's: D, G, D, G...)
            for r, st in sorted(rows, key=lambda x: x[0][D.C["update"]]):
                w._guarded(lambda r=r, st=st: self.finish_row(st, D.Row(r)))
            if keep is not None and w.steps_watched > start + 1:  # several updates in one call (a GAN's two)
                w._guarded(lambda: w.policy.joined_steps(start, w.steps_watched))
            w._snap_due = True
            w.observers.update_done(w, w.steps_watched)
        if w.disabled and not self._released:   # a guard error: the traced checks skip and hold nothing more
            self._released = True
            for s in w.known_states():
                try:
                    s.release()
                except Exception:
                    pass
        self.raise_if_stopped()

    def read_stash(self, st: OptState) -> list:
        """The rows of ``st``'s updates not read yet (the one host read of the step(s) this call ran)."""
        data = read_host(st.stash)
        new = data[data[:, 0] >= st.next_step]
        out = []
        for r in new[np.argsort(new[:, 0], kind="stable")].tolist():
            if r[0] > st.next_step:
                st.lost_rows += int(r[0] - st.next_step)
            st.next_step = int(r[0]) + 1
            out.append(r)
        return out

    def finish_row(self, st: OptState, row: D.Row, raw: bool = True) -> None:
        """Record one step in the history and decide it; a stop is raised later (raise_if_stopped).
        ``raw``: the row's step is the raw in-graph count (else already this watcher's step)."""
        w = self.w
        if raw:  # the row of a traced update: its step is the count of every optimizer's updates before it
            r = int(row.step)
            st.next_step = max(st.next_step, r + 1)
            st.attempts = max(st.attempts, r + 1)
            row.vals[D.C["step"]] = float(int(row.vals[D.C["update"]]) - w.update_base)
            w.updates = max(w.updates, int(row.step) + 1)
            st.first = int(row.step) if st.first is None else st.first
            st.last = int(row.step)
        else:
            st.next_step = max(st.next_step, st.attempts)
        step = int(row.step)
        if row.flag("halted"):  # after a stop inside the same graph call: nothing was applied
            if w.recovering and w.stop_requested is None:  # held behind a recovered failure: re-run now
                w._guarded(lambda: w.policy.resume_held(w, st, step))
            return
        if not row.flag("post_ok") and math.isinf(row.param_norm):
            # the post-update norm overflowed: confirm element-wise (slow path, a failure only)
            row.vals[D.C["post_ok"]] = float(all(finite_var(v) for v in st.tvars) and
                                             all(finite_var(v) for v in st.opt_variables()))
        rec = w.decider.record(row, id(st))
        rec.optimizer = self.opt_index.setdefault(id(st), len(self.opt_index))
        det = w.decider.decide(row)
        if det is not None:
            self.detail(det, st, row)
            self.handle(det, st)
        elif raw and w.spikes is not None:  # a traced step, read after its update ran (eager: .eager_check)
            w._guarded(lambda: w.spikes.observe(w, st, row, late=True, rec=rec))
        w.observers.step_end(w, step)

    def detail(self, det: Detection, st: OptState, row: D.Row) -> None:
        """Slow path (a failure only): which variables / gradients are non-finite, by ``.path``."""
        d = det.detected
        pos = self.w.fit_position(det.step)
        if pos is not None:
            d["fit"] = pos   # the model.fit call (0-based), its epoch and the step in that epoch
        if det.phase in ("params", "optimizer"):
            bad = [var_name(v) for v in st.tvars if not finite_var(v)]
            d["nonfinite_params" if det.phase == "params" else "nonfinite_params_after_update"] = bad[:20]
            d["n_bad_params"] = len(bad)
            if det.phase == "optimizer":
                bad_state = [var_name(v) for v in st.opt_variables() if not finite_var(v)]
                if bad_state:
                    d["nonfinite_optimizer_state"] = bad_state[:20]
        elif det.phase == "backward":
            flags = st.gbad.numpy().tolist()
            if len(flags) == len(st.tvars):
                bad = [var_name(v) for v, f in zip(st.tvars, flags) if f >= 0.5]
                d["nonfinite_grads"] = bad[:20]
                d["n_bad_grads"] = len(bad)
        elif det.phase == "data":
            d["nonfinite_in"] = [f"{type(m).__name__} input" for m in list(self.w.models)[:3]]
        if row.flag("lso"):
            d.setdefault("loss_scale", row.loss_scale)

    def handle(self, det: Detection, st: OptState) -> None:
        w = self.w
        if det.info_only:
            w.info.append(det)
            return
        if len(w.detections) >= w.config.max_events:
            w.dropped_events += 1
            return
        if det.phase == "eval":   # an evaluation output: reported, never recovered from nor stopped at
            w.detections.append(det)
            w.observers.detection(w, det, st)
            return
        if w.recovering:
            if w._guarded(lambda: w.policy.handle(w, det, st)):
                return  # recovered: the event is the policy's (the failing update was dropped in-graph)
            w.detections.append(det)
            self.request_stop(det)
            return
        w.detections.append(det)
        w.observers.detection(w, det, st)
        if w.config.on_nonfinite == "stop":
            self.request_stop(det)

    def request_stop(self, det: Detection) -> None:
        w = self.w
        if w.stop_requested is None:
            w.stop_requested = det
            if w.on_stop is not None:  # the Keras callback: fit's loop ends after this step (no per-batch hook)
                w._guarded(w.on_stop)
        for s in w.known_states():  # nothing more is applied, in this graph call or later ones
            try:
                s.halt.assign(True)
            except Exception:
                pass
        if tf.executing_eagerly():
            self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        w = self.w
        if w.stop_requested is not None and w.raise_on_stop:
            raise StopRun(w.stop_requested)

    def finish(self) -> None:
        """Read what is still unread: the last eager update's norms, stashes of uncalled graphs."""
        w = self.w
        rows: list = []
        for st in list(w.states.values()):
            if w.disabled:
                break
            if st.eager_post is not None:
                prev, st.eager_post = st.eager_post, None

                def fin(prev=prev, st=st):
                    from .eager_check import post_row
                    self.finish_row(st, D.Row(post_row(prev, prev[1].numpy().tolist())), raw=False)
                w._guarded(fin)
            elif w.stop_requested is None:
                w._guarded(lambda st=st: rows.extend((r, st) for r in self.read_stash(st)))
        for r, st in sorted(rows, key=lambda x: x[0][D.C["update"]]):
            if w.disabled:
                break
            w._guarded(lambda r=r, st=st: self.finish_row(st, D.Row(r)))
