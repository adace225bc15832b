# Insurance claim counts with an exponential rate on raw (unscaled) exposure features.
# Plain JAX + optax SGD, the step is not jitted (eager). A policy with a huge sum
# insured arrives in a later batch.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(8)
n = 1000
exposure = np.stack([rng.uniform(0.1, 1.0, n), rng.uniform(0.5, 3.0, n)], 1).astype(np.float32)
exposure[640, 1] = 900.0  # a policy with a huge sum insured (units of 1e5)
claims = rng.poisson(np.exp(0.3 * exposure[:, 0] + 0.2 * np.minimum(exposure[:, 1], 3.0))).astype(np.float32)

params = {"w": jnp.array([0.3, 0.2]), "b": jnp.array(0.0)}
tx = optax.sgd(1e-2)
opt_state = tx.init(params)


def loss_fn(params, xb, yb):
    rate = jnp.exp(xb @ params["w"] + params["b"])
    return jnp.mean(rate - yb * jnp.log(rate + 1e-6))


losses = []
for step in range(40):
    sl = slice(step * 25, (step + 1) * 25)
    loss, grads = jax.value_and_grad(loss_fn)(params, exposure[sl], claims[sl])
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
