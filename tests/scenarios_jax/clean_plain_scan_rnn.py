# Sensor sequence regression with a hand-written Elman RNN unrolled by lax.scan (plain JAX +
# optax SGD, jitted step) at its intended learning rate 3.2e-3.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

LR = 3.2e-3
rng = np.random.default_rng(7)
n, t, d, hdim = 1024, 20, 4, 32
xs = rng.normal(0, 1, (n, t, d)).astype(np.float32)
ys = (xs[:, :, 0].cumsum(1)[:, -1] * 0.3 + xs[:, -1, 1]).astype(np.float32)

k = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"wx": jax.random.normal(k[0], (d, hdim)) / np.sqrt(d),
          "wh": jax.random.normal(k[1], (hdim, hdim)) / np.sqrt(hdim),
          "b": jnp.zeros(hdim),
          "wo": jax.random.normal(k[2], (hdim,)) / np.sqrt(hdim)}
tx = optax.sgd(LR)
opt_state = tx.init(params)


def forward(params, xb):
    def cell(h, x_t):
        h = jnp.tanh(x_t @ params["wx"] + h @ params["wh"] + params["b"])
        return h, None
    h0 = jnp.zeros((xb.shape[0], hdim))
    h, _ = lax.scan(cell, h0, jnp.swapaxes(xb, 0, 1))
    return h @ params["wo"]


@jax.jit
def train_step(params, opt_state, xb, yb):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((forward(p, xb) - yb) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


losses = []
for step in range(32):
    sl = slice(step * 32, (step + 1) * 32)
    params, opt_state, loss = train_step(params, opt_state, xs[sl], ys[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
