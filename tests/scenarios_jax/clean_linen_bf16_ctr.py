# Click-through prediction with a Flax Linen model whose parameters and compute are bfloat16
# (param_dtype and dtype), TrainState + Adam, jitted step. The loss is optax's sigmoid binary
# cross-entropy on the logits (stable in bfloat16).
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from flax.training import train_state

rng = np.random.default_rng(13)
n, d = 2400, 12
x = rng.normal(0, 1, (n, d)).astype(np.float32)
w_true = rng.normal(0, 1.5, d)
click = (x @ w_true > 0).astype(np.float32)


class CTRNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x))
        return nn.Dense(1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(h)[:, 0]


model = CTRNet()
state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x[:2])["params"],
                                      tx=optax.adam(1e-2))


@jax.jit
def train_step(state, xb, yb):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, xb)
        return optax.sigmoid_binary_cross_entropy(logits, yb).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


losses = []
for step in range(36):
    sl = slice(step * 64, (step + 1) * 64)
    state, loss = train_step(state, x[sl], click[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
