# Product-review sentiment classifier in Flax NNX: word ids -> embedding ->
# masked mean over the review -> MLP -> 2 classes. Word ids are given by
# frequency rank, starting at 1; id 0 is padding.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import collections
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

rng = np.random.default_rng(7)
n_words, n_reviews, max_len = 1500, 4000, 24
ranks = np.arange(1, n_words + 1)
zipf = 1.0 / ranks ** 1.3
zipf /= zipf.sum()
polarity = rng.normal(size=n_words) * (ranks < 200)
reviews, labels = [], []
for _ in range(n_reviews):
    length = rng.integers(4, max_len + 1)
    words = rng.choice(n_words, size=length, p=zipf)
    reviews.append([f"w{w}" for w in words])
    labels.append(int(polarity[words].sum() > 0))

counts = collections.Counter(w for r in reviews for w in r)
vocab = {w: i + 1 for i, (w, c) in enumerate(counts.most_common())}


def encode(words):
    ids = [vocab[w] for w in words][:max_len]
    return ids + [0] * (max_len - len(ids))


tokens = np.array([encode(r) for r in reviews], np.int32)
labels = np.array(labels, np.int32)
order = rng.permutation(n_reviews)


class ReviewClassifier(nnx.Module):
    def __init__(self, vocab_size, rngs):
        self.embed = nnx.Embed(vocab_size, 32, rngs=rngs)
        self.hidden = nnx.Linear(32, 64, rngs=rngs)
        self.out = nnx.Linear(64, 2, rngs=rngs)

    def __call__(self, ids):
        mask = (ids > 0).astype(jnp.float32)[..., None]
        e = self.embed(ids)
        pooled = (e * mask).sum(1) / mask.sum(1)
        return self.out(nnx.relu(self.hidden(pooled)))


model = ReviewClassifier(len(vocab), nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adamw(2e-3, weight_decay=1e-4), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, xb, yb):
    def loss_fn(model):
        logits = model(xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


batch = 32
losses = []
for step in range(120):
    i = order[step * batch:(step + 1) * batch]
    loss = train_step(model, optimizer, jnp.asarray(tokens[i]), jnp.asarray(labels[i]))
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
