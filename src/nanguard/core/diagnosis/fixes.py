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
before/after).

Structured fixes: a fix a replay can test (a learning rate, a gradient-norm clip, a scope run in float32,
an eps or clamp) is a :class:`Fix`, a ``str`` (its text, unchanged) that also carries ``kind``, ``value``
and ``scope`` and where the value sits in the text (to reword it to the value a replay passed). The
builders that write such a value (:func:`clip_grad_norm`, :func:`clamp_min`, :func:`float32_layer`,
:func:`lr_about`, ...) note it while :func:`speaking` is on; :func:`bind` turns the rule's finished
sentences into :class:`Fix` objects from those notes (a sentence holds the builder's text verbatim), and
:mod:`nanguard.core.experiments.reconcile` reads the fields, never the text. Builders for the history rules (``rules/divergence.py``): :func:`clip_grad_norm`,
:func:`set_lr`, :func:`lr_warmup`, :func:`loss_scaler`, :func:`mixed_precision`.
"""
from __future__ import annotations

import contextlib
import re
from contextvars import ContextVar
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["PYTORCH", "TENSORFLOW", "JAX", "framework_of", "is_jax", "speaking", "framework", "is_tf", "say", "fn", "call",
           "clamp_min", "clamp", "safe_where", "where_fn", "finite_filter", "finite_check", "nan_to_zero",
           "mask_fill_min", "detect_anomaly", "assert_finite_params", "float32_layer", "mixed_precision",
           "clip_grad_norm", "set_lr", "lr_warmup", "loss_scaler", "eps_kwarg", "logits_loss", "log_softmax",
           "reinit", "norm_hint", "unit", "drop_last", "layer_name", "layer_word", "float32_model", "scale_step",
           "Fix", "bind", "restore", "specs", "lr_about", "lr_to", "lr_sentence", "lr_by_10x", "eps_text"]

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
    """Builders answer in ``fw`` inside the block (and note the structured values they write: :func:`bind`)."""
    token = _FW.set(fw if fw in (PYTORCH, TENSORFLOW, JAX) else PYTORCH)
    notes = _NOTES.set([])
    try:
        yield
    finally:
        _NOTES.reset(notes)
        _FW.reset(token)


# ---------------------------------------------------------------------------- structured fixes
KINDS = ("dtype", "clip", "lr", "eps")  # a sentence with several: the first of these names it

Span = Tuple[int, int]


class Fix(str):
    """A fix's text (this ``str``) and what a replay can test of it: ``kind`` (``"lr"``, ``"clip"``,
    ``"dtype"``, ``"eps"``), ``value`` (the learning rate or clip it proposes; None: no number), ``scope``
    (a float32 fix's module or layer path, ``""`` the whole model, None an op); ``spans``: where the value
    is written in the text (an lr's ``"about 0.01"``; every ``max_norm=`` of a clip), ``factor`` and
    ``factor_spans``: an lr cut stated as a factor ("multiply the base lr by 0.1")."""

    kind: Optional[str]
    value: Optional[float]
    scope: Optional[str]
    spans: Tuple[Span, ...]
    factor: Optional[float]
    factor_spans: Tuple[Span, ...]

    def __new__(cls, text: str, kind: Optional[str] = None, value: Optional[float] = None,
                scope: Optional[str] = None, spans: Sequence[Span] = (), factor: Optional[float] = None,
                factor_spans: Sequence[Span] = ()) -> "Fix":
        f = super().__new__(cls, text)
        f.kind, f.value, f.scope = kind, value, scope
        f.spans, f.factor, f.factor_spans = tuple(map(tuple, spans)), factor, tuple(map(tuple, factor_spans))
        return f

    def __reduce__(self) -> Any:  # pickles (a rank's event sent to another) with its fields
        return (Fix, (str(self), self.kind, self.value, self.scope, self.spans, self.factor, self.factor_spans))

    def spec(self) -> Dict[str, Any]:
        """Its fields as plain JSON (``cause.fix_specs``)."""
        d: Dict[str, Any] = {"text": str(self), "kind": self.kind, "value": self.value, "scope": self.scope}
        if self.spans:
            d["spans"] = [list(x) for x in self.spans]
        if self.factor is not None:
            d.update(factor=self.factor, factor_spans=[list(x) for x in self.factor_spans])
        return d

    def plus(self, tail: str) -> "Fix":
        """The same fix with ``tail`` added to its text."""
        return Fix(str(self) + tail, self.kind, self.value, self.scope, self.spans, self.factor, self.factor_spans)

    def reworded(self, value: float, text: str, factor: Optional[float] = None,
                 factor_text: Optional[str] = None) -> "Fix":
        """The fix with its value written as ``text`` at every span (and its factor as ``factor_text``)."""
        edits = [(a, b, text) for a, b in self.spans]
        if factor_text is not None:
            edits += [(a, b, factor_text) for a, b in self.factor_spans]
        out, shift, spans, fspans = str(self), 0, [], []
        for a, b, t in sorted(edits):
            out = out[:a + shift] + t + out[b + shift:]
            (spans if (a, b) in self.spans else fspans).append((a + shift, a + shift + len(t)))
            shift += len(t) - (b - a)
        return Fix(out, self.kind, value, self.scope, spans, factor if factor_text is not None else self.factor,
                   fspans if factor_text is not None else self.factor_spans)


_NOTES: ContextVar[Optional[List[Fix]]] = ContextVar("nanguard_fix_notes", default=None)


def _note(text: str, kind: str, value: Optional[float] = None, scope: Optional[str] = None,
          spans: Sequence[Span] = (), factor: Optional[float] = None, factor_spans: Sequence[Span] = (),
          start: bool = False) -> str:
    """``text``, a builder's output holding a structured value, noted for :func:`bind` (``start``: it names
    the fix only where the sentence starts with it: a float32 scope)."""
    notes = _NOTES.get()
    f = Fix(text, kind, value, scope, spans, factor, factor_spans)
    f.start = start  # type: ignore[attr-defined]
    if notes is not None:
        notes.append(f)
    return f


def _num(text: str) -> Optional[float]:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _all(text: str, part: str) -> List[Span]:
    out, i = [], text.find(part)
    while i >= 0 and part:
        out.append((i, i + len(part)))
        i = text.find(part, i + len(part))
    return out


def bind(fixes: Sequence[Any]) -> List[Any]:
    """The rule's finished fix sentences as :class:`Fix` objects where they hold a noted builder's text
    (see the module docstring); the others unchanged. Several in one sentence: the first of ``KINDS``,
    then the first in the sentence."""
    notes = [n for n in (_NOTES.get() or []) if n]
    out: List[Any] = []
    for f in fixes:
        if not isinstance(f, str) or (isinstance(f, Fix) and f.kind):
            out.append(f)
            continue
        best = None
        for n in notes:
            i = f.find(n)
            if i < 0 or (getattr(n, "start", False) and i != 0):
                continue
            key = (KINDS.index(n.kind), i)
            if best is None or key < best[0]:
                best = (key, n, i)
        if best is None:
            out.append(f)
            continue
        _, n, i = best
        out.append(Fix(f, n.kind, n.value, n.scope, [(a + i, b + i) for a, b in n.spans], n.factor,
                       [(a + i, b + i) for a, b in n.factor_spans]))
    return out


def specs(fixes: Sequence[Any]) -> List[Optional[Dict[str, Any]]]:
    """``cause.fix_specs``: each fix's fields (None for a fix no replay can test), in order."""
    return [f.spec() if isinstance(f, Fix) and f.kind else None for f in fixes]


def restore(fixes: Sequence[Any], saved: Any) -> List[Any]:
    """Fixes read back from JSON (plain ``str``) with their fields from ``saved`` (``cause.fix_specs``),
    matched by text."""
    by_text = {d["text"]: d for d in saved or () if isinstance(d, dict) and isinstance(d.get("text"), str)}
    out: List[Any] = []
    for f in fixes:
        d = by_text.get(f) if isinstance(f, str) and not isinstance(f, Fix) else None
        out.append(f if d is None else Fix(f, d.get("kind"), d.get("value"), d.get("scope"), d.get("spans") or (),
                                           d.get("factor"), d.get("factor_spans") or ()))
    return out


def lr_about(value: str) -> str:
    """``"about 0.01"``: the learning rate a fix proposes (its value, reworded to the rate a replay passed)."""
    t = f"about {value}"
    return _note(t, "lr", _num(value), spans=[(0, len(t))])


def lr_to(value: str) -> str:
    """``"0.01"``: a learning rate a fix proposes, written plainly ("0.1 -> 0.01")."""
    return _note(value, "lr", _num(value), spans=[(0, len(value))])


def lr_sentence(template: str, value: str, factor: Optional[str] = None) -> str:
    """A learning-rate fix written from ``template``: ``{about}`` becomes ``"about <value>"`` (the rate it
    proposes) and ``{factor}`` the cut stated as a factor ("multiply the base lr by {factor}"); both are
    noted, so a replay's rate rewords the two together."""
    out, spans, fspans = "", [], []
    rest = template
    while True:
        i, j = rest.find("{about}"), rest.find("{factor}")
        if i < 0 and j < 0:
            out += rest
            break
        if j < 0 or 0 <= i < j:
            out += rest[:i]
            t = f"about {value}"
            spans.append((len(out), len(out) + len(t)))
            out, rest = out + t, rest[i + len("{about}"):]
        else:
            out += rest[:j]
            t = str(factor)
            fspans.append((len(out), len(out) + len(t)))
            out, rest = out + t, rest[j + len("{factor}"):]
    return _note(out, "lr", _num(value), spans=spans, factor=_num(factor) if factor is not None else None,
                 factor_spans=fspans)


def lr_by_10x() -> str:
    """``"by 10x"``: a learning-rate cut without a value."""
    return _note("by 10x", "lr")


def eps_text(text: str) -> str:
    """``text`` (code that keeps a value inside an op's domain: ``x + 1e-5``, ``eps=1e-4``) noted as an
    eps fix."""
    return _note(text, "eps")


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


_ATOM = re.compile(r"[\w.]+(?:(?:\[[^\[\]]*\]|\((?:[^()]|\([^()]*\))*\))[\w.]*)*")


def receiver(x: str) -> str:
    """``x`` as the receiver of a method call: parenthesised unless it is one name, attribute, index or call
    chain (``(positives / self.temperature).clamp(...)``, not ``positives / self.temperature.clamp(...)``,
    which clamps the divisor)."""
    x = x.strip()
    return x if _ATOM.fullmatch(x) else f"({x})"


def clamp_min(x: str, lo: str) -> str:
    """'x.clamp(min=lo)' | 'tf.maximum(x, lo)' | 'jnp.maximum(x, lo)' (an eps fix when ``lo`` is a number)."""
    if is_jax():
        return _eps_if(f"jnp.maximum({x}, {lo})", lo)
    return _eps_if(f"tf.maximum({x}, {lo})" if is_tf() else f"{receiver(x)}.clamp(min={lo})", lo)


def clamp(x: str, lo: str, hi: str) -> str:
    """'x.clamp(lo, hi)' | 'tf.clip_by_value(x, lo, hi)' | 'jnp.clip(x, lo, hi)' (an eps fix when ``lo`` is a
    number)."""
    if is_jax():
        return _eps_if(f"jnp.clip({x}, {lo}, {hi})", lo)
    return _eps_if(f"tf.clip_by_value({x}, {lo}, {hi})" if is_tf() else f"{receiver(x)}.clamp({lo}, {hi})", lo)


def _eps_if(text: str, lo: str) -> str:
    """``text`` noted as an eps fix when the bound ``lo`` is written as a number (``1e-12``, ``-1 + 1e-6``;
    not ``eps``)."""
    head = lo.strip().lstrip("-")
    return eps_text(text) if head[:1].isdigit() else text


def where_fn() -> str:
    if is_jax():
        return "jnp.where"
    return "tf.where" if is_tf() else "torch.where"


_DIVISIONS = {"div", "divide", "true_divide", "truediv", "realdiv", "div_no_nan", "reciprocal"}
_PRODUCTS = {"mul", "multiply", "mul_no_nan"}


def safe_where(op: str, fill: str = "1.0", out: str = "0.0") -> str:
    """The double-where pattern: the unselected branch never sees the bad input (a division's denominator)."""
    w = where_fn()
    parts = op.split(".")
    name = (parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]).strip("_").lower()  # Tensor.__truediv__
    if name in _PRODUCTS:  # 0 * -inf: the operand that is non-finite where m is False gets a finite stand-in
        return f"{w}(m, a * {w}(m, b, 0.0), {out}) (b: the operand that is non-finite where m is False)"
    if name in _DIVISIONS:
        num = "1" if name == "reciprocal" else "a"
        text = f"{w}(m, {num} / {w}(m, b, {fill}), {out})"
        if is_tf():  # the library's own: 0 where b is 0, and its gradient is 0 there too
            text += f", or tf.math.divide_no_nan({num}, b)"
        return text
    return f"{w}(m, {call(op, f'{w}(m, x, {fill})')}, {out})"


