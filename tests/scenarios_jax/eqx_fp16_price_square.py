# House-price regression (prices in thousands) with an Equinox MLP trained in float16
# to halve memory: parameters and features are cast to half precision, the squared
# error is computed in the same dtype. Plain optax Adam, eqx.filter_jit.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import equinox as eqx

rng = np.random.default_rng(9)
n, d = 2000, 8
feats = rng.normal(size=(n, d)).astype(np.float32)
price = (120 + 25 * feats[:, :3].sum(1) + 5 * rng.normal(size=n)).clip(40, 220).astype(np.float32)
order = rng.permutation(n)
price[order[18 * 32 + 3]] = 780.0  # a lakeside villa among the ordinary houses

half = lambda x: x.astype(jnp.float16) if eqx.is_inexact_array(x) else x  # noqa: E731
model = jax.tree_util.tree_map(half, eqx.nn.MLP(d, 1, 32, 2, key=jax.random.PRNGKey(0)))
tx = optax.sgd(1e-4, momentum=0.9)
opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def train_step(model, opt_state, xb, yb):
    def loss_fn(model):
        pred = jax.vmap(model)(xb)[:, 0]
        return jnp.mean((pred - yb) ** 2)
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


batch = 32
losses = []
for step in range(40):
    i = order[step * batch:(step + 1) * batch]
    model, opt_state, loss = train_step(model, opt_state, jnp.asarray(feats[i], jnp.float16),
                                        jnp.asarray(price[i], jnp.float16))
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
