"""Fix wording in the user's framework: phrase builders that rules call instead of writing torch code.

A fix names code the user can type. The same cause needs ``x.clamp(min=1e-12)`` in PyTorch and
``tf.maximum(x, 1e-12)`` in TensorFlow, ``clip_grad_norm_`` in one and ``global_clipnorm`` in the
other. Rules build their sentences from the builders below; each builder answers in the framework
of the diagnosis being made, which :func:`nanguard.core.diagnosis.diagnose` sets from its context
(``context["framework"]``: ``"tensorflow"`` for TensorFlow/Keras runs, ``"jax"`` for JAX/Flax/optax
runs, PyTorch otherwise) with
:func:`speaking`, so rule helpers need no extra argument::

    from .. import fixes as X
    X.call("log", X.clamp_min("x", "1e-12"))     # torch.log(x.clamp(min=1e-12)) | tf.math.log(tf.maximum(x, 1e-12))
    X.say(pytorch="... F.cross_entropy ...", tensorflow="... from_logits=True ...",
          jax="... optax.softmax_cross_entropy_with_integer_labels ...")   # a whole sentence

A JAX diagnosis speaks jnp/optax/Flax (``jnp.maximum(x, 1e-12)``, ``optax.clip_by_global_norm``); a
``say`` without ``jax=`` text answers with the PyTorch one there (tests/jax/test_locate_diagnosis.py
checks the rules the JAX replay reaches).

Keep the PyTorch text of an existing fix byte-identical when converting it (reports are compared
before/after). Builders for the history rules (``rules/divergence.py``): :func:`clip_grad_norm`,
:func:`set_lr`, :func:`lr_warmup`, :func:`loss_scaler`, :func:`mixed_precision`.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Optional

__all__ = ["PYTORCH", "TENSORFLOW", "JAX", "framework_of", "is_jax", "speaking", "framework", "is_tf", "say", "fn", "call",
           "clamp_min", "clamp", "safe_where", "where_fn", "finite_filter", "finite_check", "nan_to_zero",
           "mask_fill_min", "detect_anomaly", "assert_finite_params", "float32_layer", "mixed_precision",
           "clip_grad_norm", "set_lr", "lr_warmup", "loss_scaler", "eps_kwarg", "logits_loss", "log_softmax",
           "reinit", "norm_hint", "unit", "drop_last", "layer_name", "layer_word", "float32_model", "scale_step"]

PYTORCH = "pytorch"
TENSORFLOW = "tensorflow"
JAX = "jax"
_FW: ContextVar[str] = ContextVar("nanguard_fix_framework", default=PYTORCH)

# torch function -> TensorFlow function, where the names differ (else tf.math.<name>)
_TF_FN = {"where": "tf.where", "sqrt": "tf.sqrt", "exp": "tf.exp", "div": "tf.math.divide", "true_divide":
          "tf.math.divide", "reciprocal": "tf.math.reciprocal", "pow": "tf.pow", "log_softmax": "tf.nn.log_softmax",
          "_log_softmax": "tf.nn.log_softmax", "softmax": "tf.nn.softmax", "_softmax": "tf.nn.softmax",
          "linalg_vector_norm": "tf.norm", "norm": "tf.norm", "mean": "tf.reduce_mean", "sum": "tf.reduce_sum",
          "special_xlog1py": "tf.math.xlog1py", "arccos": "tf.math.acos", "arcsin": "tf.math.asin",
          "arctanh": "tf.math.atanh", "arccosh": "tf.math.acosh"}
# torch/aten function -> JAX function, where it is not jnp.<name>
_JAX_FN = {"log_softmax": "jax.nn.log_softmax", "_log_softmax": "jax.nn.log_softmax", "softmax": "jax.nn.softmax",
           "_softmax": "jax.nn.softmax", "sigmoid": "jax.nn.sigmoid", "linalg_vector_norm": "jnp.linalg.norm",
           "norm": "jnp.linalg.norm", "div": "jnp.divide", "true_divide": "jnp.divide", "reciprocal": "jnp.reciprocal",
           "pow": "jnp.power", "special_xlog1py": "jax.scipy.special.xlog1py", "xlogy": "jax.scipy.special.xlogy",
           "acos": "jnp.arccos", "asin": "jnp.arcsin", "atanh": "jnp.arctanh", "acosh": "jnp.arccosh",
           "rsqrt": "jax.lax.rsqrt", "erfinv": "jax.scipy.special.erfinv", "amax": "jnp.max", "amin": "jnp.min"}


def framework_of(context: Optional[dict] = None, loc: Optional[dict] = None) -> str:
    """``"tensorflow"`` / ``"jax"`` when the context or the localization says so, else ``"pytorch"``."""
    for src, key in ((context, "framework"), (loc, "backend")):
        name = str(src.get(key) or "").lower() if src else ""
        if name in (TENSORFLOW, "keras", "tf"):
            return TENSORFLOW
        if name in (JAX, "flax", "equinox", "optax"):
            return JAX
    return PYTORCH


@contextlib.contextmanager
def speaking(fw: str) -> Iterator[None]:
    """Builders answer in ``fw`` inside the block."""
    token = _FW.set(fw if fw in (PYTORCH, TENSORFLOW, JAX) else PYTORCH)
    try:
        yield
    finally:
        _FW.reset(token)


def framework() -> str:
    return _FW.get()


def is_tf() -> bool:
    return _FW.get() == TENSORFLOW


def is_jax() -> bool:
    return _FW.get() == JAX


def say(*, pytorch: str, tensorflow: str, jax: Optional[str] = None) -> str:
    """One sentence per framework (when they differ in more than a code idiom)."""
    if is_jax() and jax is not None:
        return jax
    return tensorflow if is_tf() else pytorch


# ---------------------------------------------------------------------------- code idioms
def fn(op: str) -> str:
    """The user-facing function of an op: 'log' -> 'torch.log' | 'tf.math.log'. ``op`` may be a
    torch API ('torch.log'), an aten name or a TF op type ('Log')."""
    name = op.split(".")[-1]
    if is_jax():
        low = name if name.islower() or name.startswith("_") else _snake(name)
        return _JAX_FN.get(low, f"jnp.{low.lstrip('_')}")
    if not is_tf():
        return f"torch.{name}"
    low = name if name.islower() or name.startswith("_") else _snake(name)
    return _TF_FN.get(low, f"tf.math.{low}")


def call(op: str, *args: str) -> str:
    """``fn(op)(args)``: 'torch.log(x)' | 'tf.math.log(x)'."""
    return f"{fn(op)}({', '.join(args)})"


def clamp_min(x: str, lo: str) -> str:
    """'x.clamp(min=lo)' | 'tf.maximum(x, lo)' | 'jnp.maximum(x, lo)'."""
    if is_jax():
        return f"jnp.maximum({x}, {lo})"
    return f"tf.maximum({x}, {lo})" if is_tf() else f"{x}.clamp(min={lo})"


def clamp(x: str, lo: str, hi: str) -> str:
    """'x.clamp(lo, hi)' | 'tf.clip_by_value(x, lo, hi)' | 'jnp.clip(x, lo, hi)'."""
    if is_jax():
        return f"jnp.clip({x}, {lo}, {hi})"
    return f"tf.clip_by_value({x}, {lo}, {hi})" if is_tf() else f"{x}.clamp({lo}, {hi})"


def where_fn() -> str:
    if is_jax():
        return "jnp.where"
    return "tf.where" if is_tf() else "torch.where"


def safe_where(op: str, fill: str = "1.0", out: str = "0.0") -> str:
    """The double-where pattern: the unselected branch never sees the bad input."""
    w = where_fn()
    return f"{w}(m, {call(op, f'{w}(m, x, {fill})')}, {out})"


def finite_filter() -> str:
    """Keep the rows of x whose features are all finite."""
    if is_jax():
        return "keep = np.isfinite(x).all(axis=1); x, y = x[keep], y[keep] before batching (on the host, outside jit)"
    if is_tf():
        return ("keep = np.isfinite(x).all(axis=1); x, y = x[keep], y[keep] before building the dataset, or "
                "ds = ds.filter(lambda x, y: tf.reduce_all(tf.math.is_finite(x))) in a tf.data pipeline")
    return "x = x[torch.isfinite(x).all(dim=1)] before building batches"


def finite_check(x: str = "batch") -> str:
    """An assertion that stops at the first bad value."""
    if is_jax():
        return f"assert np.isfinite({x}).all() on the host before the jitted step"
    return f"tf.debugging.assert_all_finite({x}, 'non-finite {x}')" if is_tf() else \
        f"assert torch.isfinite({x}).all()"


def nan_to_zero(x: str) -> str:
    if is_jax():
        return f"jnp.nan_to_num({x}, nan=0.0)"
    return f"tf.where(tf.math.is_nan({x}), tf.zeros_like({x}), {x})" if is_tf() else \
        f"torch.nan_to_num({x}, nan=0.0)"


def mask_fill_min(x: str = "scores") -> str:
    """A large finite negative for masked scores."""
    if is_jax():
        return f"jnp.finfo({x}.dtype).min"
    return f"{x}.dtype.min, or -1e9 as Keras' own masks do" if is_tf() else f"torch.finfo({x}.dtype).min"


def detect_anomaly(check_nan: bool = False) -> str:
    """The framework's own op-by-op NaN checker."""
    if is_jax():
        return 'jax.config.update("jax_debug_nans", True)'
    if is_tf():
        return "tf.debugging.enable_check_numerics()"
    return "torch.autograd.detect_anomaly(check_nan=True)" if check_nan else "torch.autograd.detect_anomaly()"


