# Action classifier for a game agent (behaviour cloning) with an entropy bonus, plain JAX + optax,
# jitted step with donate_argnums. Illegal actions are masked with a large negative logit before
# the softmax; the entropy is written as -sum(p * log_softmax(logits)): a masked action has p = 0
# times a finite log-probability. The demonstrations are ordered by game phase (every action is
# legal in the opening).
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(9)
n, d, acts = 1200, 16, 6
obs = rng.normal(0, 1, (n, d)).astype(np.float32)
legal = rng.random((n, acts)) < 0.7
legal[np.arange(n), rng.integers(0, acts, n)] = True
legal[:11 * 40 + 17] = True  # the opening: every action legal
expert = np.array([rng.choice(np.flatnonzero(r)) for r in legal]).astype(np.int32)
MASK = -1e9

k1, k2 = jax.random.split(jax.random.PRNGKey(0))
params = {"w1": jax.random.normal(k1, (d, 64)) * 0.2, "w2": jax.random.normal(k2, (64, acts)) * 0.2}
tx = optax.adam(1e-3)
opt_state = tx.init(params)


def loss_fn(params, ob, lg, act):
    logits = jnp.tanh(ob @ params["w1"]) @ params["w2"]
    logits = jnp.where(lg, logits, MASK)
    p = jax.nn.softmax(logits)
    entropy = -jnp.sum(p * jax.nn.log_softmax(logits), axis=-1)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, act)
    return jnp.mean(nll - 0.01 * entropy)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def train_step(params, opt_state, ob, lg, act):
    loss, grads = jax.value_and_grad(loss_fn)(params, ob, lg, act)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


losses = []
for step in range(30):
    sl = slice(step * 40, (step + 1) * 40)
    params, opt_state, loss = train_step(params, opt_state, obs[sl], legal[sl], expert[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
