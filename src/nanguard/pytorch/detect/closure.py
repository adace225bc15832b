"""Closure optimizers (``optimizer.step(closure)``: LBFGS, and any optimizer given a closure).

The closure computes the loss and the gradients *inside* ``step``, so the per-step check cannot run
before ``step`` is called: it runs inside the closure instead (:func:`checked_closure`), after the
closure returned and before the optimizer reads the loss and gradients. LBFGS calls the closure
several times per step (its line search moves the parameters between evaluations):

* the first evaluation is the step's own (the loss ``step`` returns, the gradients at the step's
  parameters): the ordinary check (:meth:`~nanguard.pytorch.detect.StepMonitor.check`) runs on it,
  and the history records its loss and gradient norm;
* each later evaluation counts within the same step: its loss, batch and gradients are kept apart
  (:func:`later_evaluation`) and checked by :func:`recheck` (one small sync; LBFGS reads every
  evaluation's loss on the host anyway). Only a non-finite value there costs a full check, which
  names the phase.

A failure stops the run inside the closure: at the first evaluation no parameter has moved yet; at a
later one the optimizer has not used the non-finite values (the line search's own finite moves stay).
"""
from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from ...core.events import Detection
from .tensors import is_checkable

_REQUIRED: Dict[type, bool] = {}


def needs_closure(opt: Any) -> bool:
    """``opt.step`` takes a closure it cannot do without (LBFGS): its ``closure`` has no default."""
    t = type(opt)
    if t not in _REQUIRED:
        try:
            p = inspect.signature(t.step).parameters.get("closure")
            _REQUIRED[t] = p is not None and p.default is inspect.Parameter.empty
        except (TypeError, ValueError):
            _REQUIRED[t] = False
    return _REQUIRED[t]


def closure_of(args: tuple, kwargs: dict) -> Optional[Callable[[], Any]]:
    """The closure a step call was given, from an optimizer step pre-hook's ``(args, kwargs)`` (torch
    passes the optimizer itself as ``args[0]``), if any. A callable that takes arguments is not one: a
    custom optimizer's ``step(fvp)`` given a Fisher-vector product (natural gradient, TRPO, K-FAC) calls it
    with a vector, and a closure check in its place broke the script."""
    c = kwargs.get("closure", args[1] if len(args) > 1 else None)
    return c if callable(c) and _takes_no_argument(c) else None


def _takes_no_argument(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: taken as a closure, as before
        return True
    return not any(p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                      p.KEYWORD_ONLY) for p in params)


def with_closure(args: tuple, kwargs: dict, closure: Callable[[], Any]) -> tuple:
    """The pre-hook's ``(args, kwargs)`` with the closure replaced (what the hook returns)."""
    if "closure" in kwargs:
        return args, dict(kwargs, closure=closure)
    return (args[0], closure) + tuple(args[2:]), kwargs


def checked_closure(closure: Callable[[], Any], monitor: Any, first: Callable[[Any], None],
                    later: Callable[[Any], None], again: Optional[Callable[[], None]] = None) -> Callable[[], Any]:
    """``closure``, checked: ``first(loss)`` after its first evaluation, ``later(loss)`` after each later
    one (inside :func:`later_evaluation`); either may raise to stop the step. ``again()`` runs before
    each later evaluation (the step tape starts over: it then holds the evaluation a failure is in)."""
    n = [0]

    def checked() -> Any:
        n[0] += 1
        if n[0] == 1:
            loss = closure()
            first(loss)
            return loss
        if again is not None:
            again()
        with later_evaluation(monitor):
            loss = closure()
            later(loss)
        return loss

    checked.evaluations = n  # type: ignore[attr-defined]
    return checked


@contextlib.contextmanager
def later_evaluation(monitor: Any) -> Iterator[None]:
    """A later evaluation of the step's closure: its loss and batch marks are recorded apart, so the
    step's history keeps the first evaluation's (the loss ``step`` returns)."""
    keys = ("_loss_vals", "_loss_marks", "_loss_n", "_data_marks", "_data_where")
    saved = [getattr(monitor, k) for k in keys]
    for k, v in zip(keys, ([], [], 0, [], [])):
        setattr(monitor, k, v)
    try:
        yield
    finally:
        for k, v in zip(keys, saved):
            setattr(monitor, k, v)


def recheck(monitor: Any, opt: Any, loss: Any, scaler: Any = None) -> Optional[Detection]:
    """A later evaluation's loss and gradients: None when all are finite (one small sync), else the
    full check's detection (which names the phase).

    Finiteness is judged in each tensor's own precision: a float64 run's loss or gradient norm past
    float32's range (1e69 in an LBFGS line search that is diverging) is finite, and the full check
    must not run on it (it would record this evaluation's values as the step's)."""
    flags = []
    if isinstance(loss, torch.Tensor) and is_checkable(loss):
        flags.append(torch.isfinite(loss.detach().sum()).reshape(1))
    grads = [p.grad for g in opt.param_groups for p in g["params"]
             if isinstance(p.grad, torch.Tensor) and is_checkable(p.grad)]
    by_dev: Dict[Any, list] = {}
    for g in grads:
        by_dev.setdefault((g.device, g.dtype), []).append(g)
    for gs in by_dev.values():
        f = torch.isfinite(torch.stack(torch._foreach_norm(gs)).sum()).reshape(1)
        flags.append(f.to(flags[0].device) if flags else f)
    if not flags or bool(torch.cat(flags).all()):
        return None
    start = monitor._lasts.get(id(opt))  # the first evaluation's check: the weights the step started from
    monitor._checked[id(opt)] = False  # the full check, on this evaluation's values
    det = monitor.check(opt, scaler)
    if det is not None and start is not None and start.get("pn"):
        det.detected["step_update"] = step_update(start, monitor._lasts.get(id(opt)), opt, det.step)
    return det


def step_update(start: Dict[str, Any], now: Optional[Dict[str, Any]], opt: Any, step: int) -> Dict[str, Any]:
    """What the step's own inner updates did before the failing evaluation (failure path only): the
    parameter norm the step started from and the one now (non-finite: ``inf``), its first evaluation's
    loss and gradient norm, the learning rates. The diagnosis reads it as the failing step's update
    (``nanguard.core.diagnosis.dynamics.with_step_update``): an LBFGS step at lr 1000 that throws the weights
    x1e18 inside step 0 is its own evidence, with no history before it."""
    pn = (now or {}).get("pn") or []
    after = math.hypot(*pn) if pn and all(map(math.isfinite, pn)) else _norm64(opt)  # float32's norm overflowed?
    gn = start.get("gn") or []
    return {"step": int(step), "param_norm": math.hypot(*start["pn"]), "param_norm_after": after,
            "loss": start.get("loss"), "grad_norm": math.hypot(*gn) if gn else None,
            "lr": [float(g["lr"]) for g in opt.param_groups if isinstance(g.get("lr"), (int, float))]}


def _norm64(opt: Any) -> float:
    """The parameters' total norm computed in float64 (finite weights whose float32 norm overflowed keep a
    measured size; inf when a weight is non-finite). Failure path only."""
    with torch.no_grad():
        sq = [float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) for g in opt.param_groups
              for p in g["params"] if isinstance(p, torch.Tensor) and p.is_floating_point()]
    return math.hypot(*sq) if sq else math.inf
