# Differentially private linear SVM (spam filter), plain JAX + optax: per-example gradients with
# jax.vmap(jax.grad(...)), each clipped to norm C (DP-SGD), summed, then
# Gaussian noise. With the hinge loss an example beyond the margin has a gradient of exactly 0,
# and is left as it is by the clip.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(10)
n, d = 2560, 20
x = rng.normal(0, 1, (n, d)).astype(np.float32)
w_true = rng.normal(0, 1, d).astype(np.float32)
y = np.sign(x @ w_true + 0.3 * rng.normal(size=n)).astype(np.float32)
C, SIGMA, B = 1.0, 0.5, 64

params = {"w": jnp.zeros(d), "b": jnp.zeros(())}
tx = optax.sgd(0.05)
opt_state = tx.init(params)


def hinge(params, xi, yi):
    return jnp.maximum(0.0, 1.0 - yi * (xi @ params["w"] + params["b"]))


@jax.jit
def train_step(params, opt_state, xb, yb, key):
    loss = jnp.mean(jax.vmap(hinge, (None, 0, 0))(params, xb, yb))
    per_ex = jax.vmap(jax.grad(hinge), (None, 0, 0))(params, xb, yb)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(B, -1) ** 2, 1) for g in jax.tree_util.tree_leaves(per_ex)))
    clipped = jax.tree_util.tree_map(lambda g: g / jnp.maximum(1.0, norms / C).reshape((B,) + (1,) * (g.ndim - 1)), per_ex)
    keys = jax.random.split(key, 2)
    noisy = {k: (clipped[k].sum(0) + SIGMA * C * jax.random.normal(kk, params[k].shape)) / B
             for k, kk in zip(sorted(params), keys)}
    updates, opt_state = tx.update(noisy, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


key = jax.random.PRNGKey(1)
losses = []
for step in range(40):
    key, sub = jax.random.split(key)
    sl = slice(step * B, (step + 1) * B)
    params, opt_state, loss = train_step(params, opt_state, x[sl], y[sl], sub)
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
