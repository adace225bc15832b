# Click-through prediction: a logistic model on 20 hashed session features, trained
# in float16 end to end (weights, features, loss) with a hand-written binary
# cross-entropy that adds 1e-8 inside the logs. Plain JAX + optax SGD, jitted step.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(12)
n, d = 4000, 20
x = rng.normal(size=(n, d)).astype(np.float16)
w_true = rng.normal(size=d) * 1.5
clicked = (x.astype(np.float32) @ w_true > 0).astype(np.float16)  # separable: confidence keeps growing

params = {"w": jnp.zeros(d, jnp.float16), "b": jnp.zeros((), jnp.float16)}
tx = optax.sgd(0.5)
opt_state = tx.init(params)


def bce(params, xb, yb):
    p = jax.nn.sigmoid(xb @ params["w"] + params["b"])
    return -jnp.mean(yb * jnp.log(p + 1e-8) + (1 - yb) * jnp.log(1 - p + 1e-8))


@jax.jit
def train_step(params, opt_state, xb, yb):
    loss, grads = jax.value_and_grad(bce)(params, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


batch = 64
losses = []
for step in range(50):
    sl = slice(step * batch, (step + 1) * batch)
    params, opt_state, loss = train_step(params, opt_state, x[sl], clicked[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
