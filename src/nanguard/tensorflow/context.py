"""What the diagnosis knows about a TensorFlow run (``build_event``'s context): the optimizer (the one that
made the latest step), the learning rates, eps, the loss scaler, the dtype policy; read from a
:class:`~.watch.TFWatcher`."""
from __future__ import annotations

from typing import Any, Dict

from ..core.optimizers import optimizer_switch as switch_of


def run_context(w: Any) -> Dict[str, Any]:
    """The diagnosis context of the run watched by ``w``."""
    ctx: Dict[str, Any] = {"scaler": w.lso, "counting": "optimizer", "framework": "tensorflow"}
    for opt in latest_first(w):
        ctx.setdefault("optimizer", type(opt).__name__)
        inner = getattr(opt, "inner_optimizer", None)
        if inner is not None:
            ctx["inner_optimizer"] = type(inner).__name__
        last = w.history.last()
        if last is not None and last.lr:
            ctx.setdefault("lr", list(last.lr))
        eps = getattr(inner or opt, "epsilon", None)
        if isinstance(eps, (int, float)):
            ctx.setdefault("eps", eps)
    switch = optimizer_switch(w)
    if switch:
        ctx["optimizer_switch"] = switch
    try:
        import keras
        ctx["dtype_policy"] = keras.config.dtype_policy().name
    except Exception:
        pass
    return ctx


def latest_first(w: Any) -> list:
    """The run's optimizers, the one that made the latest step first (a fine-tuning stage's new optimizer,
    not the first stage's, names the failing update; optimizers stepping together keep their order)."""
    sts = [st for st in w.states.values() if st.opt_ref() is not None]
    order = sorted(range(len(sts)), key=lambda i: (-_last(sts[i]), i))
    return [sts[i].opt_ref() for i in order]


def _last(st: Any) -> int:
    """The run's step of the state's latest update read (-1: none yet)."""
    return -1 if st.last is None else st.last


def optimizer_switch(w: Any) -> Dict[str, Any]:
    """The switch (:func:`nanguard.core.optimizers.optimizer_switch`: a second ``compile`` + ``fit`` with a
    new optimizer, a fine-tuning stage) from each state's first and last step read (a replaced optimizer's
    state stays, though the optimizer may be freed)."""
    return switch_of([(st.first, st.last, st.name) for st in w.states.values()])
