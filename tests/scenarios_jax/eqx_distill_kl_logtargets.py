# Knowledge distillation of a small Equinox classifier from a fixed teacher: the
# student matches the teacher's class distribution with optax.kl_divergence. The
# teacher's outputs are stored as log-probabilities (jax.nn.log_softmax) to save a
# softmax per batch. Plain optax Adam, eqx.filter_jit.
import os
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
import jax.numpy as jnp
import numpy as np
import optax
import equinox as eqx

rng = np.random.default_rng(14)
n, d, classes = 1200, 16, 6
x = rng.normal(size=(n, d)).astype(np.float32)
teacher_logits = x @ rng.normal(size=(d, classes)).astype(np.float32)
teacher_logp = np.asarray(jax.nn.log_softmax(teacher_logits, axis=-1))

student = eqx.nn.MLP(d, classes, 32, 2, key=jax.random.PRNGKey(0))
tx = optax.adam(1e-3)
opt_state = tx.init(eqx.filter(student, eqx.is_inexact_array))


@eqx.filter_jit
def train_step(student, opt_state, xb, tb):
    def loss_fn(student):
        log_q = jax.nn.log_softmax(jax.vmap(student)(xb), axis=-1)
        return optax.kl_divergence(log_q, tb).mean()
    loss, grads = eqx.filter_value_and_grad(loss_fn)(student)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(student, eqx.is_inexact_array))
    return eqx.apply_updates(student, updates), opt_state, loss


batch = 40
losses = []
for step in range(30):
    sl = slice(step * batch, (step + 1) * batch)
    student, opt_state, loss = train_step(student, opt_state, x[sl], teacher_logp[sl])
    losses.append(float(loss))
    print(f"step={step} loss={float(loss):.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
