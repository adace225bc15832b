"""The kernels the check adds to a compiled jitted step do not grow with the number of leaves (issue 27):
a group's small leaves (gradients, parameters, new parameters and optimizer state) are read by one
joined reduction (``check.fenced``), not by one to three kernels per leaf (on CPU: a square, a reduce-window and
a reduce each), which cost the benchmark transformer ~336 added kernels for 107 leaves (now 24).
Counted on XLA's compiled HLO: the entry computation's instructions other than parameters, constants,
tuples and bitcasts."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402
from nanguard.jax import hooks  # noqa: E402

FREE = ("parameter(", "constant(", "get-tuple-element(", " tuple(", " bitcast(")


def _kernels(fun, args) -> int:
    txt = hooks._ORIG.get("jit", jax.jit)(fun).lower(*args).compile().as_text()
    entry = txt[txt.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    return sum(1 for ln in entry.splitlines()[1:] if " = " in ln and not any(f in ln for f in FREE))


def _setup(layers: int):
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    params = [{"w": jax.random.normal(k, (24, 24)) * 0.2, "b": jnp.zeros(24)} for k in keys]
    tx = optax.adam(1e-3)

    def loss_fn(p, x):
        for layer in p:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return jnp.mean(x ** 2)

    def step(p, s, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss
    x = np.random.default_rng(0).normal(size=(8, 24)).astype(np.float32)
    return step, (params, tx.init(params), x)


def _added(layers: int) -> int:
    step, args = _setup(layers)
    plain = _kernels(step, args)
    with ngjax.watch(report=None, quiet=True):
        step, args = _setup(layers)
        guarded = _kernels(hooks._instrumented(step), args)
    return guarded - plain


def test_the_added_kernels_do_not_grow_with_the_leaves():
    few, many = _added(2), _added(6)  # 4 and 12 parameter leaves (each with Adam's two moments)
    assert 0 < few <= 32, few  # measured: 23 (the old check: 26, and 66 for 6 layers)
    assert many <= few + 2, (few, many)  # per leaf, the old check added ~3 per leaf and group
