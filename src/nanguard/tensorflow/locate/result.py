"""The localization dict of one recorded step (the shape of ``nanguard.pytorch.locate.OpRecorder.result()``):
which sink went non-finite first (loss, gradients, variables after the update), the origin its taint
names, and the provenance kind (an op, a program constant, a value non-finite before the step)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from . import evidence as E
from . import numerics as N
from .numerics import jnum
from .provenance import Origin, Provenance
from .variables import Variables

__all__ = ["Sinks", "build_result"]

_PHASE = {"loss": "forward", "grad": "backward", "optimizer": "optimizer"}
_PRE_PHASE = {"data": "data", "param": "params", "buffer": "params", "optimizer_state": "optimizer"}
_ORIGIN_KEYS = ("op", "tf_op", "api", "module", "layer", "module_type", "layer_stack", "line_source", "component",
                "file", "line", "function", "dtype", "shape", "stage", "autograd_node", "backward_op", "forward_op",
                "forward_tf_op", "forward_api", "forward_file", "forward_line", "forward_function",
                "forward_module", "forward_layer", "inputs", "output", "samples", "scalars", "variable")


@dataclass
class Sinks:
    """What the step produced: losses ((taint, info) each), non-finite gradients ((source name, taint)),
    non-finite variables after the update ((parameter name, state name, taint))."""
    loss: list = field(default_factory=list)
    grad: list = field(default_factory=list)
    grad_marked: bool = False
    opt: list = field(default_factory=list)


def build_result(rec: Any) -> dict:
    """The result of recorder ``rec`` (its ``sinks``, ``prov``, ``vars``, ``log``, ``notes``, ``n_ops``)."""
    sinks: Sinks = rec.sinks
    prov: Provenance = rec.prov
    notes = list(rec.notes)
    sink_kind, sink_names, taint = None, [], None
    fb_stage = "forward"
    bad_loss = [(t, info) for t, info in sinks.loss if not info.get("finite", True)]
    if bad_loss:
        sink_kind = "loss"
        taint = prov.earliest([t for t, _ in bad_loss])
        sink_names = [info.get("value") for _, info in bad_loss][:3]
    elif sinks.grad:
        sink_kind, fb_stage = "grad", "backward"
        taint = prov.earliest([t for _, t in sinks.grad])
        sink_names = [n for n, _ in sinks.grad][:10]
    elif sinks.opt:
        sink_kind, fb_stage = "optimizer", "optimizer"
        taint = prov.earliest([t for *_, t in sinks.opt])
        sink_names = [n if k is None or k == n else f"{n}:{k}" for n, k, _ in sinks.opt][:10]
    reproduced = sink_kind is not None
    if reproduced and taint is None:
        taint = prov.fallback(fb_stage)
        notes.append("the non-finite sink could not be traced to an op; using the earliest real origin")
    res: dict[str, Any] = {"reproduced": reproduced, "phase": None, "origin": None, "preexisting": None,
                           "optimizer": None, "facts": {}, "n_ops": rec.n_ops, "notes": notes,
                           "sink": {"kind": sink_kind, "names": sink_names}, "backend": "tensorflow",
                           "instrumentation": "eager op callbacks",
                           "origins_seen": sum(1 for o in prov.origins if o.kind == "op"),
                           "masked_nonfinite_origins": 0}
    if not sinks.loss and not sinks.grad_marked:
        notes.append("no loss or gradient was marked during the replay (no GradientTape.gradient call seen)")
    scale = loss_scale(rec.optimizer)
    if scale is not None:
        res["loss_scale"] = scale
        if sink_kind == "grad" and sinks.loss:
            notes.append(f"the loss is finite and only the gradients of the loss scaled by {scale:g} are "
                         "non-finite: a LossScaleOptimizer skips such a step and lowers its scale")
    if not reproduced:
        res["masked_nonfinite_origins"] = sum(1 for o in prov.origins if o.kind in ("op", "constant"))
        if res["masked_nonfinite_origins"]:
            notes.append(f"{res['masked_nonfinite_origins']} non-finite intermediate(s) appeared but were "
                         "masked before reaching the loss, gradients or variables")
        return res
    if taint is None:
        res["phase"] = _PHASE[sink_kind]
        return res
    if taint.kind == "preexisting":
        return _preexisting(res, taint, rec.vars)
    res["phase"] = _PHASE[sink_kind]
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
        facts["where_trap"] = E.where_trap(rec.log, taint.op)
    res["origin"] = _origin(d, taint, stage)
    res["facts"] = facts
    if stage == "optimizer" or sink_kind == "optimizer":
        res["optimizer"] = optimizer_info(rec.optimizer, sinks, taint, rec.vars)
    return res


def _origin(d: dict, taint: Origin, stage: str) -> dict:
    origin = {k: d.get(k) for k in _ORIGIN_KEYS}
    origin["stage"] = stage
    origin["kind"] = taint.kind
    if stage == "backward" and d.get("forward_idx") is not None:   # named by the forward op it differentiates
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
    return origin


def _preexisting(res: dict, taint: Origin, variables: Variables) -> dict:
    if taint.hid is not None and taint.hid in variables.vars:   # named after the fact (model seen later)
        var = variables.vars[taint.hid]
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
    res["phase"] = _PRE_PHASE.get(taint.pre_kind, "data")
    res["facts"] = {"preexisting": {"kind": taint.pre_kind, "name": taint.name, "nonfinite": st.get("nonfinite"),
                                    "numel": st.get("numel")}}
    return res


def loss_scale(opt: Any) -> Optional[float]:
    """The dynamic loss scale of a LossScaleOptimizer (as it was when the replay ended), else None."""
    ds = getattr(opt, "dynamic_scale", None) if opt is not None else None
    if ds is None:
        return None
    try:
        return float(ds.numpy()) if hasattr(ds, "numpy") else float(ds)
    except Exception:
        return None


def optimizer_info(opt: Any, sinks: Sinks, taint: Origin, variables: Variables) -> dict:
    """The update's parameter and state that went non-finite, and the optimizer's hyper-parameters."""
    info: dict[str, Any] = {"param": None, "state": None, "inputs": []}
    for n, k, _t in sinks.opt:
        if k is None and info["param"] is None:
            info["param"] = n
        if k is not None and info["state"] is None:
            info["state"] = k
    info["nonfinite_after_step"] = [n if k is None else k for n, k, _ in sinks.opt][:10]
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
    pdt = variables.dtype_of(info["param"])
    if pdt:
        info["param_dtype"] = pdt
        if isinstance(info.get("eps"), float):
            info["eps_fact"] = N.eps_fact(info["eps"], pdt)
    return info
