"""The JAX replay (nanguard.jax.locate): the public scenarios' mechanisms in miniature, backward origins,
nested jit / scan, and the -inf mask that must not count. In-process, a few equations each."""
from __future__ import annotations

import re

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from nanguard.core.diagnosis import diagnose  # noqa: E402
from nanguard.jax.locate import localize  # noqa: E402

import jax_helpers  # noqa: E402

HERE = __file__


def line_of(marker: str) -> int:
    return jax_helpers.line_of(HERE, marker)


def adam_step(loss_fn, lr=0.05):
    tx = optax.adam(lr)

    @jax.jit
    def step(p, s, *batch):
        loss, g = jax.value_and_grad(loss_fn)(p, *batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss
    return tx, step


def run(step, args, **kw):
    res = localize(step, args, user_files=[HERE], **kw)
    assert res.error is None, res.error
    return res, res.localization


FOREIGN = re.compile(r"\btorch\b|\bF\.[a-z_]+|\.clamp\(|GradScaler|autocast|DataLoader|\btf\.|\bkeras\b|"
                     r"Keras|LossScaleOptimizer|\bnn\.Module|\.float\(\)")


def cause(loc, phase):
    """The diagnosis of a JAX localization, checked to speak JAX (no PyTorch / TensorFlow words)."""
    out = diagnose(loc, [], phase=phase, context={"framework": "jax"})
    text = " ".join([out["summary"]] + list(out["fixes"]))
    assert not FOREIGN.search(text), (FOREIGN.search(text).group(0), text)
    return out


# ---------------------------------------------------------------------------- forward origins
def poisson_nll(p, x, y):
    rate = jnp.maximum(x @ p["w"] + p["b"], 0.0)
    return jnp.mean(rate - y * jnp.log(rate))   # log-of-zero


def test_log_of_zero_in_a_poisson_nll_is_a_forward_origin_with_its_line_and_row():
    tx, step = adam_step(poisson_nll)
    p = {"w": jnp.array([1.0, -1.0]), "b": jnp.array(0.0)}
    x = jnp.array([[3.0, 1.0], [1.0, 2.0], [0.5, 0.2]])
    y = jnp.array([1.0, 2.0, 0.0])
    res, loc = run(step, (p, tx.init(p), x, y), phase_hint="forward")
    assert res.reproduced and loc["phase"] == "forward" and loc["backend"] == "jax"
    o = loc["origin"]
    assert (o["op"], o["jax_op"], o["stage"]) == ("log", "log", "forward")
    assert o["line"] == line_of("log-of-zero") and o["file"] == HERE
    assert o["samples"] == [1]                       # x[1] @ w = -1 -> rate 0
    assert loc["facts"]["log_domain"]["zeros"] == 1
    assert cause(loc, "forward")["category"] == "log_domain"


def mse(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def test_a_nan_row_of_the_batch_is_bad_input_data_with_its_row():
    tx, step = adam_step(mse)
    p = {"w": jnp.ones((3,)), "b": jnp.array(0.0)}
    x = np.ones((4, 3), np.float32)
    x[2, 1] = np.nan
    y = jnp.zeros((4,))
    res, loc = run(step, (p, tx.init(p), jnp.asarray(x), y),
                   names={"[2]": {"name": "batch.x", "kind": None, "module": None}})
    assert res.reproduced and loc["phase"] == "data"
    pre = loc["preexisting"]
    assert pre["kind"] == "data" and pre["name"] == "batch.x" and pre["samples"] == [2]
    assert cause(loc, "data")["category"] == "bad_input_data"


def test_a_leaf_kind_comes_from_how_the_step_uses_it():
    """Not from names: a NaN parameter is read by the forward and the update, Adam's mu by the update."""
    tx, step = adam_step(mse)
    p = {"w": jnp.array([1.0, np.nan, 1.0]), "b": jnp.array(0.0)}
    x, y = jnp.ones((4, 3)), jnp.zeros((4,))
    _, loc = run(step, (p, tx.init(p), x, y))
    assert loc["phase"] == "params" and loc["preexisting"]["kind"] == "param"
    assert loc["preexisting"]["name"] == "[0]['w']"
    p = {"w": jnp.ones((3,)), "b": jnp.array(0.0)}
    s = tx.init(p)
    s = (s[0]._replace(mu={"w": jnp.array([np.nan, 0.0, 0.0]), "b": jnp.array(0.0)}),) + tuple(s[1:])
    _, loc = run(step, (p, s, x, y))
    assert loc["phase"] == "optimizer" and loc["preexisting"]["kind"] == "optimizer_state"


def test_gradients_that_overflow_from_a_too_large_step_are_an_overflow_of_finite_values():
    tx = optax.sgd(1e-4, momentum=0.9)

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] - y) ** 2)

    @jax.jit
    def step(p, s, x, y):
        val, g = jax.value_and_grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, val

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(500, 2500, (16, 2)).astype(np.float32))
    y = jnp.asarray(rng.uniform(0, 5, (16,)).astype(np.float32))
    p = {"w": jnp.zeros((2,))}
    s = tx.init(p)
    for _ in range(40):
        new_p, new_s, val = step(p, s, x, y)
        if not all(bool(jnp.isfinite(v).all()) for v in jax.tree_util.tree_leaves((new_p, new_s, val))):
            break
        p, s = new_p, new_s
    else:
        pytest.fail("the run never went non-finite")
    res, loc = run(step, (p, s, x, y))
    assert res.reproduced
    o = loc["origin"]
    assert o["output"]["nan"] == 0 and (o["output"]["posinf"] or o["output"]["neginf"])
    assert loc["facts"]["float64_check"]["finite"] is True          # float64 holds it: the range ran out
    assert "overflow" in loc["facts"]


