"""Counterfactual replays of a failing JAX step (``nanguard.jax.experiments``): the domain guard at the
origin's line, rows dropped from the batch, the step in float64; each confirms the cause it tests, the
fix it proves is reported tested, and nothing of the training or of JAX is left changed."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402
from nanguard.core.events import NonFiniteError  # noqa: E402

X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
Y = (X @ np.array([0.5, -1.0, 0.3, 2.0], np.float32)).astype(np.float32)


def _loop(loss_fn, make_tx, steps, params, batch=lambda i: (X, Y)):
    tx = make_tx()  # inside the watch block: optax transforms are hooked at construction
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    for i in range(steps):
        params, opt_state, _ = train_step(params, opt_state, *batch(i))
    return params


def rate_nll(p, xb, yb):  # b: 1.0 -> 0.6 -> -0.07: the rate max(b, 0) reaches 0 at step 2, in every row
    rate = jnp.maximum(p["b"] + 0.0 * xb[:, 0], 0.0)
    return jnp.mean(jnp.log(rate)) + 0.0 * jnp.sum(p["w"])


def mse(p, xb, yb):
    return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)


def _failure(loss_fn, tx, steps, params, **kw):
    with pytest.raises(NonFiniteError) as ei:
        with ngjax.watch(report=None, quiet=True):
            _loop(loss_fn, tx, steps, params, **kw)
    return ei.value.report.events[0]


def test_domain_guard_at_the_origin_line_confirms_log_domain_and_tests_the_clamp():
    ev = _failure(rate_nll, lambda: optax.sgd(0.4), 6, {"w": jnp.zeros(4), "b": jnp.array(1.0)})
    assert (ev.step, ev.cause["category"]) == (2, "log_domain")
    conf = ev.cause.get("confirmed_by") or {}
    assert conf.get("kind") == "domain_guard" and "clamped to >= eps" in conf.get("change", "")
    exp = ev.cause["evidence"]["experiments"][0]
    assert exp["finite"] is True and exp["details"]["guarded_calls"] >= 1
    assert any("clamp" in t.get("fix", "") or t.get("kind") == "domain_guard"
               for t in ev.cause.get("tested_fixes") or []), ev.cause.get("tested_fixes")
    assert "bind" not in jax.lax.log_p.__dict__  # the patch is gone
    why = ev.cause["evidence"]["experiments_unavailable_why"]  # what JAX cannot replay, and why (not "by hand")
    assert why["lr_replay"].startswith("not on JAX") and why["upcast_module"].startswith("not on JAX")


def test_dropping_the_bad_row_confirms_bad_input_data():
    xb_bad = X.copy()
    xb_bad[5, 2] = np.nan
    ev = _failure(mse, lambda: optax.adam(1e-2), 8, {"w": jnp.zeros(4), "b": jnp.array(0.0)},
                  batch=lambda i: (xb_bad if i == 4 else X, Y))
    assert (ev.step, ev.phase, ev.cause["category"]) == (4, "data", "bad_input_data")
    conf = ev.cause.get("confirmed_by") or {}
    assert conf.get("kind") == "drop_samples" and conf["params"]["rows"] == [5]


def test_the_step_in_float64_confirms_a_float16_overflow():
    def energy(p, xb, yb):  # exp of ~12 is 1.6e5: past float16's 65504, finite in float32/float64
        z = xb.astype(jnp.float16) @ p["w"] + p["b"]
        return jnp.mean(jnp.exp(z).astype(jnp.float32) - yb)
    params = {"w": jnp.zeros(4, jnp.float16), "b": jnp.array(10.0, jnp.float16)}
    ev = _failure(energy, lambda: optax.sgd(-1e-5), 30, params)  # ascent: b += 1e-5 exp(b), 10 -> 11.1+
    assert ev.cause["category"] in ("low_precision_overflow", "exp_overflow")
    kinds = {e["kind"]: e["finite"] for e in ev.cause["evidence"]["experiments"]}
    assert kinds.get("float64_step") is True, ev.cause["evidence"]["experiments"]


def test_experiments_leave_a_warned_run_as_it_would_have_trained():
    params = {"w": jnp.zeros(4), "b": jnp.array(1.0)}
    ref = _loop(rate_nll, lambda: optax.sgd(0.4), 5, params)
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        got = _loop(rate_nll, lambda: optax.sgd(0.4), 5, params)
    assert drv.report.events[0].cause.get("confirmed_by")  # the experiments ran at step 2
    for k in ref:
        assert np.asarray(ref[k]).tobytes() == np.asarray(got[k]).tobytes()


def test_experiments_off_runs_none():
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn", experiments="off") as drv:
        _loop(rate_nll, lambda: optax.sgd(0.4), 4, {"w": jnp.zeros(4), "b": jnp.array(1.0)})
    cause = drv.report.events[0].cause
    assert cause["category"] == "log_domain" and not cause.get("confirmed_by")
    assert not (cause.get("evidence") or {}).get("experiments")