def assert_finite_params() -> str:
    if is_jax():
        return "all(jnp.isfinite(p).all() for p in jax.tree_util.tree_leaves(params))"
    if is_tf():
        return "all(np.isfinite(w).all() for w in model.get_weights())"
    return "torch.isfinite(p).all() for every parameter"


def reinit(name: str) -> str:
    """How to re-initialise one parameter/variable."""
    if is_jax():
        return f"re-initialise '{name}' (e.g. from model.init / a new nnx.Rngs key for that module)"
    if is_tf():
        return f"re-initialise '{name}' with an initializer, e.g. v.assign(keras.initializers.GlorotUniform()(v.shape))"
    return f"re-initialise '{name}'"


def layer_word() -> str:
    """What a model part is called: 'layer' (Keras) | 'module' (PyTorch)."""
    return "layer" if is_tf() else "module"


def layer_name(origin: dict) -> str:
    """"layer 'dense_1' (Dense)" | "module '2' (Linear)"."""
    mod = origin.get("module")
    return f"{layer_word()} '{mod}'" + (f" ({origin['module_type']})" if origin.get("module_type") else "")


def float32_layer(origin: dict, where: str) -> str:
    """Run the origin's layer/module (or op) in float32."""
    mod = origin.get("module")
    if is_jax():
        what = f"module '{mod}'" if mod else f"the op at {where}"
        return (f"run {what} in float32: construct it with dtype=jnp.float32 and param_dtype=jnp.float32 (Flax) "
                "and feed it x.astype(jnp.float32)")
    if is_tf():
        name = origin.get("layer") or mod
        if name:
            t = origin.get("module_type")
            return (f"run layer '{name}'" + (f" ({t})" if t else "") + " in float32: construct it with "
                    "dtype=\"float32\" (a float32 dtype policy for that layer under mixed_float16; Keras casts "
                    "its inputs), and keep the layers after it in float32 too")
        return f"compute the op at {where} in float32 (tf.cast its inputs to tf.float32)"
    if mod:
        return (f"run {layer_name(origin)} in float32: e.g. model.get_submodule('{mod}').float() and feed it "
                "x.float(), or wrap it in torch.autocast(device_type, enabled=False)")
    return f"compute the op at {where} in float32 (cast its inputs with .float())"


