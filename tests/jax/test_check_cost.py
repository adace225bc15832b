"""What the in-graph check adds to a jitted step, counted on the jaxpr: one conditional per optax update
(its exact pass runs only when a sum is not finite) and a few equations per float leaf (each leaf of the
gradients, the parameters, the update and the new optimizer state flattened into its group's joined
vector, one reduction per group), nothing else."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402
from nanguard.jax import hooks  # noqa: E402


def _count(jaxpr):
    """(equations, conds) of a jaxpr, the bodies of calls included (a cond's branches are not walked)."""
    n = conds = 0
    for e in jaxpr.eqns:
        n += 1
        conds += e.primitive.name == "cond"
        for v in e.params.values():
            sub = getattr(v, "jaxpr", None)
            if sub is not None and e.primitive.name != "cond":
                a, b = _count(sub)
                n, conds = n + a, conds + b
    return n, conds


def _step():
    tx = optax.adam(1e-3)
    k = jax.random.PRNGKey(0)
    params = {"w1": jax.random.normal(k, (16, 64)), "b1": jnp.zeros(64), "w2": jax.random.normal(k, (64, 1)),
              "b2": jnp.zeros(1)}

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss
    return step, (params, tx.init(params), jnp.ones((8, 16)), jnp.ones((8, 1)))


def test_the_check_adds_one_conditional_and_a_few_equations_per_leaf():
    step, args = _step()
    plain = _count(jax.make_jaxpr(step)(*args).jaxpr)
    with ngjax.watch(report=None, quiet=True):
        step, args = _step()
        guarded = _count(jax.make_jaxpr(hooks._instrumented(step))(*args).jaxpr)
    leaves = 4 + 2 * 4 + 1  # parameters, Adam's mu and nu, its count
    assert plain[1] == 0 and guarded[1] == 1, (plain, guarded)  # one cond for the three sums (was three)
    added = guarded[0] - plain[0]
    assert 0 < added <= 6 * leaves, added  # measured: 39 for 13 leaves (64 with a reduction per leaf)
