# Product-image embedding with a contrastive distance loss on pairs of feature vectors
# (pulled together when they show the same product). Equinox MLP encoder, optax Adam,
# eqx.filter_jit. The pair list contains a pair built from the same photo twice.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import equinox as eqx

rng = np.random.default_rng(6)
n, d = 1024, 16
photos = rng.normal(size=(n, d)).astype(np.float32)
left = rng.integers(0, n, 2048)
right = rng.integers(0, n, 2048)
right[1500] = left[1500]  # the same photo on both sides of a pair
same = (rng.random(2048) < 0.5).astype(np.float32)

encoder = eqx.nn.MLP(in_size=d, out_size=8, width_size=32, depth=2, key=jax.random.PRNGKey(0))
tx = optax.adam(1e-3)
opt_state = tx.init(eqx.filter(encoder, eqx.is_array))


@eqx.filter_jit
def train_step(encoder, opt_state, a, b, y):
    def loss_fn(encoder):
        za, zb = jax.vmap(encoder)(a), jax.vmap(encoder)(b)
        dist = jnp.linalg.norm(za - zb, axis=-1)
        return jnp.mean(y * dist ** 2 + (1 - y) * jnp.maximum(1.0 - dist, 0.0) ** 2)
    loss, grads = eqx.filter_value_and_grad(loss_fn)(encoder)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(encoder, eqx.is_array))
    return eqx.apply_updates(encoder, updates), opt_state, loss


losses = []
for step in range(50):
    sl = slice(step * 40, (step + 1) * 40)
    encoder, opt_state, loss = train_step(encoder, opt_state, photos[left[sl]], photos[right[sl]], same[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