def finite_filter() -> str:
    """Keep the rows of x whose features are all finite."""
    if is_jax():
        return ("keep = np.isfinite(x).reshape(len(x), -1).all(axis=1); x, y = x[keep], y[keep] before batching (on "
                "the host, outside jit)")
    if is_tf():
        return ("keep = np.isfinite(x).reshape(len(x), -1).all(axis=1); x, y = x[keep], y[keep] before building the "
                "dataset, or "
                "ds = ds.filter(lambda x, y: tf.reduce_all(tf.math.is_finite(x))) in a tf.data pipeline")
    return "keep = torch.isfinite(x).flatten(1).all(dim=1); x, y = x[keep], y[keep] before building batches"


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
        text = (f"run {what} in float32: construct it with dtype=jnp.float32 and param_dtype=jnp.float32 (Flax) "
                "and feed it x.astype(jnp.float32)")
        return _note(text, "dtype", scope=mod, start=True) if mod else text
    if is_tf():
        name = origin.get("layer") or mod
        if name:
            t = origin.get("module_type")
            return _note(f"run layer '{name}'" + (f" ({t})" if t else "") + " in float32: construct it with "
                         "dtype=\"float32\" (a float32 dtype policy for that layer under mixed_float16; Keras casts "
                         "its inputs), and keep the layers after it in float32 too", "dtype", scope=name, start=True)
        return _note(f"compute the op at {where} in float32 (tf.cast its inputs to tf.float32)", "dtype", start=True)
    if mod:
        return _note(f"run {layer_name(origin)} in float32: e.g. model.get_submodule('{mod}').float() and feed it "
                     "x.float(), or wrap it in torch.autocast(device_type, enabled=False)", "dtype", scope=mod,
                     start=True)
    return _note(f"compute the op at {where} in float32 (cast its inputs with .float())", "dtype", start=True)


