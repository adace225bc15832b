"""TensorFlow/Keras recovery actions on their own (snapshots, rollback, repair, lr backoff in a
traced step, in-graph clipping, float32 layer), and end to end under the core policy when it is
in the build."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state, run_tf, write  # noqa: E402,F401
from nanguard.core.config import GuardConfig  # noqa: E402
from nanguard.tensorflow.recover import KerasActions, make_schedule_scalable  # noqa: E402
from nanguard.tensorflow.watch import TFWatcher  # noqa: E402


class _Policy:
    """A test double of the policy side of the watcher (no decisions: it only records calls)."""

    def __init__(self):
        self.starts, self.prepared = [], []

    def prepare(self, opt):
        self.prepared.append(opt)
        make_schedule_scalable(opt)

    def step_start(self, watcher, step):
        self.starts.append(step)

    def handle(self, watcher, det, st):
        return True


def _model(bn=True):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="tanh")]
    if bn:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Dropout(0.2), keras.layers.Dense(1)]
    return keras.Sequential(layers)


def _data(n=6):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32"))
            for _ in range(n)]


def _step_fn(model, opt, graph=True):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return tf.function(step) if graph else step


def _values(vs):
    return [np.array(v.numpy()) for v in vs]


def test_snapshot_restore_replays_exactly(tmp_path):
    model, opt = _model(), keras.optimizers.Adam(1e-2)
    data = _data()
    w = TFWatcher(GuardConfig(), raise_on_stop=False)
    w.policy = _Policy()
    with w:
        step = _step_fn(model, opt)
        for x, y in data[:2]:
            step(x, y)
        acts = KerasActions(w)
        snap = acts.take_snapshot(2, None)
        assert snap.finite() and snap.nbytes > 0
        assert any("seed_generator" in v.path for v in snap.vars)  # dropout's state: same draws after rollback
        for x, y in data[2:4]:
            step(x, y)
        assert int(opt.iterations) == 4
        opt.learning_rate.assign(0.5)
        acts.restore(snap)
        assert float(opt.learning_rate) == 0.5  # the current rate is kept
        assert int(opt.iterations) == 2
        assert all(np.array_equal(a, b) for a, b in zip(snap.values, _values(snap.vars)))
    # with the same lr, the replay is exact
    model2, opt2 = _model(), keras.optimizers.Adam(1e-2)
    w2 = TFWatcher(GuardConfig(), raise_on_stop=False)
    w2.policy = _Policy()
    with w2:
        step = _step_fn(model2, opt2)
        for x, y in data[:2]:
            step(x, y)
        acts = KerasActions(w2)
        snap = acts.take_snapshot(2, None)
        for x, y in data[2:4]:
            step(x, y)
        first = _values(model2.variables) + _values(opt2.variables)
        acts.restore(snap)
        for x, y in data[2:4]:
            step(x, y)
        second = _values(model2.variables) + _values(opt2.variables)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    assert w2.policy.starts[:3] == [0, 1, 2]  # a snapshot point at each step's start


def test_refill_repair_and_buffers():
    model, opt = _model(), keras.optimizers.SGD(0.1)
    w = TFWatcher(GuardConfig(), raise_on_stop=False)
    w.policy = _Policy()
    with w:
        step = _step_fn(model, opt, graph=False)
        x, y = _data(1)[0]
        step(x, y)
        acts = KerasActions(w)
        snap = acts.take_snapshot(1, 0.5)
        arrays = [id(a) for a in snap.values]
        step(x, y)
        assert acts.refill_snapshot(snap, 2, 0.4) and snap.step == 2
        assert [id(a) for a in snap.values] == arrays  # in place
        k = model.layers[0].kernel
        bad = k.numpy().copy()
        bad[1, 2] = np.nan
        k.assign(bad)
        assert not acts.state_finite()
        assert acts.repair_nonfinite(snap) == 1 and acts.state_finite()
        bn = model.layers[1]
        bn.moving_mean.assign(np.full(8, 7.0, "float32"))
        assert acts.restore_buffers(snap) == 2  # moving mean and variance
        assert not np.any(bn.moving_mean.numpy() == 7.0)
        assert acts.skip_step()["update_skipped_in_graph"] is True


def test_lr_backoff_reaches_a_traced_step_with_a_schedule():
    model = _model(bn=False)
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=100, decay_rate=0.9)
    opt = keras.optimizers.SGD(sched)
    w = TFWatcher(GuardConfig(), raise_on_stop=False)
    w.policy = _Policy()
    data = _data()
    with w:
        step = _step_fn(model, opt)
        step(*data[0])  # traced with the scalable schedule
        acts = KerasActions(w)
        lr0 = acts.learning_rates()[0]
        rec = acts.lr_backoff(0.1)
        assert rec["how"] == ["schedule factor"]
        assert rec["lr_after"][0] == pytest.approx(lr0 * 0.1, rel=1e-6)
        k = model.layers[-1].kernel
        before = k.numpy().copy()
        step(*data[1])
        assert np.abs(k.numpy() - before).max() < 0.2 * lr0  # a tenth of the rate moves little


def test_clipping_is_off_until_armed_and_bit_exact_when_off():
    data = _data()
    ref_model, ref_opt = _model(bn=False), keras.optimizers.SGD(0.1)
    ref = _step_fn(ref_model, ref_opt)
    for x, y in data[:3]:
        ref(x, y)
    model, opt = _model(bn=False), keras.optimizers.SGD(0.1)
    w = TFWatcher(GuardConfig(), raise_on_stop=False)
    w.policy = _Policy()
    with w:
        step = _step_fn(model, opt)
        for x, y in data[:3]:
            step(x, y)
        assert all(np.array_equal(a, b) for a, b in zip(_values(ref_model.variables), _values(model.variables)))
        KerasActions(w).clip_gradients(1e-3)
        before = _values(model.trainable_variables)
        step(*data[3])
        delta = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(before, _values(model.trainable_variables))))
    assert delta == pytest.approx(0.1 * 1e-3, rel=1e-3)  # SGD: lr x the clipped global norm


def test_a_watch_leaves_nothing_to_the_next():
    """Several watches in one process. What a watch armed in a traced step (a stop, clipping) ends
    with it; an optimizer of an earlier watch that is still alive is no part of the next one (its
    snapshot, learning rates) until one of its updates runs under it."""
    data = _data()
    old_model, old_opt = _model(bn=False), keras.optimizers.SGD(0.1)
    old_step = _step_fn(old_model, old_opt)
    with TFWatcher(GuardConfig(on_nonfinite="stop"), raise_on_stop=False):
        old_step(*data[0])
        old_step(data[1][0] * np.nan, data[1][1])  # stopped: neither this update nor later ones apply
        old_step(*data[2])
    assert int(old_opt.iterations) == 1
    old_step(*data[2])  # no watcher: the check left in the traced step stops nothing
    assert int(old_opt.iterations) == 2
    k = old_model.layers[-1].kernel
    k.assign(np.full(k.shape, np.nan, "float32"))  # between watches: the earlier run's model breaks
    model, opt = _model(bn=False), keras.optimizers.SGD(0.1)
    step = _step_fn(model, opt)
    w = TFWatcher(GuardConfig(), raise_on_stop=False)
    w.policy = _Policy()
    with w:
        step(*data[0])
        acts = KerasActions(w)
        assert w.optimizers() == [opt]
        assert acts.take_snapshot(1, None).finite() and acts.state_finite()
        assert acts.lr_backoff(0.5)["how"] == ["variable"]
        acts.clip_gradients(1e-6)
        old_step(*data[3])  # the earlier run's step under this watch: its optimizer is this run's now
        assert w.optimizers() == [opt, old_opt] and w.steps_watched == 2  # one update by each
        assert int(old_opt.iterations) == 2  # its non-finite variables: the update was dropped
    before = _values(model.trainable_variables)
    step(*data[1])  # no watcher: no clipping either (clipped, the update would move 5e-8)
    delta = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(before, _values(model.trainable_variables))))
    assert delta > 1e-4


def test_upcast_a_layer_and_the_float16_layers_after_it():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="square_me"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1, dtype="float32")])
    w = TFWatcher(GuardConfig(), raise_on_stop=False)
    w.models.add(model)
    downstream = []
    rec = KerasActions(w).upcast("square_me", downstream.append)
    assert rec["dtype_before"] == "mixed_float16" and rec["dtype_after"] == "float32"
    assert model.layers[0].compute_dtype == "float32" and model.layers[1].compute_dtype == "float32"
    assert len(downstream) == 1 and rec["downstream"] == downstream
    assert KerasActions(w).upcast("no_such_layer", downstream.append) is None


LR_SCRIPT = """
    import numpy as np, tensorflow as tf, keras
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = np.stack([rng.random(512) * 2, rng.random(512) * 15], 1).astype("float32")
    y = (x @ np.array([[1.5], [-0.1]]) + 2.0).astype("float32")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(learning_rate=0.03)
    losses = []
    for step in range(150):
        idx = rng.integers(0, 512, 64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[idx], training=True) - y[idx]))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    print("final", sum(losses[-5:]) / 5)
