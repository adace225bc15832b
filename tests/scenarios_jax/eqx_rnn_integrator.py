# Hand-written linear recurrent network that integrates a noisy velocity signal over
# 40 time steps to predict the final displacement; the recurrent matrix starts
# orthogonal with gain 0.95 for a long memory. Equinox module, lax.scan over time,
# optax SGD, eqx.filter_jit.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import equinox as eqx

rng = np.random.default_rng(3)
n, T, H = 1024, 40, 16
velocity = rng.normal(size=(n, T, 1)).astype(np.float32)
displacement = (velocity.sum(1) / T ** 0.5).astype(np.float32)
q, _ = np.linalg.qr(rng.normal(size=(H, H)))


class Integrator(eqx.Module):
    inp: eqx.nn.Linear
    rec: jax.Array
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.inp = eqx.nn.Linear(1, H, key=k1)
        self.rec = jnp.asarray(0.95 * q, jnp.float32)
        self.out = eqx.nn.Linear(H, 1, key=k2)

    def __call__(self, seq):
        u = jax.vmap(self.inp)(seq)
        h, _ = jax.lax.scan(lambda h, ut: (h @ self.rec + ut, None), jnp.zeros(H), u)
        return self.out(h)


model = Integrator(jax.random.PRNGKey(0))
tx = optax.sgd(3e-2)
opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def train_step(model, opt_state, xb, yb):
    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


losses = []
for step in range(70):
    idx = rng.integers(0, n, 16)
    model, opt_state, loss = train_step(model, opt_state, velocity[idx], displacement[idx])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
