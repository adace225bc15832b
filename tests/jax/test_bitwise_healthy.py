"""A guarded healthy jitted step computes the user's values bit for bit like the plain one (issue 27), for
several optimizers and model shapes: optax alone (Adam, AdamW, SGD with momentum, a chain with a clip),
Flax NNX (``nnx.Optimizer``), Equinox and a small NNX transformer. Each loop runs a few steps plain, then
the same inside ``nanguard.jax.watch``; every parameter and optimizer-state leaf must be equal.

Before the check read its values through ``check.fenced`` (flat, behind an optimization barrier), XLA's
simplifier merged the check's reads with the step's own arithmetic (a transposed gradient kept in its
2-D shape for the check's extra read, a square shared with Adam's second moment), and LLVM then
contracted the moment updates into FMAs the other way round: a 1-ulp drift from the second step on."""
from __future__ import annotations

from typing import Any, Callable, Tuple

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402

STEPS = 5


def _data(n: int = 8, d: int = 16) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, 1)).astype(np.float32)


def _leaves(tree: Any) -> list:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")]


def _same(run: Callable[[], Any], recover: Any = None, steps: int = STEPS) -> None:
    """``run()`` (build the loop, train the steps, return the final state and the losses) plain and
    guarded (``recover``: with recovery on, whose check gates the update): equal bits."""
    plain = _leaves(run())
    with ngjax.watch(report=None, quiet=True, recover=recover) as w:
        guarded = _leaves(run())
    assert w.steps == steps, w.steps  # the check ran in every step
    assert len(plain) == len(guarded)
    bad = [i for i, (a, b) in enumerate(zip(plain, guarded)) if not np.array_equal(a, b)]
    assert not bad, f"{len(bad)} of {len(plain)} leaves differ (first: #{bad[0]}, shape {plain[bad[0]].shape})"


# --------------------------------------------------------------------------- optax on a plain-JAX MLP

def _mlp_params(d: int = 16, hidden: int = 64, scale: float = 1.0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (d, hidden)) * scale, "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 1)) * scale, "b2": jnp.zeros(1)}


def _mlp_loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)


OPTAX = {  # plain Adam, applied by optax or by hand: tests/jax/test_update_fused.py
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "chain_clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
}


def _optax_loop(make_tx: Callable[[], Any], x: np.ndarray, y: np.ndarray, d: int, hidden: int, scale: float,
                steps: int = STEPS) -> Callable[[], Any]:
    """A jitted optax MLP loop of ``steps`` steps (build, train, return the final state and the losses)."""
    def run():
        tx = make_tx()
        p = _mlp_params(d, hidden, scale=scale)
        s = tx.init(p)

        @jax.jit
        def step(p, s, x, y):
            loss, g = jax.value_and_grad(_mlp_loss)(p, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss
        losses = []
        for _ in range(steps):
            p, s, loss = step(p, s, x, y)
            losses.append(loss)
        return p, s, losses
    return run


@pytest.mark.parametrize("recover", [None, "auto"], ids=["plain", "recover"])
@pytest.mark.parametrize("opt,d,hidden", [(k, 16, 64) for k in sorted(OPTAX)] + [("adamw", 256, 512)],
                         ids=sorted(OPTAX) + ["adamw_large_leaf"])
def test_optax_mlp(opt, d, hidden, recover):
    """``adamw_large_leaf``: a 256x512 weight, over ``check.SMALL``, is read in place, not joined."""
    x, y = _data(d=d)
    _same(_optax_loop(OPTAX[opt], x, y, d, hidden, 1.0 if d == 16 else 0.05), recover)


def test_recovery_gate_keeps_a_nesterov_step_bit_for_bit():
    """Recovery's gate was computed inside the update (it read the update itself): XLA then built the
    update apart from the parameters' new values, and a Flax-like SGD-Nesterov run drifted 1 ulp from the
    plain one within 20 steps. The gate reads the new parameters, as the plain check does."""
    x, y = _data(n=64)
    run = _optax_loop(lambda: optax.sgd(0.02, momentum=0.9, nesterov=True), x, y, 16, 64, 0.5, steps=40)
    losses = run()[2]
    assert all(np.isfinite(np.asarray(losses))) and float(losses[-1]) < float(losses[0]), losses  # a healthy run
    _same(run, "auto", steps=40)


# --------------------------------------------------------------------------- Flax NNX

def test_nnx_optimizer():
    nnx = pytest.importorskip("flax.nnx")
    x, y = _data()

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 48, rngs=rngs)
            self.l2 = nnx.Linear(48, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    def run():
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, x, y):
            loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            opt.update(model, g)
            return loss
        losses = [step(model, opt, x, y) for _ in range(STEPS)]
        return nnx.state(model), nnx.state(opt), losses
    _same(run)
    _same(run, "auto")


