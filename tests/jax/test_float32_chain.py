"""The JAX replay's float32 chain re-run (``facts.float32_check.chain_finite``): a log of a value that its
bfloat16 producers rounded to exactly 0 (``1 - sigmoid(z)`` is 0 in bfloat16 once z > ~6, 1e-3 in float32)
is low_precision_underflow; a log of a real 0 in bfloat16 (the data's) stays log_domain."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import jax_helpers  # noqa: E402
from nanguard.jax.locate import localize  # noqa: E402
from test_locate_replay import adam_step, cause  # noqa: E402

HERE = __file__


def run(step, args):
    res = localize(step, args, user_files=[HERE], phase_hint="forward")
    assert res.error is None and res.reproduced, res.error
    return res.localization


def bf16_bce(p, x, y):
    q = jax.nn.sigmoid(x @ p["w"] + p["b"])
    return -jnp.mean(y * jnp.log(q) + (1 - y) * jnp.log(1 - q))   # bf16-bce


def test_a_log_of_a_bfloat16_rounded_zero_is_low_precision_underflow():
    tx, step = adam_step(bf16_bce)
    p = {"w": jnp.full(2, 3.5, jnp.bfloat16), "b": jnp.asarray(0.0, jnp.bfloat16)}
    x = jnp.asarray([[1.0, 1.0], [0.1, -0.2]], jnp.bfloat16)   # z = 7: sigmoid(7) is 1.0 in bfloat16
    y = jnp.asarray([0.0, 1.0], jnp.bfloat16)
    loc = run(step, (p, tx.init(p), x, y))
    assert loc["origin"]["line"] == jax_helpers.line_of(HERE, "bf16-bce") and loc["origin"]["dtype"] == "bfloat16"
    f32 = loc["facts"]["float32_check"]
    assert f32["direct_finite"] is False and f32["chain_finite"] is True, f32
    assert "sigmoid" in f32["chain_ops"], f32
    assert cause(loc, "forward")["category"] == "low_precision_underflow"


def bf16_log_counts(p, x, y):
    rate = jnp.exp(x @ p["w"])
    return jnp.mean(rate - jnp.log(y) * x[:, 0])   # bf16-log-data


def test_a_log_of_a_real_zero_in_bfloat16_stays_log_domain():
    tx, step = adam_step(bf16_log_counts)
    p = {"w": jnp.full(2, 0.1, jnp.bfloat16)}
    x = jnp.asarray([[1.0, 1.0], [0.5, 0.2]], jnp.bfloat16)
    y = jnp.asarray([3.0, 0.0], jnp.bfloat16)   # a zero count: log(0) in any dtype
    loc = run(step, (p, tx.init(p), x, y))
    assert loc["origin"]["line"] == jax_helpers.line_of(HERE, "bf16-log-data")
    assert not loc["facts"]["float32_check"]["chain_finite"]
    assert cause(loc, "forward")["category"] == "log_domain"