def float32_model() -> str:
    """Run the whole model in float32 (the scope a replay showed finite when a module alone was not)."""
    if is_jax():
        return ("run the whole model in float32: construct its modules with dtype=jnp.float32 and "
                "param_dtype=jnp.float32 (Flax) and feed it x.astype(jnp.float32)")
    if is_tf():
        return ("run the whole model in float32: keras.mixed_precision.set_global_policy(\"float32\") before "
                "building it (or construct every layer with dtype=\"float32\")")
    return ("run the whole model in float32: model.float() and feed it x.float() (or leave torch.autocast off "
            "around it)")


def scale_step(before: str, factor: str, after: str) -> str:
    """A hand-written update (no optimizer object): scale its step (``p -= lr * p.grad``) by ``factor``."""
    if is_jax():
        return (f"scale the step by {factor} in the hand-written update (params - lr * grads: lr {before} -> "
                f"about {after})")
    if is_tf():
        return (f"scale the step by {factor} in the hand-written update (v.assign_sub(lr * g): lr {before} -> "
                f"about {after})")
    return f"scale the step by {factor} in the hand-written update (p -= lr * p.grad: lr {before} -> about {after})"


def mixed_precision(what: str = "instead of casting the whole model") -> str:
    """Low precision done right: float32 weights, low-precision compute, loss scaling where needed."""
    if is_jax():
        return ("float32 parameters with low-precision compute (Flax dtype=jnp.bfloat16, param_dtype=jnp.float32; "
                "bfloat16 has float32's range, float16 needs a dynamic loss scale) " + what)
    if is_tf():
        return ("the \"mixed_float16\" dtype policy (keras.mixed_precision.set_global_policy: float32 "
                "variables, float16 compute, a LossScaleOptimizer in compile/fit) " + what)
    return "torch.autocast + torch.amp.GradScaler " + what


