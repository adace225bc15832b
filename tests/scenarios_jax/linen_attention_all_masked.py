# Support-ticket routing (4 queues) from the ticket's word ids. Flax Linen: embeddings,
# attention pooling with padding positions masked to -inf, linear head; TrainState
# and Adam, jitted. The ticket log also holds tickets whose text was removed (no words).
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from flax.training import train_state

rng = np.random.default_rng(5)
n, max_len, vocab, queues = 1500, 12, 250, 4
lengths = rng.integers(1, max_len + 1, n)
lengths[rng.integers(0, n, 3)] = 0  # tickets whose text was removed
words = rng.integers(1, vocab, (n, max_len))
words[np.arange(max_len)[None, :] >= lengths[:, None]] = 0
queue = (words[:, 0] % queues).astype(np.int32)


class Router(nn.Module):
    @nn.compact
    def __call__(self, words):
        h = nn.Embed(vocab, 24)(words)
        scores = nn.Dense(1)(jnp.tanh(nn.Dense(24)(h)))[..., 0]
        scores = jnp.where(words > 0, scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)
        pooled = jnp.einsum("bt,btd->bd", weights, h)
        return nn.Dense(queues)(pooled)


model = Router()
params = model.init(jax.random.PRNGKey(0), jnp.asarray(words[:2]))["params"]
state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


@jax.jit
def train_step(state, wb, yb):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, wb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


losses = []
for step in range(60):
    idx = rng.integers(0, n, 48)
    state, loss = train_step(state, jnp.asarray(words[idx]), jnp.asarray(queue[idx]))
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
