# Used-car price regression with a Flax NNX MLP computing in float16 (dtype=float16, float32
# parameters) to save memory; the squared error is taken on the float16 predictions. Prices are
# in thousands of dollars; a classic car listed at 400,000 dollars (400) arrives at step 7.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

rng = np.random.default_rng(12)
n = 1280
age = rng.uniform(0, 20, n)
km = rng.uniform(0, 250, n)
power = rng.uniform(60, 300, n)
x = np.stack([age / 10, km / 100, power / 100], 1).astype(np.float32)
price = (25 - 0.9 * age - 0.04 * km + 0.05 * power + rng.normal(0, 1, n)).clip(1, None).astype(np.float32)
price[7 * 32 + 5] = 400.0  # a classic car


class CarNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 64, dtype=jnp.float16, rngs=rngs)
        self.l2 = nnx.Linear(64, 1, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))[:, 0]


model = CarNet(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, xb, yb):
    def loss_fn(model):
        err = model(xb) - yb.astype(jnp.float16)
        return jnp.mean(err ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


losses = []
for step in range(30):
    sl = slice(step * 32, (step + 1) * 32)
    loss = train_step(model, optimizer, x[sl], price[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
