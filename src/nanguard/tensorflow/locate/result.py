"""The localization dict of one recorded step (the shape of ``nanguard.pytorch.locate.OpRecorder.result()``):
which sink went non-finite first (loss, gradients, variables after the update), the origin its taint
names, and the provenance kind (an op, a program constant, a value non-finite before the step).

The sink choice, the phase and the dict's shape are the core's
(:func:`nanguard.core.locate.result.build_localization`); this module is TensorFlow's side of it:
the origin's keys (Keras layer, line source), variables named after the fact, the loss scale, and the
optimizer's slots and hyper-parameters."""
from __future__ import annotations

from typing import Any, Optional

from ...core.locate.result import (LocalizationPort, Localization, OptimizerInfo, OriginShape, Preexisting, SinkChoice,
                                   Sinks, build_localization)
from . import evidence as E
from . import numerics as N
from .numerics import jnum
from .provenance import Origin
from .variables import Variables

__all__ = ["Sinks", "build_result"]

# the origin's keys, in report order; a backward origin made by a recorded forward op's gradient is
# named by that forward op (its layer and line)
_SHAPE = OriginShape(
    keys=("op", "tf_op", "api", "module", "layer", "module_type", "layer_stack", "line_source", "component",
          "file", "line", "function", "dtype", "shape", "stage", "autograd_node", "backward_op", "forward_op",
          "forward_tf_op", "forward_api", "forward_file", "forward_line", "forward_function", "forward_module",
          "forward_layer", "inputs", "output", "samples", "scalars", "variable"),
    backward_if="forward_idx",
    from_forward=(("file", "forward_file"), ("line", "forward_line"), ("function", "forward_function"),
                  ("module", "forward_module"), ("layer", "forward_layer"), ("module_type", "forward_module_type"),
                  ("line_source", "forward_line_source"), ("layer_stack", "forward_layer_stack")),
    defaults=(("inputs", []), ("output", {"nan": 0, "posinf": 0, "neginf": 0}), ("samples", []), ("layer_stack", [])))


class _Port(LocalizationPort):
    """TensorFlow's side of :func:`~nanguard.core.locate.result.build_localization`."""

    shape = _SHAPE
    backend = "tensorflow"
    instrumentation = "eager op callbacks"
    constant_example = "tf.where(mask, x, -inf)"
    state_word = "variables"

    def __init__(self, rec: Any) -> None:
        self.rec = rec

    @staticmethod
    def opt_name(param: Optional[str], state: Optional[str]) -> Any:
        return param if state is None or state == param else f"{param}:{state}"   # a slot variable's own name

    def annotate(self, loc: Localization, choice: SinkChoice) -> None:
        sinks = self.rec.sinks
        if not sinks.loss and not sinks.grad_marked:
            loc.notes.append("no loss or gradient was marked during the replay (no GradientTape.gradient call seen)")
        scale = loss_scale(self.rec.optimizer)
        if scale is not None:
            loc.loss_scale = scale
            if choice.kind == "grad" and sinks.loss:
                loc.notes.append(f"the loss is finite and only the gradients of the loss scaled by {scale:g} are "
                                 "non-finite: a LossScaleOptimizer skips such a step and lowers its scale")

    def preexisting(self, taint: Origin) -> Preexisting:
        return _preexisting(taint, self.rec.vars)

    def where_trap(self, op: int) -> bool:
        return E.where_trap(self.rec.log, op)

    def optimizer(self, taint: Origin, sinks: Sinks) -> OptimizerInfo:
        return optimizer_info(self.rec.optimizer, sinks, taint, self.rec.vars)


def build_result(rec: Any) -> dict:
    """The result of recorder ``rec`` (its ``sinks``, ``prov``, ``vars``, ``log``, ``notes``, ``n_ops``)."""
    return build_localization(rec.sinks, rec.prov, rec.notes, rec.n_ops, _Port(rec)).as_dict()


def _preexisting(taint: Origin, variables: Variables) -> Preexisting:
    if taint.hid is not None and taint.hid in variables.vars:   # named after the fact (model seen later)
        var = variables.vars[taint.hid]
        taint.name = taint.name or var.name
        if taint.pre_kind in ("data", "param", None):
            taint.pre_kind = var.kind
    fu = taint.first_use or {}
    is_data = taint.pre_kind == "data"
    return Preexisting.of(taint, fu.get("samples", []) if is_data else [],
                          fu.get("source_rows", []) if is_data else [])


def loss_scale(opt: Any) -> Optional[float]:
    """The dynamic loss scale of a LossScaleOptimizer (as it was when the replay ended), else None."""
    ds = getattr(opt, "dynamic_scale", None) if opt is not None else None
    if ds is None:
        return None
    try:
        return float(ds.numpy()) if hasattr(ds, "numpy") else float(ds)
    except Exception:
        return None


def optimizer_info(opt: Any, sinks: Sinks, taint: Origin, variables: Variables) -> OptimizerInfo:
    """The update's parameter and state that went non-finite, and the optimizer's hyper-parameters."""
    info = OptimizerInfo()
    for n, k, _t in sinks.opt:
        if k is None and info.param is None:
            info.param = n
        if k is not None and info.state is None:
            info.state = k
    info.nonfinite_after_step = [n if k is None else k for n, k, _ in sinks.opt][:10]
    d = taint.detail or {}
    if d.get("variable") and info.param is None:
        info.param = d["variable"]
    if opt is None:
        return info
    inner = getattr(opt, "inner_optimizer", None) or opt
    info.optimizer = type(inner).__name__
    for key, attr in (("lr", "learning_rate"), ("eps", "epsilon"), ("weight_decay", "weight_decay"),
                      ("momentum", "momentum"), ("beta_1", "beta_1"), ("beta_2", "beta_2")):
        v = getattr(inner, attr, None)
        if v is None:
            continue
        try:
            v = float(v.numpy()) if hasattr(v, "numpy") else float(v)
        except Exception:
            continue
        info.hyper[key] = jnum(v)
    pdt = variables.dtype_of(info.param)
    if pdt:
        info.param_dtype = pdt
        if isinstance(info.hyper.get("eps"), float):
            info.eps_fact = N.eps_fact(info.hyper["eps"], pdt)
    return info
