"""The script's own processing of the gradients between ``jax.grad`` and the optax update (per-example
normalization in a DP-SGD step) is the backward phase, as the gradients the update is given: the guard's
optax hook marks the update in the replay's trace (``check.UPDATE_SCOPE``), so a division by a zero
per-example norm there is div_by_zero at its line, not the optimizer's numerics."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_helpers  # noqa: E402
import nanguard.jax as ngjax  # noqa: E402
from nanguard.core.events import NonFiniteError  # noqa: E402

HERE = __file__


def hinge(p, xi, yi):
    return jnp.maximum(0.0, 1.0 - yi * (xi @ p["w"] + p["b"]))


def test_a_zero_per_example_gradient_normalized_is_a_backward_division_by_zero():
    x = np.asarray([[0.5, -0.2], [4.0, 4.0], [0.1, 0.3]], np.float32)
    y = np.asarray([1.0, 1.0, -1.0], np.float32)   # row 1 is beyond the margin: its hinge gradient is 0
    with pytest.raises(NonFiniteError):
        with ngjax.watch(report=None, quiet=True, user_files=[HERE]) as drv:
            tx = optax.sgd(0.1)

            @jax.jit
            def step(p, s, xb, yb):
                loss = jnp.mean(jax.vmap(hinge, (None, 0, 0))(p, xb, yb))
                per_ex = jax.vmap(jax.grad(hinge), (None, 0, 0))(p, xb, yb)
                norms = jnp.sqrt(per_ex["w"].sum(1) ** 2 + per_ex["b"] ** 2)
                g = {k: (v / norms.reshape((-1,) + (1,) * (v.ndim - 1))).mean(0)   # per-example-norm
                     for k, v in per_ex.items()}
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s, loss
            p = {"w": jnp.ones(2), "b": jnp.zeros(())}
            s = tx.init(p)
            for _ in range(3):
                p, s, loss = step(p, s, x, y)
                float(loss)
    ev = [e for e in drv.report.events if not e.is_warning][0]
    assert ev.step == 0 and ev.phase == "backward", (ev.step, ev.phase)
    assert ev.origin["line"] == jax_helpers.line_of(HERE, "per-example-norm")
    assert ev.cause["category"] == "div_by_zero", ev.cause["summary"]
