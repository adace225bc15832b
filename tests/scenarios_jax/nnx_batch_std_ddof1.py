# Wine-quality regression: 11 physico-chemical measurements per wine, standardised
# per mini-batch inside the model (sample standard deviation, ddof=1) before a small
# Flax NNX MLP. Adam, nnx.jit. The loader keeps the last, incomplete batch.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

rng = np.random.default_rng(5)
n, d = 641, 11
feats = (rng.normal(size=(n, d)) * rng.uniform(0.5, 20.0, d) + rng.uniform(0, 50, d)).astype(np.float32)
quality = (5.5 + 0.8 * np.tanh((feats[:, 0] - feats[:, 0].mean()) / feats[:, 0].std())).astype(np.float32)


class QualityNet(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(d, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        z = (x - x.mean(0)) / jnp.std(x, axis=0, ddof=1)
        return self.out(nnx.relu(self.hidden(z)))[:, 0]


model = QualityNet(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, xb, yb):
    def loss_fn(model):
        return jnp.mean((model(xb) - yb) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


batch = 64
losses = []
for step in range(14):
    start = (step % 11) * batch  # 10 full batches, then the last one: 641 = 10 * 64 + 1
    xb, yb = feats[start:start + batch], quality[start:start + batch]
    loss = train_step(model, optimizer, jnp.asarray(xb), jnp.asarray(yb))
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
