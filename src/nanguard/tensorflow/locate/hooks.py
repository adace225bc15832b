"""Arming the recorder: TensorFlow's op callback, the tape's gradient-function wrapper, eager
functions, and (without nanguard's watcher) the recorder's own ``GradientTape.gradient`` and
``Optimizer.apply`` hooks. Each installer returns its undo; the recorder runs them in reverse."""
from __future__ import annotations

import threading
from typing import Any, Callable

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop
from tensorflow.python.framework import op_callbacks

from . import ops as O

__all__ = ["install_op_callback", "install_gradient_wrapper", "run_eagerly", "install_step_hooks"]


def install_op_callback(rec: Any) -> Callable[[], None]:
    """Every eager op executed while ``rec`` is armed goes to ``rec.on_op`` (never re-entrantly, never
    a graph op being built)."""
    def cb(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not None or rec.busy or not rec.armed:
            return None
        rec.busy = True
        try:
            rec.on_op(op_type, inputs, attrs, outputs)
        except Exception as e:  # the recorder must never break training
            rec.fail(e)
        finally:
            rec.busy = False
        return None
    op_callbacks.add_op_callback(cb)
    return lambda: op_callbacks.remove_op_callback(cb)


def install_gradient_wrapper(rec: Any) -> Callable[[], None]:
    """The tape's gradient function, wrapped: the ops a gradient function runs are the backward of
    the forward op it differentiates (``rec.grad_ctx``, matched by ``rec.log.match_forward``)."""
    def grad_fn(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip, scope):
        fwd = None
        if rec.armed and threading.get_ident() == rec.thread:
            try:
                fwd = rec.log.match_forward(O.op_type_str(op_name), inputs, outputs, rec.prov.producer)
            except Exception as e:
                rec.fail(e)
        rec.grad_ctx.append(fwd)
        try:
            return backprop._gradient_function(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
                                               skip, scope)
        finally:
            rec.grad_ctx.pop()
    pywrap_tfe.TFE_Py_RegisterGradientFunction(grad_fn)
    return lambda: pywrap_tfe.TFE_Py_RegisterGradientFunction(backprop._gradient_function)


def run_eagerly() -> Callable[[], None]:
    """``tf.function``s (Keras' train function included) run their Python op by op."""
    prev = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(True)
    return lambda: tf.config.run_functions_eagerly(prev)


def install_step_hooks(rec: Any) -> list[Callable[[], None]]:
    """The recorder's own hooks (used without nanguard's watcher): ``GradientTape.gradient`` marks
    the loss, the backward stage and the gradients; Keras' ``Optimizer.apply`` (and
    ``LossScaleOptimizer.apply``) marks the optimizer stage and runs the update when
    ``rec.apply_update``."""
    undo: list[Callable[[], None]] = []
    orig_grad = tf.GradientTape.gradient

    def gradient(tape, target, sources, *a, **k):
        if not rec.armed or threading.get_ident() != rec.thread:
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
    undo.append(lambda: setattr(tf.GradientTape, "gradient", orig_grad))
    try:
        from keras.src.optimizers.base_optimizer import BaseOptimizer
    except Exception:
        return undo
    depth = [0]

    def wrap(orig: Callable) -> Callable:
        def apply(opt, grads, trainable_variables=None):
            if not rec.armed or threading.get_ident() != rec.thread or depth[0]:
                return orig(opt, grads, trainable_variables)
            rec.adopt_optimizer(opt)
            rec.set_stage("optimizer")
            depth[0] += 1
            try:
                return orig(opt, grads, trainable_variables) if rec.apply_update else None
            finally:
                depth[0] -= 1
                rec.set_stage("forward")
        return apply

    classes = [BaseOptimizer]
    try:  # LossScaleOptimizer overrides apply: its checks count as the update too
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
        classes.append(LossScaleOptimizer)
    except Exception:
        pass
    for cls in classes:
        orig = cls.__dict__["apply"]
        cls.apply = wrap(orig)
        undo.append(lambda cls=cls, orig=orig: setattr(cls, "apply", orig))
    return undo
