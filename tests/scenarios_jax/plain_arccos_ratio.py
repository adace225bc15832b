# Joint-angle regression for a robot arm: the angle is recovered with arccos from the
# cosine rule on measured link lengths; one calibration record has a link measured
# longer than the two others together. Plain JAX + optax Adam, jitted step.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(11)
n = 800
a = rng.uniform(1.0, 2.0, n).astype(np.float32)
b = rng.uniform(1.0, 2.0, n).astype(np.float32)
c = (np.abs(a - b) + rng.uniform(0.2, 0.8, n) * (a + b - np.abs(a - b))).astype(np.float32)
c[333] = a[333] + b[333] + 1.0  # a mis-measured link: the triangle cannot exist
target = np.arccos(np.clip((a ** 2 + b ** 2 - c ** 2) / (2 * a * b), -1, 1)).astype(np.float32)
feats = np.stack([a, b, c], 1)

params = {"scale": jnp.ones(3), "w": jnp.zeros(3)}
tx = optax.adam(1e-3)
opt_state = tx.init(params)


def loss_fn(params, fb, yb):
    s = fb * params["scale"]
    cos = (s[:, 0] ** 2 + s[:, 1] ** 2 - s[:, 2] ** 2) / (2 * s[:, 0] * s[:, 1])
    angle = jnp.arccos(cos) + fb @ params["w"] * 0.01
    return jnp.mean((angle - yb) ** 2)


@jax.jit
def train_step(params, opt_state, fb, yb):
    loss, grads = jax.value_and_grad(loss_fn)(params, fb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


losses = []
for step in range(40):
    sl = slice(step * 20, (step + 1) * 20)
    params, opt_state, loss = train_step(params, opt_state, feats[sl], target[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