def float32_model() -> str:
    """Run the whole model in float32 (the scope a replay showed finite when a module alone was not)."""
    if is_jax():
        text = ("run the whole model in float32: construct its modules with dtype=jnp.float32 and "
                "param_dtype=jnp.float32 (Flax) and feed it x.astype(jnp.float32)")
    elif is_tf():
        text = ("run the whole model in float32: keras.mixed_precision.set_global_policy(\"float32\") before "
                "building it (or construct every layer with dtype=\"float32\")")
    else:
        text = ("run the whole model in float32: model.float() and feed it x.float() (or leave torch.autocast off "
                "around it)")
    return _note(text, "dtype", scope="", start=True)


def scale_step(before: str, factor: str, after: str) -> str:
    """A hand-written update (no optimizer object): scale its step (``p -= lr * p.grad``) by ``factor``."""
    if is_jax():
        update = "params - lr * grads"
    elif is_tf():
        update = "v.assign_sub(lr * g)"
    else:
        update = "p -= lr * p.grad"
    return lr_sentence(f"scale the step by {{factor}} in the hand-written update ({update}: lr {before} -> "
                       "{about})", after, factor)


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
    """Clip the global gradient norm at ``max_norm`` (a formatted number; noted as a clip fix, every place
    the value is written)."""
    if is_jax():
        text, keys = f"optax.chain(optax.clip_by_global_norm({max_norm}), <your optimizer>)", ("clip_by_global_norm(",)
    elif is_tf():
        text = (f"global_clipnorm={max_norm} in the optimizer (e.g. keras.optimizers.Adam(..., "
                f"global_clipnorm={max_norm}); clipnorm={max_norm} clips each variable's gradient)")
        keys = ("clipnorm=",)  # global_clipnorm= ends with it
    else:
        text, keys = f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={max_norm})", ("max_norm=",)
    v = _num(max_norm)
    if v is None:
        return text
    spans = sorted({(a + len(k), b) for k in keys for a, b in _all(text, k + max_norm)})
    return _note(text, "clip", v, spans=spans)


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
        text = f"optax.{optimizer.lower()}(..., eps={value})"
    elif is_tf():
        text = f"keras.optimizers.{optimizer}(..., epsilon={value})"
    else:
        text = f"{optimizer}(..., eps={value})"
    return _eps_if(text, value)


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
        return (eps_text("jnp.sqrt(jnp.sum((a - b) ** 2, axis=-1) + 1e-12)") + " (the gradient of jnp.linalg.norm "
                "and of jnp.sqrt at 0 is NaN)")
    if is_tf():
        return (eps_text("tf.sqrt(tf.reduce_sum(tf.square(a - b), axis=-1) + 1e-12)") + " (tf.norm's gradient at 0 "
                "is NaN as well)")
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
