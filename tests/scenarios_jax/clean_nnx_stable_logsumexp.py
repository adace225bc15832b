# Next-event classification (8 event types) from 20 sensor features with large logits
# early in training. Flax NNX, SGD with momentum, nnx.jit; the loss uses
# jax.nn.log_softmax (stable), so large logits stay finite.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

rng = np.random.default_rng(9)
n, d, k = 2000, 20, 8
x = (rng.normal(size=(n, d)) * 30.0).astype(np.float32)
y = (np.abs(x[:, :k]).argmax(1)).astype(np.int32)


class Classifier(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(d, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, k, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


model = Classifier(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.sgd(1e-3, momentum=0.9), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, xb, yb):
    def loss_fn(model):
        logp = jax.nn.log_softmax(model(xb), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


losses = []
for step in range(60):
    idx = rng.integers(0, n, 64)
    loss = train_step(model, optimizer, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
