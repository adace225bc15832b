"""JAX without ``--recover`` (issue 22): an early warning's fix is replayed on the warning step's own call from
the state it started from (its inputs, kept by reference), the step compiled afresh with the cut; nothing is
written back, so the run trains on bit-for-bit as with the replays off (random keys included). A step that
returns its state in another order is replayed too (outputs matched to the inputs they carry); an eager
update has no call to replay: untested, and why; a healthy run loads none of it."""
from __future__ import annotations

import sys

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402

RNG = np.random.default_rng(0)
N = 1024
# a house-price regression on raw features (size, rooms, age, distance up to 15 km): SGD at 0.07 is too
# high for their curvature, the loss grows for some 15 steps and overflows
X = np.stack([RNG.random(N) * 2 + 0.5, RNG.integers(1, 7, N), RNG.random(N) * 5, RNG.random(N) * 15], 1).astype("float32")
Y = (X @ np.array([1.5, 0.4, -0.3, -0.1]) + 2.0 + 0.3 * RNG.normal(size=N)).astype("float32")


def loss_fn(params, xb, yb, k):
    keep = jax.random.bernoulli(k, 0.9, xb.shape)  # input dropout
    return jnp.mean((jnp.where(keep, xb / 0.9, 0.0) @ params["w"] + params["b"] - yb) ** 2)


def _loop(lr, steps=12, test_fixes=True, order="state_first", jit=True):
    """The jitted loop under ``nanguard.jax.watch`` (warn): (driver, losses, final parameters)."""
    rng = np.random.default_rng(1)
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        drv.spikes.test_fixes = test_fixes
        tx = optax.sgd(lr)
        params = {"w": jnp.zeros(4), "b": jnp.zeros(())}
        opt_state = tx.init(params)
        key = jax.random.PRNGKey(0)

        def train_step(params, opt_state, xb, yb, k):
            loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb, k)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, opt_state, loss) if order == "state_first" else (loss, (opt_state, params))
        step_fn = jax.jit(train_step) if jit else train_step
        losses = []
        for _ in range(steps):
            idx = rng.integers(0, N, 64)
            key, sub = jax.random.split(key)
            out = step_fn(params, opt_state, X[idx], Y[idx], sub)
            if order == "state_first":
                params, opt_state, loss = out
            else:
                loss, (opt_state, params) = out
            losses.append(float(loss))
    return drv, losses, params


def _warning(drv):
    ws = [e for e in drv.report.events if e.is_warning]
    assert ws, "no early warning"
    return ws[0]


def _passed(cause):
    return [t for t in cause.get("tested_fixes") or [] if t.get("passed")]


@pytest.mark.parametrize("order", ["state_first", "loss_first"])
def test_a_warning_cut_is_tested_on_its_call_and_the_run_trains_on_untouched(order):
    drv, losses, params = _loop(0.07, order=order)
    c = _warning(drv).cause
    assert c["category"] == "lr_too_high", c["summary"]
    ok = _passed(c)
    assert ok and ok[0]["text"].startswith("lr 0.07 -> "), (c.get("tested_fixes"), c["evidence"].get("experiments"))
    e = next(x for x in c["evidence"]["experiments"] if x["kind"] == "lr_replay")
    assert e["replays"] == 8 and e["details"]["losses"][1] < e["details"]["losses"][0]
    assert _warning(drv).fixes[0].startswith("lower the learning rate from 0.07 to ")
    drv2, losses2, params2 = _loop(0.07, test_fixes=False, order=order)
    assert not _passed(_warning(drv2).cause)
    assert np.array(losses).tobytes() == np.array(losses2).tobytes()
    for k in params:
        assert np.asarray(params[k]).tobytes() == np.asarray(params2[k]).tobytes(), k


def test_an_eager_update_says_why_its_fix_is_untested():
    drv, _, _ = _loop(0.07, jit=False)
    c = _warning(drv).cause
    assert not _passed(c)
    assert "no call to replay" in c["evidence"]["experiments_unavailable_why"]["lr_replay"]


def test_a_healthy_run_warns_not_and_loads_no_replay():
    sys.modules.pop("nanguard.jax.warn_fix", None)
    drv, losses, _ = _loop(0.003, steps=30)
    assert not [e for e in drv.report.events if e.is_warning] and np.isfinite(losses).all()
    assert "nanguard.jax.warn_fix" not in sys.modules


def _nnx_loop(test_fixes):
    """A Flax NNX model (dropout drawing from its own Rngs) trained through ``nnx.jit`` and ``nnx.Optimizer``:
    the jitted call is the inner one on the split states, under NNX's update context."""
    nnx = pytest.importorskip("flax.nnx")
    rng = np.random.default_rng(1)
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        drv.spikes.test_fixes = test_fixes

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.drop, self.lin = nnx.Dropout(0.1, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)

            def __call__(self, x):
                return self.lin(self.drop(x))[:, 0]
        model = Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.07), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, xb, yb):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(xb) - yb) ** 2))(model)
            opt.update(model, grads)
            return loss
        losses = [float(step(model, opt, X[i], Y[i])) for i in (rng.integers(0, N, 64) for _ in range(12))]
    return drv, losses, nnx.state(model, nnx.Param)


def test_an_nnx_step_is_replayed_under_its_update_context_and_trains_on_untouched():
    drv, losses, state = _nnx_loop(True)
    c = _warning(drv).cause
    assert _passed(c) and _passed(c)[0]["text"].startswith("lr 0.07 -> "), c.get("tested_fixes")
    drv2, losses2, state2 = _nnx_loop(False)
    assert np.array(losses).tobytes() == np.array(losses2).tobytes()
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(state2)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
