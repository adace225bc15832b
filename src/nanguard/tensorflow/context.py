"""What the diagnosis knows about a TensorFlow run (``build_event``'s context): the optimizer (the one that
made the latest step), the learning rates, eps, the loss scaler, the dtype policy; read from a
:class:`~.watch.TFWatcher`."""
from __future__ import annotations

from typing import Any, Dict

from ..core.optimizers import optimizer_switch as switch_of
from ..core.script import main_names


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
        clips = {k: float(v) for k in ("global_clipnorm", "clipnorm") for v in [getattr(inner or opt, k, None)]
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if clips:  # the optimizer clips inside its update: a norm of enormous gradients overflows there
            ctx.setdefault("optimizer_clip", clips)
        eps = getattr(inner or opt, "epsilon", None)
        if isinstance(eps, (int, float)):
            ctx.setdefault("eps", eps)
        # Ftrl / Adagrad: the accumulator a zero gradient leaves at its start (Ftrl divides by sqrt(it) + beta)
        for key in ("initial_accumulator_value", "beta"):
            v = getattr(inner or opt, key, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                ctx.setdefault(key, float(v))
    if getattr(w, "outside_writes", None):  # non-finite values the program wrote between updates, and where
        ctx["outside_writes"] = dict(w.outside_writes)
    switch = optimizer_switch(w)
    if switch:
        ctx["optimizer_switch"] = switch
    index = getattr(getattr(w, "host", None), "opt_index", None) or {}
    if len(index) > 1:  # each optimizer's own facts: the history records name the one of each step
        ctx["optimizers"] = each_optimizer(w, index)
    try:
        import keras
        ctx["dtype_policy"] = keras.config.dtype_policy().name
    except Exception:
        pass
    try:
        const = constant_features(w)
    except Exception:   # a fact for the diagnosis: never the reason it fails
        const = []
    if const:
        ctx["normalization_constant_features"] = const
    return ctx


def constant_features(w: Any) -> list:
    """The ``keras.layers.Normalization`` layers of the watched models whose adapted variance is (about) 0 for
    some features: Keras divides their deviation by ``max(sqrt(variance), epsilon)``, so a value that differs
    from the adapt data's constant by 2 comes out as 2e7. Read at a failure only (one small host read per layer)."""
    import keras
    import numpy as np
    models = list(getattr(w, "models", ()))
    fitting = getattr(w, "fitting", lambda: None)()
    if fitting is not None and fitting not in models:
        models.append(fitting)
    out, seen = [], set()
    for m in models:
        for layer in getattr(m, "_flatten_layers", lambda: [m])():
            if not isinstance(layer, keras.layers.Normalization) or id(layer) in seen or getattr(layer, "invert", False):
                continue
            seen.add(id(layer))
            var = getattr(layer, "variance", None)
            if var is None:
                continue
            std = np.sqrt(np.maximum(np.asarray(var, dtype="float64").reshape(-1), 0.0))
            tiny = np.flatnonzero(std <= 1e-6)
            if tiny.size:
                out.append({"layer": layer.name, "features": tiny[:10].tolist(), "count": int(tiny.size),
                            "epsilon": float(keras.config.epsilon())})
    return out


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


def each_optimizer(w: Any, index: Dict[int, int]) -> list:
    """``context["optimizers"]`` (read at a failure or a warning): per optimizer state the host indexed
    (``index``: id(state) -> the index its history records carry), its facts and a label users recognise:
    the attribute of a watched model or the script's variable that holds it (``d_optimizer (Adam)``),
    else its class and position (``the 2nd optimizer (Adam)``)."""
    from ..core.diagnosis.per_optimizer import label  # loaded at an event, not at start-up
    names = _holders(w)
    out = []
    for st in list(w.states.values()) + list(getattr(w, "_earlier", {}).values()):
        i = index.get(id(st))
        opt = st.opt_ref()
        if i is None or opt is None:
            continue
        inner = getattr(opt, "inner_optimizer", None) or opt
        facts: Dict[str, Any] = {"optimizer": type(opt).__name__, "index": int(i)}
        last = next((h for h in reversed(list(w.history)) if getattr(h, "optimizer", None) == i and h.lr), None)
        if last is not None:
            facts["lr"] = list(last.lr)
        for key, attr in (("eps", "epsilon"), ("momentum", "momentum")):
            v = getattr(inner, attr, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                facts[key] = v
        b1, b2 = getattr(inner, "beta_1", None), getattr(inner, "beta_2", None)
        if isinstance(b1, (int, float)) and isinstance(b2, (int, float)):
            facts["betas"] = [b1, b2]
        facts["label"] = label(int(i), facts["optimizer"], names.get(id(opt)))
        out.append(facts)
    return out


def _holders(w: Any) -> Dict[int, str]:
    """id -> the name that holds it: an attribute of a watched model (a GAN's ``self.d_optimizer``), else a
    module-level variable of the script (``nanguard run`` runs it as ``__main__``)."""
    import sys
    out: Dict[int, str] = {}
    main = sys.modules.get("__main__")
    top = [v for k, v in list(getattr(main, "__dict__", {}).items()) if not k.startswith("_")]
    # the models: the watched ones and the script's (a GAN model's train_step calls its sub-models only)
    for m in list(getattr(w, "models", None) or ()) + [v for v in top if hasattr(v, "trainable_weights")]:
        for k, v in list(getattr(m, "__dict__", {}).items()):
            if not k.startswith("_"):
                out.setdefault(id(v), k)
    for i, k in main_names().items():
        out.setdefault(i, k)
    return out
