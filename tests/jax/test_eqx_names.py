"""Equinox under the driver: ``eqx.filter_jit`` hands its inner jit flat lists of arrays (``"first"``,
``"rest"``) and the structure in a static argument; the driver combines them again, so the replay's
leaves carry the step's own paths (``args[0].layers[1].weight``) and an origin's module is read from them."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
eqx = pytest.importorskip("equinox")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402
import jax_helpers  # noqa: E402


class Net(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(3, 3, key=k1), eqx.nn.Linear(3, 1, key=k2)]

    def __call__(self, x):
        h = jnp.log(jnp.square(self.layers[0](x)))   # eqx-log
        return self.layers[1](h)[0]


def test_filter_jit_leaves_are_named_by_their_paths_and_the_origin_by_its_module():
    model = eqx.tree_at(lambda m: m.layers[0].bias, Net(jax.random.PRNGKey(0)), jnp.zeros(3))
    x = np.ones((4, 3), np.float32)
    x[2] = 0.0   # lin(0) = bias = 0 -> log(0)
    y = np.zeros(4, np.float32)
    with pytest.raises(Exception):
        with ngjax.watch(report=None, quiet=True) as drv:
            tx = optax.sgd(1e-2)
            opt_state = tx.init(eqx.filter(model, eqx.is_array))

            @eqx.filter_jit
            def step(model, opt_state, xb, yb):
                def loss_fn(m):
                    return jnp.mean((jax.vmap(m)(xb) - yb) ** 2)
                loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
                updates, opt_state = tx.update(grads, opt_state)
                return eqx.apply_updates(model, updates), opt_state, loss
            for _ in range(3):
                model, opt_state, loss = step(model, opt_state, x, y)
    _, _, names = drv.calls[0].pure()
    got = sorted(v["name"] for v in names.values())
    assert "args[0].layers[0].weight" in got and "args[0].layers[1].bias" in got, got
    assert not any("'rest'" in n or "'first'" in n for n in got), got
    o = drv.report.first.origin
    assert o["line"] == jax_helpers.line_of(__file__, "eqx-log") and o["module"] == "", o
