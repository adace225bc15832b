# Next-purchase prediction from a shopping session: the model averages the embeddings
# of the items viewed in the session (up to 12, padding id 0) and scores 50 product
# categories. Sessions with no viewed item are guarded with jnp.where so that their
# average is 0 instead of 0/0. Flax Linen + TrainState, Adam, jitted step.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from flax.training import train_state

rng = np.random.default_rng(8)
n, max_len, items, cats = 1500, 12, 400, 50
lengths = rng.integers(1, max_len + 1, n)
order = rng.permutation(n)
lengths[order[21 * 32 + 9]] = 0  # a session that ended before any item page was opened
views = rng.integers(1, items, (n, max_len))
views[np.arange(max_len)[None, :] >= lengths[:, None]] = 0
bought = (views[:, 0] % cats).astype(np.int32)


class SessionModel(nn.Module):
    @nn.compact
    def __call__(self, v):
        mask = (v > 0).astype(jnp.float32)
        summed = (nn.Embed(items, 32)(v) * mask[..., None]).sum(1)
        count = mask.sum(1, keepdims=True)
        pooled = jnp.where(count > 0, summed / count, 0.0)
        return nn.Dense(cats)(nn.relu(nn.Dense(64)(pooled)))


model = SessionModel()
params = model.init(jax.random.PRNGKey(0), views[:2])["params"]
state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


@jax.jit
def train_step(state, vb, yb):
    def loss_fn(p):
        logits = state.apply_fn({"params": p}, vb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


batch = 32
losses = []
for step in range(40):
    i = order[step * batch:(step + 1) * batch]
    state, loss = train_step(state, views[i], bought[i])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
