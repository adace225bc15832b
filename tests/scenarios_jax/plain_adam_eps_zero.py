# Demand model with a per-store bias table; stores absent from the training window never
# get a gradient. Plain JAX + optax: Adam configured with eps=0, jitted step.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(7)
n, d, stores = 2000, 6, 10
x = rng.normal(size=(n, d)).astype(np.float32)
store = rng.integers(0, stores - 2, n)  # stores 8 and 9 have no rows in this window
demand = (x @ rng.normal(size=d) + 0.3 * store).astype(np.float32)

params = {"w": jnp.zeros(d), "bias": jnp.zeros(stores)}
tx = optax.adam(1e-2, eps=0.0)
opt_state = tx.init(params)


def loss_fn(params, xb, sb, yb):
    pred = xb @ params["w"] + params["bias"][sb]
    return jnp.mean((pred - yb) ** 2)


@jax.jit
def train_step(params, opt_state, xb, sb, yb):
    loss, grads = jax.value_and_grad(loss_fn)(params, xb, sb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


losses = []
for step in range(30):
    idx = rng.integers(0, n, 64)
    params, opt_state, loss = train_step(params, opt_state, x[idx], store[idx], demand[idx])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