# ---------------------------------------------------------------------------- masks
def attention_loss(s, mask):
    s = jnp.where(mask, s, -jnp.inf)   # mask-write
    return jnp.sum(jax.nn.softmax(s, axis=-1) ** 2)   # softmax-call


def test_an_intentional_minus_inf_mask_that_a_softmax_absorbs_is_no_origin():
    s = jnp.arange(12.0).reshape(3, 4)
    mask = jnp.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], bool)
    res, loc = run(jax.value_and_grad(attention_loss), (s, mask))
    assert not res.reproduced and loc["sink"]["kind"] is None
    assert loc["masked_nonfinite_origins"] >= 1
    res, loc = run(jax.value_and_grad(attention_loss), (s, mask), phase_hint="forward")   # the detector disagrees
    assert not res.reproduced and any("XLA's fusions" in n for n in loc["notes"])


def test_a_softmax_row_with_every_entry_masked_is_the_origin_of_its_nan():
    s = jnp.arange(12.0).reshape(3, 4)
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    res, loc = run(jax.value_and_grad(attention_loss), (s, mask))
    assert res.reproduced and loc["phase"] == "forward"
    o = loc["origin"]
    assert o["op"] == "_softmax" and o["jax_op"] == "sub" and o["line"] == line_of("softmax-call")
    assert loc["facts"]["softmax_all_masked_rows"]["batch_rows"] == [1]
    assert cause(loc, "forward")["category"] == "masked_softmax"


# ---------------------------------------------------------------------------- backward origins
def dist_loss(p, a):
    d = jnp.sqrt(jnp.sum((a - p["c"]) ** 2, axis=-1))   # sqrt-at-zero
    return jnp.mean(d)


def norm_loss(p, a):
    return jnp.mean(jnp.linalg.norm(a - p["c"], axis=-1))   # norm-at-zero


@pytest.mark.parametrize("fn,marker", [(dist_loss, "sqrt-at-zero"), (norm_loss, "norm-at-zero")])
def test_the_gradient_of_a_root_at_zero_is_a_backward_origin_on_the_forward_line(fn, marker):
    tx, step = adam_step(fn)
    p = {"c": jnp.array([1.0, 2.0])}
    a = jnp.array([[1.0, 2.0], [0.0, 1.0]])            # row 0 sits on the centre: distance 0
    res, loc = run(step, (p, tx.init(p), a))
    assert res.reproduced and loc["phase"] == "backward" and loc["sink"]["kind"] == "grad"
    o = loc["origin"]
    assert o["stage"] == "backward" and o["forward_op"] == "sqrt" and o["line"] == line_of(marker)
    assert loc["facts"]["examined"] == "forward_op" and loc["facts"]["sqrt_domain"]["zeros"] == 1
    assert cause(loc, "backward")["category"] == "sqrt_domain"