def clip_grad_norm(max_norm: str) -> str:
    """Clip the global gradient norm at ``max_norm`` (a formatted number)."""
    if is_jax():
        return f"optax.chain(optax.clip_by_global_norm({max_norm}), <your optimizer>)"
    if is_tf():
        return (f"global_clipnorm={max_norm} in the optimizer (e.g. keras.optimizers.Adam(..., "
                f"global_clipnorm={max_norm}); clipnorm={max_norm} clips each variable's gradient)")
    return f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={max_norm})"


def clip_api() -> str:
    """The framework's global gradient-norm clipping, named without a value."""
    if is_jax():
        return "optax.clip_by_global_norm"
    if is_tf():
        return "global_clipnorm=... in the Keras optimizer"
    return "torch.nn.utils.clip_grad_norm_"


def set_lr(value: str) -> str:
    """Construct the optimizer with learning rate ``value`` (a formatted number)."""
    if is_jax():
        return (f"optax.<optimizer>(learning_rate={value}) (or optax.inject_hyperparams(optax.<optimizer>)"
                f"(learning_rate={value}) to change it during training)")
    if is_tf():
        return f"keras.optimizers.<Optimizer>(learning_rate={value}) (or optimizer.learning_rate.assign({value}))"
    return f"torch.optim.<Optimizer>(model.parameters(), lr={value})"


def lr_warmup() -> str:
    if is_jax():
        return "a warm-up schedule (optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=N, decay_steps=M))"
    if is_tf():
        return ("a warm-up schedule (keras.optimizers.schedules.CosineDecay(..., warmup_target=lr, "
                "warmup_steps=N))")
    return "a warm-up (torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=N))"


def loss_scaler() -> str:
    if is_jax():
        return "a dynamic loss scale (scale the loss, unscale the gradients, skip non-finite steps)"
    return "keras.mixed_precision.LossScaleOptimizer" if is_tf() else "torch.amp.GradScaler"


def eps_kwarg(optimizer: str, value: str) -> str:
    """'Adam(..., eps=1e-4)' | 'keras.optimizers.Adam(..., epsilon=1e-4)' | 'optax.adam(..., eps=1e-4)'."""
    if is_jax():
        return f"optax.{optimizer.lower()}(..., eps={value})"
    if is_tf():
        return f"keras.optimizers.{optimizer}(..., epsilon={value})"
    return f"{optimizer}(..., eps={value})"


def logits_loss(kind: str = "categorical") -> str:
    """The loss computed from logits."""
    if is_jax():
        return {"binary": "optax.sigmoid_binary_cross_entropy(logits, y)",
                "categorical": "optax.softmax_cross_entropy_with_integer_labels(logits, y)"}[kind]
    if is_tf():
        return {"binary": "keras.losses.BinaryCrossentropy(from_logits=True)",
                "categorical": "keras.losses.SparseCategoricalCrossentropy(from_logits=True) (or "
                               "CategoricalCrossentropy(from_logits=True))"}[kind]
    return {"binary": "F.binary_cross_entropy_with_logits(logits, y)", "categorical": "F.cross_entropy"}[kind]


def log_softmax() -> str:
    if is_jax():
        return "jax.nn.log_softmax"
    return "tf.nn.log_softmax" if is_tf() else "torch.log_softmax"


def norm_hint() -> str:
    """A vector norm whose gradient at 0 is finite."""
    if is_jax():
        return ("jnp.sqrt(jnp.sum((a - b) ** 2, axis=-1) + 1e-12) (the gradient of jnp.linalg.norm and of jnp.sqrt "
                "at 0 is NaN)")
    if is_tf():
        return ("tf.sqrt(tf.reduce_sum(tf.square(a - b), axis=-1) + 1e-12) (tf.norm's gradient at 0 is NaN "
                "as well)")
    return "torch.linalg.vector_norm(a - b, dim=-1)"


def unit(x: str) -> str:
    """L2-normalise along the last axis."""
    if is_jax():
        return f"{x} / jnp.maximum(jnp.linalg.norm({x}, axis=-1, keepdims=True), 1e-12)"
    return f"tf.math.l2_normalize({x}, axis=-1)" if is_tf() else f"F.normalize({x})"


def drop_last() -> str:
    if is_jax():
        return "batch only full slices of the permutation (drop the last partial batch)"
    return "ds.batch(n, drop_remainder=True)" if is_tf() else "DataLoader(..., drop_last=True)"


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and (name[i - 1].islower() or name[i - 1].isdigit()):
            out.append("_")
        out.append(ch.lower())
    return "".join(out)
