# Trajectory smoothing: penalise the step length between consecutive predicted points,
# where many consecutive points coincide (parked vehicles). Equinox, optax Adam,
# eqx.filter_jit; the norm uses the double-where trick, so its gradient at 0 is 0.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import equinox as eqx

rng = np.random.default_rng(10)
n, t = 512, 16
tracks = np.cumsum(rng.normal(size=(n, t, 2)) * (rng.random((n, t, 1)) < 0.5), axis=1).astype(np.float32)

model = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
tx = optax.adam(1e-2)
opt_state = tx.init(eqx.filter(model, eqx.is_array))


def safe_norm(v):
    sq = jnp.sum(v ** 2, axis=-1)
    nonzero = sq > 0
    return jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, sq, 1.0)), 0.0)


@eqx.filter_jit
def train_step(model, opt_state, xb):
    def loss_fn(model):
        pred = jax.vmap(jax.vmap(model))(xb)
        fit = jnp.mean((pred - xb) ** 2)
        length = jnp.mean(safe_norm(pred[:, 1:] - pred[:, :-1]))
        return fit + 0.1 * length
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


losses = []
for step in range(50):
    idx = rng.integers(0, n, 32)
    model, opt_state, loss = train_step(model, opt_state, tracks[idx])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
