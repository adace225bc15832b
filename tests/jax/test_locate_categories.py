"""The JAX replay's evidence for the categories the JAX scenarios added (tests/scenarios_jax): in miniature,
in-process. jnp.std's division inside its jitted body (variance_zero), an eps that float16 rounded to 0
before the jaxpr was written (low_precision_underflow), log-probabilities given to optax.kl_divergence
(kl_misuse), and the where that hides a 0/0 whose backward is still NaN (where_gradient_trap)."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_helpers  # noqa: E402
from nanguard.jax.locate import localize  # noqa: E402
from test_locate_replay import adam_step, cause  # noqa: E402

HERE = __file__


def line_of(marker: str) -> int:
    return jax_helpers.line_of(HERE, marker)


def run(step, args, **kw):
    res = localize(step, args, user_files=[HERE], **kw)
    assert res.error is None and res.reproduced, res.error
    return res, res.localization


def std_of_one(p, x, y):
    z = (x - x.mean(0)) / jnp.std(x, axis=0, ddof=1)   # std-ddof
    return jnp.mean((z @ p["w"] - y) ** 2)


def test_std_with_ddof_over_one_row_is_variance_zero():
    tx, step = adam_step(std_of_one)
    p = {"w": jnp.ones(3)}
    res, loc = run(step, (p, tx.init(p), jnp.ones((1, 3)), jnp.zeros(1)), phase_hint="forward")
    assert loc["origin"]["line"] == line_of("std-ddof")
    assert loc["facts"]["zero_denominator"]["from_std_var"] is True
    assert cause(loc, "forward")["category"] == "variance_zero"


def half_bce(p, x, y):
    q = jax.nn.sigmoid(x @ p["w"])
    return -jnp.mean(y * jnp.log(q + 1e-8) + (1 - y) * jnp.log(1 - q + 1e-8))   # half-eps


def test_an_eps_rounded_to_zero_in_float16_is_read_from_the_line():
    tx, step = adam_step(half_bce)
    p = {"w": jnp.full(2, 8.0, jnp.float16)}
    x = jnp.asarray([[1.0, 1.0], [0.1, 0.2]], jnp.float16)   # sigmoid(16) is 1.0 in float16
    y = jnp.asarray([0.0, 1.0], jnp.float16)
    res, loc = run(step, (p, tx.init(p), x, y), phase_hint="forward")
    assert loc["origin"]["line"] == line_of("half-eps") and loc["origin"]["dtype"] == "float16"
    eps = loc["facts"]["eps_constants"]
    assert any(e["value"] == 1e-8 and e["rounds_to_zero"] and e.get("written") for e in eps), eps
    assert cause(loc, "forward")["category"] == "low_precision_underflow"


def distill(p, x, t):
    log_q = jax.nn.log_softmax(x @ p["w"], axis=-1)
    return optax.kl_divergence(log_q, t).mean()   # kl-call


def test_log_probabilities_given_to_optax_kl_divergence_is_kl_misuse():
    tx, step = adam_step(distill)
    p = {"w": jnp.ones((3, 4)) * 0.1}
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
    t = jax.nn.log_softmax(jnp.asarray(np.random.default_rng(1).normal(size=(5, 4)), jnp.float32), -1)
    res, loc = run(step, (p, tx.init(p), x, t), phase_hint="forward")
    assert loc["origin"]["line"] == line_of("kl-call")
    kl = loc["facts"]["kl_div"]
    assert kl["log_target"] is False and kl["target_looks_like_log_probs"] and kl["target_negatives"] == 20
    out = cause(loc, "forward")
    assert out["category"] == "kl_misuse" and "kl_divergence_with_log_targets" in " ".join(out["fixes"])


def guarded_mean(p, v, y):
    count = (v != 0).sum(1, keepdims=True).astype(jnp.float32)
    pooled = jnp.where(count > 0, (v * p["w"]).sum(1, keepdims=True) / count, 0.0)   # where-div
    return jnp.mean((pooled[:, 0] - y) ** 2)


def test_a_where_that_hides_a_zero_count_is_a_where_gradient_trap():
    tx, step = adam_step(guarded_mean)
    p = {"w": jnp.ones(3)}
    v = jnp.asarray([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    res, loc = run(step, (p, tx.init(p), v, jnp.zeros(2)), phase_hint="backward")
    assert loc["phase"] == "backward" and loc["origin"]["line"] == line_of("where-div")
    assert loc["facts"]["where_trap"] is True
    assert cause(loc, "backward")["category"] == "where_gradient_trap"


def guarded_root(p, t, y):
    disc = p["w0"] ** 2 - p["g"] ** 2
    wd = jnp.where(disc > 0, jnp.sqrt(disc), 0.0)   # where-sqrt
    return jnp.mean((jnp.cos(wd * t) - y) ** 2)


def test_a_where_that_hides_a_negative_root_is_a_where_gradient_trap():
    """JAX computes sqrt's derivative factor 0.5 / sqrt(x) in the forward pass: that arithmetic use of the NaN
    is the backward's, not the program's (it was read as a use, and the trap as a plain sqrt_domain)."""
    tx, step = adam_step(guarded_root)
    p = {"w0": jnp.array(1.0), "g": jnp.array(2.0)}
    t = jnp.linspace(0.0, 1.0, 4)
    res, loc = run(step, (p, tx.init(p), t, jnp.ones(4)), phase_hint="backward")
    assert loc["origin"]["line"] == line_of("where-sqrt") and loc["facts"]["where_trap"] is True, loc["facts"]
    assert cause(loc, "backward")["category"] == "where_gradient_trap"


def ce_by_hand(p, x, y):
    prob = jax.nn.softmax(x @ p["w"], axis=-1)
    return -jnp.mean(jnp.log(jnp.take_along_axis(prob, y[:, None], axis=-1)))   # log-softmax


def test_log_of_a_softmax_that_rounded_to_zero_is_named_softmax_and_fixed_with_log_softmax():
    tx, step = adam_step(ce_by_hand)
    p = {"w": jnp.array([[40.0, -40.0], [-40.0, 40.0]])}   # logits 160 apart: the other class's p is 0
    x = jnp.array([[2.0, 0.0], [0.0, 2.0]])
    res, loc = run(step, (p, tx.init(p), x, jnp.array([1, 0])), phase_hint="forward")
    assert loc["origin"]["line"] == line_of("log-softmax")
    assert "_softmax" in [op for chain in loc["facts"]["producers"] for op in chain]
    c = cause(loc, "forward")
    assert c["category"] == "log_domain"
    assert any("jax.nn.log_softmax" in f for f in c["fixes"]), c["fixes"]


def info_nce(p, x, y):
    sim = (x @ p["w"]) @ y.T   # two views: the negative pair (0, 1) is more similar than the positive one
    allp = jnp.sum(jnp.exp(sim / 0.01), axis=1)   # exp-overflow
    pos = jnp.exp(jnp.diagonal(sim) / 0.01)
    return -jnp.mean(jnp.log(pos / allp))


def test_an_overflow_a_division_turned_into_zero_is_the_origin_of_the_log_of_that_zero():
    """exp overflows on one negative pair (exp(95) = inf), pos / inf = 0 is finite (exp(80) is not inf),
    log(0) = -inf: the failure was born at the exp, not at the log."""
    tx, step = adam_step(info_nce)
    p = {"w": jnp.eye(2)}
    x = jnp.array([[1.0, 0.0], [0.0, 0.5]])
    y = jnp.array([[0.8, 0.0], [0.95, 0.0]])
    res, loc = run(step, (p, tx.init(p), x, y), phase_hint="forward")
    assert loc["origin"]["line"] == line_of("exp-overflow"), loc["origin"]
    assert loc["origin"]["op"] == "exp"