@pytest.mark.slow  # ~15 s of CPU; equal on the old code too (a guard against a regression)
def test_nnx_small_transformer():
    nnx = pytest.importorskip("flax.nnx")
    from benchmarks.jax_overhead import nnx_encoder  # the benchmark's model, smaller
    rng = np.random.default_rng(1)
    vocab, d, batch, seq = 50, 32, 8, 8
    toks = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    ys = rng.integers(0, 4, (batch,)).astype(np.int32)

    def run():
        model = nnx_encoder(vocab, d, heads=2, blocks=1, classes=4, ff=2)
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, t, yb):
            def loss_fn(m):
                return optax.softmax_cross_entropy_with_integer_labels(m(t), yb).mean()
            loss, g = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, g)
            return loss
        losses = [step(model, opt, toks, ys) for _ in range(STEPS)]
        return nnx.state(model), nnx.state(opt), losses
    _same(run)


# --------------------------------------------------------------------------- Equinox

def test_equinox_mlp():
    eqx = pytest.importorskip("equinox")
    x, y = _data()

    def run():
        model = eqx.nn.MLP(16, 1, 32, 2, key=jax.random.PRNGKey(0))
        tx = optax.adam(1e-2)
        s = tx.init(eqx.filter(model, eqx.is_array))

        @eqx.filter_jit
        def step(model, s, x, y):
            loss, g = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
            u, s = tx.update(g, s, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, u), s, loss
        losses = []
        for _ in range(STEPS):
            model, s, loss = step(model, s, x, y)
            losses.append(loss)
        return eqx.filter(model, eqx.is_array), s, losses
    _same(run)


# --------------------------------------------------------------------------- an epoch in one lax.scan

def test_updates_inside_a_lax_scan_epoch():
    """flax/optax examples' shape: one jitted call scans an epoch of steps (SGD with momentum on a step schedule,
    a relu MLP as a dict). The update of a scan step was checked by reading the update itself (reported by
    callback), which XLA then built apart from the new parameters: the guarded losses differed in the last digit
    at step 59, and a divergence reached inf 47 steps later than the plain run. The check reads the parameters
    apply_updates makes, as in a jitted step."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(4096, 4)).astype(np.float32)
    y = (x @ np.array([-0.9, -0.3, 0.1, -0.2], np.float32) + 0.2 * rng.normal(size=4096)).astype(np.float32)
    per = 64

    def run():
        tx = optax.sgd(optax.piecewise_constant_schedule(0.02, {4 * per: 10.0}), momentum=0.9)
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
        p = {"w1": jax.random.normal(k1, (4, 64)) * jnp.sqrt(0.5), "b1": jnp.zeros(64),
             "w2": jax.random.normal(k2, (64, 64)) * jnp.sqrt(2.0 / 64), "b2": jnp.zeros(64),
             "w3": jax.random.normal(k3, (64, 1)) * jnp.sqrt(1.0 / 64), "b3": jnp.zeros(1)}
        s = tx.init(p)

        def loss_fn(p, xb, yb):
            h = jax.nn.relu(xb @ p["w1"] + p["b1"])
            h = jax.nn.relu(h @ p["w2"] + p["b2"])
            return jnp.mean(((h @ p["w3"] + p["b3"])[:, 0] - yb) ** 2)

        @jax.jit
        def epoch(p, s, xs, ys):
            def body(carry, batch):
                p, s = carry
                loss, g = jax.value_and_grad(loss_fn)(p, *batch)
                u, s = tx.update(g, s, p)
                return (optax.apply_updates(p, u), s), loss
            (p, s), losses = jax.lax.scan(body, (p, s), (xs, ys))
            return p, s, losses
        out = []
        for e in range(2):
            perm = np.random.default_rng(e).permutation(4096)
            p, s, losses = epoch(p, s, x[perm].reshape(per, 64, 4), y[perm].reshape(per, 64))
            out.append(losses)
        return p, s, out
    _same(run, steps=2 * per)
