"""The check of a jitted step reads the parameters ``optax.apply_updates`` / ``eqx.apply_updates`` produced in
place of the update (issue 27: read apart, the update is computed in kernels of its own, two per leaf on
CPU, ~80 of the 420 kernels the check added to the benchmark transformer); detection stays the same."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402
from nanguard.core.events import NonFiniteError  # noqa: E402
from nanguard.jax import hooks  # noqa: E402


def _params():
    k = jax.random.PRNGKey(0)
    return {"w1": jax.random.normal(k, (16, 64)), "b1": jnp.zeros(64), "w2": jax.random.normal(k, (64, 1)),
            "b2": jnp.zeros(1)}


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)


def _make(tx, apply):
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return apply(p, u), s, loss
    return step


def _by_hand(p, u):
    return jax.tree_util.tree_map(lambda a, b: a + b, p, u)


def _entry_ops(fun, args):
    txt = jax.jit(fun).lower(*args).compile().as_text()
    entry = txt[txt.index("\nENTRY"):]
    return sum(1 for ln in entry.splitlines()[1:] if " = " in ln)


def _pending_of(step, args):
    """The _Pending entries a trace of the guarded step leaves (read after the trace ends)."""
    seen = []
    orig = hooks._vector

    def spy(f):
        seen.append(f)
        return orig(f)
    hooks._vector = spy
    try:
        jax.make_jaxpr(hooks._instrumented(step))(*args)
    finally:
        hooks._vector = orig
    return [f for f in seen if isinstance(f, hooks._Pending)]


def test_the_check_reads_the_applied_parameters_and_the_step_compiles_smaller():
    x, y = jnp.ones((8, 16)), jnp.ones((8, 1))
    with ngjax.watch(report=None, quiet=True):
        tx = optax.adam(1e-3)
        p = _params()
        args = (p, tx.init(p), x, y)
        fused = _pending_of(_make(tx, optax.apply_updates), args)
        apart = _pending_of(_make(tx, _by_hand), args)
        assert len(fused) == len(apart) == 1
        assert fused[0].applied is not None and apart[0].applied is None  # by hand: the update is read
        n_fused = _entry_ops(hooks._instrumented(_make(tx, optax.apply_updates)), args)
        n_apart = _entry_ops(hooks._instrumented(_make(tx, _by_hand)), args)
    assert n_fused < n_apart, (n_fused, n_apart)


@pytest.mark.parametrize("apply", ["optax", "by_hand", "equinox"])
def test_a_non_finite_update_with_finite_state_is_the_optimizer_phase(apply):
    """Adam with eps=0 on a parameter whose gradient is exactly zero: 0/0 in the update, the state finite."""
    if apply == "equinox":
        eqx = pytest.importorskip("equinox")
    x, y = jnp.ones((8, 16)), jnp.ones((8, 1))
    with pytest.raises(NonFiniteError) as ei:
        with ngjax.watch(report=None, quiet=True, localize=False):
            fn = {"optax": lambda: optax.apply_updates, "by_hand": lambda: _by_hand,
                  "equinox": lambda: eqx.apply_updates}[apply]()
            tx = optax.adam(1e-3, eps=0.0)
            p = dict(_params(), unused=jnp.ones(3))  # no gradient reaches it: 0/0 at step 0
            s = tx.init(p)
            step = jax.jit(_make(tx, lambda a, b: fn(a, b)))
            for _ in range(3):
                p, s, loss = step(p, s, x, y)
                float(loss)
    ev = ei.value.report.first
    assert (ev.step, ev.phase) == (0, "optimizer"), (ev.step, ev.phase)


@pytest.mark.parametrize("apply", [optax.apply_updates, _by_hand], ids=["optax", "by_hand"])
def test_a_healthy_guarded_step_matches_the_plain_one_bit_for_bit(apply):
    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    y = np.ones((8, 1), np.float32)

    def run():
        tx = optax.adam(1e-2)
        p = _params()
        s = tx.init(p)
        step = jax.jit(_make(tx, apply))
        for _ in range(5):
            p, s, loss = step(p, s, x, y)
        return p
    plain = run()
    with ngjax.watch(report=None, quiet=True) as w:
        guarded = run()
    assert w.steps == 5
    for k in plain:
        assert np.array_equal(np.asarray(plain[k]), np.asarray(guarded[k])), k
