"""The four step shapes the JAX driver replays (plain ``jax.jit``, ``nnx.jit``, ``eqx.filter_jit``, a Linen
``TrainState``): how each becomes a ``pure_fn`` of array pytrees (the contract of nanguard.jax.locate), and
the origin's line and module path in each."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nanguard.jax.locate import localize  # noqa: E402

import jax_helpers  # noqa: E402

HERE = __file__
X = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], np.float32)
Y = np.array([1.0, 0.0, 2.0, 1.0], np.float32)


def line_of(marker: str) -> int:
    return jax_helpers.line_of(HERE, marker)


def check(pure_fn, args, marker, module, names=None, op="log"):
    res = localize(pure_fn, args, user_files=[HERE], names=names)
    assert res.error is None, res.error
    loc = res.localization
    assert res.reproduced and loc["phase"] == "forward", loc.get("notes")
    o = loc["origin"]
    assert (o["op"], o["line"]) == (op, line_of(marker)), (o["op"], o["line"])
    assert o["module"] == module, o["module"]
    return loc


def test_plain_jit_step_is_its_own_pure_function():
    tx = optax.adam(1e-2)

    def loss_fn(p, x, y):
        z = x @ p["w"]
        return jnp.mean(jnp.log(z * z) - y)   # plain-log

    @jax.jit
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p = {"w": jnp.ones((3,))}
    check(step, (p, tx.init(p), X, Y), "plain-log", None)


def test_nnx_jit_step_through_split_and_merge_of_the_pre_step_state():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x):
            return jnp.log(jnp.square(self.lin(x)))   # nnx-block-log

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs), Block(rngs)]) if hasattr(nnx, "List") else [Block(rngs), Block(rngs)]
            self.head = nnx.Linear(3, 1, rngs=rngs)

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)[:, 0]

    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    graphdef, state = nnx.split((model, opt))
    names = {}    # the driver's job: leaf path -> "module.attribute" (the model's leaves, by attribute path)
    for path, _ in jax.tree_util.tree_flatten_with_path((state,))[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path[1:]]
        keys = [k for k in keys if k != "value"]
        if keys[0] == "0":
            names[jax.tree_util.keystr(path)] = ".".join(keys[1:])

    def pure_fn(state, x, y):
        m, o = nnx.merge(graphdef, state)
        loss = train_step(m, o, x, y)
        return loss, nnx.state((m, o))

    loc = check(pure_fn, (state, X, Y), "nnx-block-log", "blocks.0", names=names)
    assert loc["origin"]["samples"] == [2]           # the zero row: lin(0) = bias = 0 -> log(0)


def test_eqx_filter_jit_step_through_partition_and_combine():
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        layers: list

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.layers = [eqx.nn.Linear(3, 3, key=k1), eqx.nn.Linear(3, 1, key=k2)]

        def __call__(self, x):
            h = jnp.log(jnp.square(self.layers[0](x)))   # eqx-log
            return self.layers[1](h)[0]

    model = Net(jax.random.PRNGKey(0))
    model = eqx.tree_at(lambda m: m.layers[0].bias, model, jnp.zeros(3))
    tx = optax.sgd(1e-2)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        def loss_fn(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    params, static = eqx.partition(model, eqx.is_array)

    def pure_fn(params, opt_state, x, y):
        return step(eqx.combine(params, static), opt_state, x, y)

    names = {jax.tree_util.keystr(path): ".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path[1:])
             for path, _ in jax.tree_util.tree_flatten_with_path((params,))[0]}
    check(pure_fn, (params, opt_state, X, Y), "eqx-log", "", names=names)


def test_linen_train_state_is_a_pytree_and_names_the_scope():
    nn = pytest.importorskip("flax.linen")
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(3, bias_init=nn.initializers.zeros)(x)
            h = nn.Dense(3, name="enc")(jnp.log(jnp.square(h)))   # linen-log
            return nn.Dense(1)(h)[:, 0]

    net = Net()
    params = net.init(jax.random.PRNGKey(0), X)["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-2))

    @jax.jit
    def step(state, x, y):
        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    check(lambda st, x, y: step(st, x, y), (state, X, Y), "linen-log", "")


@pytest.mark.parametrize("name,module", [("blocks.0.lin.kernel", "blocks.0.lin"), ("args[0].encoder.kernel.value", "encoder"),
                                         ("[0].layers[1].weight", "layers.1"),
                                         ("args[0].blocks[0].mlp.kernel.value", "blocks.0.mlp"), ("w", "")])
def test_a_parameter_name_or_tree_path_gives_its_module(name, module):
    from nanguard.jax.locate import _module_of
    assert _module_of(name) == module
