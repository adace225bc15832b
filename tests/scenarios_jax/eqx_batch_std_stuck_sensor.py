# Wind-turbine power regression with an Equinox MLP under eqx.filter_jit. The model standardizes
# its inputs with the batch's own mean and standard deviation. The data is sorted by turbine, and
# one turbine's pitch-angle sensor reports a constant 0.0: in the batch that holds only that
# turbine's records the pitch column has std 0.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(5)
turbines, per = 16, 48
wind = rng.uniform(3, 20, (turbines, per)).astype(np.float32)
pitch = rng.uniform(-2, 25, (turbines, per)).astype(np.float32)
pitch[9] = 0.0  # a stuck sensor on turbine 9
temp = rng.normal(12, 6, (turbines, per)).astype(np.float32)
power = (0.02 * wind ** 3 - 0.3 * pitch + 0.05 * temp + rng.normal(0, 1, (turbines, per))).astype(np.float32) / 10
x = np.stack([wind, pitch, temp], -1).reshape(-1, 3)
y = power.reshape(-1)


class PowerModel(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(3, 1, 32, 2, key=key)

    def __call__(self, xb):
        z = (xb - xb.mean(0)) / xb.std(0)
        return jax.vmap(self.mlp)(z)[:, 0]


model = PowerModel(jax.random.PRNGKey(0))
tx = optax.adam(3e-3)
opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def train_step(model, opt_state, xb, yb):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(xb) - yb) ** 2))(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


losses = []
for step in range(16):
    sl = slice(step * per, (step + 1) * per)
    model, opt_state, loss = train_step(model, opt_state, x[sl], y[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
