# Intent classification over short queries with word vectors computed from a
# co-occurrence table (each word's vector is the mean of its context rows); the
# vectors initialise an NNX embedding that is fine-tuned. Flax NNX, Adam, nnx.jit.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

rng = np.random.default_rng(21)
vocab, dim, n, length, classes = 300, 24, 1500, 8, 5
contexts = rng.normal(size=(vocab, 40, dim)).astype(np.float32)
seen = rng.random((vocab, 40)) < 0.5
seen[173] = False  # a word that never occurs in the co-occurrence corpus
with np.errstate(invalid="ignore"):
    vectors = (contexts * seen[..., None]).sum(1) / seen.sum(1)[:, None]
queries = rng.integers(0, vocab, (n, length))
intent = (queries[:, 0] % classes).astype(np.int32)


class IntentNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.embed.embedding.value = jnp.asarray(vectors)
        self.head = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, q):
        return self.head(self.embed(q).mean(1))


model = IntentNet(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, qb, yb):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(qb), yb).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


batch = 50
losses = []
for step in range(30):
    sl = slice(step * batch, (step + 1) * batch)
    loss = train_step(model, optimizer, jnp.asarray(queries[sl]), jnp.asarray(intent[sl]))
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
