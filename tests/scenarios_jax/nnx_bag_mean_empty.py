# Review-text scoring: each review is a bag of up to 10 token embeddings (padding id 0);
# the model mean-pools the real tokens and regresses a star rating. Flax NNX, Adam,
# jitted with nnx.jit. The review export sometimes contains an empty review.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

rng = np.random.default_rng(4)
n, max_len, vocab = 1200, 10, 200
lengths = rng.integers(1, max_len + 1, n)
lengths[777] = 0  # an empty review in the export
tokens = rng.integers(1, vocab, (n, max_len))
tokens[np.arange(max_len)[None, :] >= lengths[:, None]] = 0
stars = (1.0 + 4.0 * (tokens[:, 0] % 7) / 6.0).astype(np.float32)
order = rng.permutation(n)


class BagRegressor(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(vocab, 16, rngs=rngs)
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, tok):
        mask = (tok > 0).astype(jnp.float32)
        summed = (self.embed(tok) * mask[..., None]).sum(1)
        pooled = summed / mask.sum(1, keepdims=True)
        return self.head(pooled)[:, 0]


model = BagRegressor(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, tb, yb):
    def loss_fn(model):
        return jnp.mean((model(tb) - yb) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


batch = 32
losses = []
for step in range(36):
    i = order[step * batch:(step + 1) * batch]
    loss = train_step(model, optimizer, jnp.asarray(tokens[i]), jnp.asarray(stars[i]))
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
