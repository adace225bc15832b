# Retail demand forecasting, plain JAX + optax: AdamW under optax.inject_hyperparams with a
# warmup-cosine schedule, gradient clipping in a chain, jitted step. The lag features come from a
# join where one store-week had no previous record: the CSV cell was empty and parsed as NaN.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(6)
n, d = 2400, 10
x = rng.normal(0, 1, (n, d)).astype(np.float32)
w_true = rng.normal(0, 1, d).astype(np.float32)
y = (np.tanh(x @ w_true) * 3 + 0.1 * rng.normal(size=n)).astype(np.float32)
x[27 * 64 + 40, 3] = float("nan")  # an empty lag cell

key = jax.random.PRNGKey(0)
k1, k2 = jax.random.split(key)
params = {"w1": jax.random.normal(k1, (d, 64)) * 0.3, "b1": jnp.zeros(64),
          "w2": jax.random.normal(k2, (64, 1)) * 0.1, "b2": jnp.zeros(1)}
schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=5, decay_steps=35)
tx = optax.chain(optax.clip_by_global_norm(1.0),
                 optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=1e-4))
opt_state = tx.init(params)


def predict(params, xb):
    h = jax.nn.gelu(xb @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"])[:, 0]


def loss_fn(params, xb, yb):
    return jnp.mean(optax.huber_loss(predict(params, xb), yb))


@jax.jit
def train_step(params, opt_state, xb, yb):
    loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


losses = []
for step in range(36):
    sl = slice(step * 64, (step + 1) * 64)
    params, opt_state, loss = train_step(params, opt_state, x[sl], y[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
