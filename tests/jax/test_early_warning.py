"""The JAX early warning (``nanguard.jax.spikes``): the core spike detector judged on the flag vector the
jitted step already returns (no op added, no extra read), a warning before the first non-finite value of a
run whose learning rate is too high, none on a healthy run, and ``on_spike`` skip / rollback acting on the
jitted step's state by input substitution."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402
from nanguard.core.events import NonFiniteError  # noqa: E402

RNG = np.random.default_rng(3)
X = (RNG.normal(size=(64, 4)) * 10).astype(np.float32)  # raw, unscaled features: curvature ~200
Y = (X @ np.array([0.5, -1.0, 0.3, 2.0], np.float32) + 1.0).astype(np.float32)


def mse(p, xb, yb):
    return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)


def _loop(tx, steps, keep=None):
    """A plain JAX + optax jitted loop; ``keep``: a list that gets the parameters after every call."""
    params = {"w": jnp.zeros(4), "b": jnp.array(0.0)}
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(mse)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    losses = []
    for i in range(steps):
        sl = slice((i % 4) * 16, (i % 4 + 1) * 16)
        params, opt_state, loss = train_step(params, opt_state, X[sl], Y[sl])
        losses.append(float(loss))
        if keep is not None:
            keep.append(params)
    return params, losses


def test_a_too_high_learning_rate_warns_before_the_first_nonfinite_value():
    with pytest.raises(NonFiniteError):
        with ngjax.watch(report=None, quiet=True) as drv:
            _loop(optax.sgd(0.03), 200)
    rep = drv.report
    fails = [e for e in rep.events if not e.is_warning]
    warns = [e for e in rep.events if e.is_warning]
    assert fails and warns, [(e.kind, e.step) for e in rep.events]
    assert warns[0].step < fails[0].step
    assert warns[0].cause["category"] in ("lr_too_high", "gradient_explosion"), warns[0].cause
    assert all(np.isfinite(h["loss"]) for h in rep.history if h["step"] <= warns[0].step)


def test_a_healthy_run_gets_no_warning_and_trains_as_without_the_guard():
    ref, ref_losses = _loop(optax.sgd(1e-3), 60)
    with ngjax.watch(report=None, quiet=True) as drv:
        got, losses = _loop(optax.sgd(1e-3), 60)
    assert losses == ref_losses and ref_losses[-1] < ref_losses[0] / 10
    assert drv.report.status == "clean" and not drv.report.events and not drv.spikes.events


def test_the_early_warning_adds_no_op_to_the_jitted_step():
    """The detector reads the vector the check already returns: the traced step is the same with it."""
    from nanguard.jax import hooks

    def jaxpr_size():
        tx = optax.sgd(0.03)
        params = {"w": jnp.zeros(4), "b": jnp.array(0.0)}

        def train_step(params, opt_state, xb, yb):
            loss, grads = jax.value_and_grad(mse)(params, xb, yb)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return len(jax.make_jaxpr(hooks._instrumented(train_step))(params, tx.init(params), X[:16], Y[:16]).eqns)
    with ngjax.watch(report=None, quiet=True, on_spike="warn"):
        warn = jaxpr_size()
    with ngjax.watch(report=None, quiet=True, on_spike="skip"):
        skip = jaxpr_size()
    assert warn == skip


def test_on_spike_skip_undoes_the_warning_steps_update():
    seen = []
    with pytest.raises(NonFiniteError):
        with ngjax.watch(report=None, quiet=True, on_spike="skip") as drv:
            _loop(optax.sgd(0.03), 200, keep=seen)
    w = next(e for e in drv.report.events if e.is_warning)
    assert w.recovery and w.recovery["action"] == "skip_step", w.recovery
    done = w.recovery["actions"]["skip_step"]
    assert done["update_undone"] and done["restored_from_step"] == w.step
    # the call after the warning started from the warning step's own inputs (its update undone): the
    # weights it saw are the ones the warning step saw, and the parameters it returned differ from the
    # warning step's (which the script held for one call)
    recs = {r.step: r for r in drv.history}
    assert recs[w.step].skipped
    assert recs[w.step + 1].param_norm == recs[w.step].param_norm
    assert recs[w.step].param_norm_after == recs[w.step].param_norm
    held = float(jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(seen[w.step]))))
    assert held != pytest.approx(recs[w.step].param_norm, rel=1e-3)


def test_on_spike_rollback_goes_back_before_the_excursion_and_lowers_the_step_size():
    with ngjax.watch(report=None, quiet=True, on_spike="rollback") as drv:
        _, losses = _loop(optax.sgd(0.03), 120)
    rep = drv.report
    warns = [e for e in rep.events if e.is_warning]
    assert warns and not [e for e in rep.events if not e.is_warning], [(e.kind, e.step) for e in rep.events]
    rec = warns[0].recovery
    assert rec and "rollback" in rec["action"] and rec["actions"]["rollback"]["to_step"] < warns[0].step, rec
    assert np.isfinite(losses[-1]) and losses[-1] < losses[0]