"""


@pytest.mark.skipif(importlib.util.find_spec("nanguard.core.recovery") is None,
                    reason="the core recovery policy is not in this build")
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_lr_too_high_recovers_end_to_end(tmp_path, capsys):
    s = write(tmp_path, LR_SCRIPT)
    code, rep = run_tf(tmp_path, s, recover="auto", localize=False)
    assert code == 0
    assert rep["status"] == "recovered"
    ev = rep["events"][0]
    assert ev["cause"]["category"] == "lr_too_high"
    assert ev["recovery"]["action"] == "rollback+lr_backoff+skip_step"
    final = float(capsys.readouterr().out.split("final")[1])
    assert np.isfinite(final) and final < rep["history"][0]["loss"] / 4  # training went on, and learned


UPCAST_FN = """
    import numpy as np, tensorflow as tf, keras
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.random((512, 2)).astype("float32")
    x[rng.choice(512, 12, replace=False), 0] = 1e5   # a few rows past float16's range
    y = (x[:, 1:] * 2.0).astype("float32")
    inp = keras.Input((2,))
    h = keras.layers.Lambda(lambda t: tf.math.log1p(t), name="log_feat")(inp)
    out = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(8, activation="relu")(h))
    model = keras.Model(inp, out)
    opt = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-2))

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    for step in range(40):
        idx = rng.integers(0, 512, 64)
        train_step(x[idx], y[idx])
"""


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_an_upcast_reaches_a_scripts_own_traced_step(tmp_path):
    """A custom @tf.function step traced in float16: the upcast recovery must re-trace it, or the same overflow
    comes back at every batch holding a large row (it was recovered five times, 'now float32', never retraced)."""
    keras.mixed_precision.set_global_policy("float32")
    _, rep = run_tf(tmp_path, write(tmp_path, UPCAST_FN), recover="auto")
    keras.mixed_precision.set_global_policy("float32")
    ups = [e for e in rep["events"] if "upcast" in str((e.get("recovery") or {}).get("action"))]
    assert len(ups) == 1, [(e["step"], (e.get("recovery") or {}).get("action")) for e in rep["events"]]
    assert ups[0]["recovery"]["actions"]["upcast"]["retraced"] is True