def guarded_log(p, x):
    z = x * p["s"]
    return jnp.sum(jnp.where(z > 0, jnp.log(z), 0.0))   # where-log


def test_a_log_hidden_by_where_fails_in_its_backward_and_is_a_where_trap():
    tx, step = adam_step(guarded_log)
    p = {"s": jnp.array(1.0)}
    res, loc = run(step, (p, tx.init(p), jnp.array([1.0, 0.0, 2.0])))
    assert res.reproduced and loc["phase"] == "backward"
    o = loc["origin"]
    assert o["stage"] == "backward" and o["forward_op"] == "log" and o["line"] == line_of("where-log")
    assert loc["facts"]["where_trap"] is True


# ---------------------------------------------------------------------------- nested jit and scan
@jax.jit
def inner(h):
    return jnp.log(h)   # inner-jit-log


def scan_loss(p, xs):
    def body(c, x):
        c = c + p["k"] * x
        return c, jnp.sqrt(c)   # scan-body
    _, ys = lax.scan(body, jnp.array(0.0), xs)
    return jnp.sum(ys) + jnp.sum(inner(xs + 1.0))


def test_origins_inside_a_nested_jit_and_a_scan_body_keep_their_lines():
    tx, step = adam_step(scan_loss)
    p = {"k": jnp.array(1.0)}
    res, loc = run(step, (p, tx.init(p), jnp.array([3.0, -4.0, 1.0])))
    assert res.reproduced and loc["origin"]["line"] == line_of("scan-body")   # c = -1 at iteration 1
    assert loc["origin"]["op"] == "sqrt"
    res, loc = run(step, (p, tx.init(p), jnp.array([3.0, 1.0, -1.0])))
    assert res.reproduced and loc["origin"]["line"] == line_of("inner-jit-log")   # log(0); c stays >= 0


def test_the_where_trap_and_the_history_diagnoses_speak_jax():
    tx, step = adam_step(guarded_log)
    p = {"s": jnp.array(1.0)}
    _, loc = run(step, (p, tx.init(p), jnp.array([1.0, 0.0, 2.0])))
    out = cause(loc, "backward")
    assert out["category"] == "where_gradient_trap"
    assert any("jnp.where(m, jnp.log(jnp.where(m, x, 1.0)), 0.0)" in f for f in out["fixes"]), out["fixes"]
    out = diagnose(None, [], phase="data", context={"framework": "jax"})
    assert out["category"] == "bad_input_data"
    assert not FOREIGN.search(" ".join(out["fixes"])) and "np.isfinite(x)" in out["fixes"][0], out["fixes"]


def test_a_step_that_does_not_return_its_loss_names_the_gradient_of_its_log():
    """jax.grad stages only what the gradient needs: log(0) itself is never computed, its derivative
    1/x at 0 is, on the log's line."""
    tx = optax.adam(0.05)

    @jax.jit
    def step(p, s, x, y):
        g = jax.grad(poisson_nll)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p = {"w": jnp.array([1.0, -1.0]), "b": jnp.array(0.0)}
    x, y = jnp.array([[3.0, 1.0], [1.0, 2.0]]), jnp.array([1.0, 2.0])
    res, loc = run(step, (p, tx.init(p), x, y))
    assert res.reproduced and loc["sink"]["kind"] == "grad"
    o = loc["origin"]
    assert (o["stage"], o["forward_op"], o["line"]) == ("backward", "log", line_of("log-of-zero"))
    assert cause(loc, "backward")["category"] == "log_domain"


# ---------------------------------------------------------------------------- op families
@pytest.mark.parametrize("prim,family", [("log", "log"), ("log1p", "log1p"), ("div", "div"), ("rem", "div"),
                                         ("exp", "exp"), ("exp2", "exp"), ("expm1", "exp"), ("sqrt", "sqrt"),
                                         ("rsqrt", "sqrt"), ("integer_pow", "pow"), ("pow", "pow"),
                                         ("acos", "trig"), ("asin", "trig"), ("atanh", "trig"), ("acosh", "acosh"),
                                         ("lgamma", "log"), ("digamma", "log")])
