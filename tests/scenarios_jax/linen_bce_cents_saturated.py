# Churn prediction, Flax Linen + TrainState, Adam, jitted step. The binary cross-entropy is
# written by hand from the sigmoid probability; one customer's "monthly spend" was logged in
# cents instead of dollars, so its logit saturates the sigmoid to exactly 1.0 in float32.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from flax.training import train_state

rng = np.random.default_rng(4)
n = 1600
x = rng.normal(0, 1, (n, 8)).astype(np.float32)
x[:, 0] = rng.uniform(20, 120, n) / 100.0
churn = ((x[:, 1] - x[:, 2] + 0.5 * rng.normal(size=n)) > 0).astype(np.float32)
bad = 14 * 64 + 23
x[bad, 0] = 9600.0   # cents, not dollars
churn[bad] = 0.0


class ChurnNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32)(x))
        return nn.Dense(1)(h)[:, 0]


model = ChurnNet()
state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x[:2])["params"],
                                      tx=optax.adam(1e-3))


@jax.jit
def train_step(state, xb, yb):
    def loss_fn(params):
        p = jax.nn.sigmoid(state.apply_fn({"params": params}, xb))
        return -jnp.mean(yb * jnp.log(p) + (1 - yb) * jnp.log(1 - p))
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


losses = []
for step in range(25):
    sl = slice(step * 64, (step + 1) * 64)
    state, loss = train_step(state, x[sl], churn[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