def test_lax_primitives_map_to_the_core_op_families(prim, family):
    from nanguard.jax.locate import ops
    assert ops.family_of(prim).name == family


def test_a_float16_exp_that_float32_holds_is_a_low_precision_overflow():
    def loss(p, x):
        return jnp.mean(jnp.exp(x * p["a"]).astype(jnp.float32))   # f16-exp
    p = {"a": jnp.array(2.0, jnp.float16)}
    res, loc = run(jax.value_and_grad(loss), (p, jnp.array([1.0, 6.0], jnp.float16)))
    assert res.reproduced and loc["origin"]["op"] == "exp" and loc["origin"]["line"] == line_of("f16-exp")
    assert loc["facts"]["float32_check"]["direct_finite"] is True and loc["facts"]["exp_input_max"] == 12.0
    assert cause(loc, "forward")["category"] == "low_precision_overflow"


def test_arccos_of_a_cosine_above_one_is_a_trig_domain_error_in_the_forward():
    def loss(p, a, b):
        c = jnp.sum(a * b, -1) * p["s"]
        return jnp.mean(jnp.arccos(c))   # arccos
    p = {"s": jnp.array(1.5)}
    res, loc = run(jax.value_and_grad(loss), (p, jnp.array([[1.0, 0.0], [0.6, 0.8]]), jnp.array([[1.0, 0.0], [0.0, 0.5]])))
    assert res.reproduced and loc["origin"]["op"] == "acos" and loc["origin"]["samples"] == [0]
    assert loc["facts"]["trig_domain"]["abs_gt_1"] == 1
    assert cause(loc, "forward")["category"] == "trig_domain"


def test_a_minus_inf_mask_that_a_matmul_sums_with_plus_inf_is_a_mask_escape():
    def loss(p, h, mask):
        s = jnp.where(mask[..., None], h, -jnp.inf).max(axis=1)   # max-pool-mask
        return jnp.mean((s @ p["w"]) ** 2)   # pooled-matmul
    p = {"w": jnp.array([[1.0, -1.0], [2.0, 0.5]])}
    h = jnp.ones((3, 4, 2))
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], bool)   # row 1: every position masked
    res, loc = run(jax.value_and_grad(loss), (p, h, mask))
    o = loc["origin"]
    assert res.reproduced and (o["jax_op"], o["line"], o["samples"]) == ("dot_general", line_of("pooled-matmul"), [1])
    assert loc["facts"]["mask_escape"]["line"] == line_of("max-pool-mask")
    assert cause(loc, "forward")["category"] == "masked_softmax"


def test_the_replay_never_raises_and_gives_up_at_its_deadline():
    tx, step = adam_step(poisson_nll)
    p = {"w": jnp.array([1.0, -1.0]), "b": jnp.array(0.0)}
    args = (p, tx.init(p), jnp.array([[3.0, 1.0], [1.0, 2.0]]), jnp.array([1.0, 2.0]))
    res = localize(step, args, user_files=[HERE], max_seconds=0.0)
    assert not res.reproduced and "ran out of time" in res.error
    res = localize(lambda *a: 1 / 0, args, user_files=[HERE])
    assert not res.reproduced and res.error.startswith("ZeroDivisionError")


def test_dense_labels_times_a_masked_log_probability_is_a_mask_escape_not_the_integer_label_loss():
    def dense(p, logits, allowed, y):
        z = jnp.where(allowed, logits * p["t"], -jnp.inf)   # class-mask
        return jnp.mean(optax.softmax_cross_entropy(z, jax.nn.one_hot(y, 4)))   # dense-ce

    def sparse(p, logits, allowed, y):
        z = jnp.where(allowed, logits * p["t"], -jnp.inf)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(z, y))
    p = {"t": jnp.array(1.0)}
    args = (p, jnp.ones((2, 4)), jnp.array([[1, 1, 0, 1], [1, 1, 1, 1]], bool), jnp.array([0, 2]))
    res, loc = run(jax.value_and_grad(dense), args)
    assert res.reproduced and loc["origin"]["line"] == line_of("dense-ce")
    assert loc["facts"]["mask_escape"]["line"] == line_of("class-mask")
    assert cause(loc, "forward")["category"] == "masked_softmax"
    res, loc = run(jax.value_and_grad(sparse), args)
    assert not res.reproduced
