"""Keras dataset rows and counterfactual experiments (replay proof), in-process.

A NaN in row 1234 of a NumPy array given to ``fit`` (shuffled) is named as dataset row 1234, through
the data adapter's arrays and through a ``tf.data`` chain; a pipeline whose rows cannot be traced says
so. The failing ``fit`` step is replayed without the bad rows (``drop_samples``) or with a float16
layer in float32 (``upcast_module``): ``cause.confirmed_by``, as on the PyTorch side. The tape-loop
path (the re-run child) runs end to end in ``test_scenarios_keras_rows.py``.
"""
from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
np = pytest.importorskip("numpy")

from nanguard.keras import NanGuard  # noqa: E402
from nanguard.tensorflow.rows import RowSource, dataset_source, trace_rows  # noqa: E402

BAD = 1234


def _data(n=2048, bad=BAD):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    x[bad, 3] = np.nan
    return x, y


def _fit(data, **kw):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    cb = NanGuard(report=None, quiet=True)
    model.fit(*data, epochs=2, verbose=0, callbacks=[cb], **kw)
    assert cb.report.events, "the NaN row was not caught"
    return cb.report.events[0]


# ---------------------------------------------------------------------------------------- tracing alone

def test_trace_rows_by_value_through_shuffle_and_duplicates():
    x, y = _data(64, bad=40)
    perm = np.random.default_rng(1).permutation(64)[:16]
    batch = (x[perm], y[perm])
    pos = int(np.nonzero(perm == 40)[0][0]) if 40 in perm else None
    src = RowSource([x, y], ["shuffle", "batch"], "the arrays given to fit")
    if pos is not None:
        assert trace_rows(src, batch, [pos])["dataset_rows"] == [40]
    other = int(perm[0]) if perm[0] != 40 else int(perm[1])
    out = trace_rows(src, batch, [0 if perm[0] != 40 else 1])
    assert out["dataset_rows"] == [other]
    dup = RowSource([np.concatenate([x, x[other:other + 1]]), np.concatenate([y, y[other:other + 1]])], [], "dup")
    out = trace_rows(dup, batch, [0 if perm[0] != 40 else 1])
    assert out["dataset_rows"] == [other, 64] and out["ambiguous"]


def _generated(x, y, batch):
    """A tf.data pipeline over a Python generator (its rows have no array behind them)."""
    def gen():
        for i in range(len(x)):
            yield x[i], y[i]
    return tf.data.Dataset.from_generator(gen, output_signature=(tf.TensorSpec((8,), tf.float32),
                                                                 tf.TensorSpec((1,), tf.float32))).batch(batch)


def test_untraceable_pipelines_say_why():
    x, y = _data(64, bad=5)
    g = _generated(x, y, 8)
    note = trace_rows(dataset_source(g), (x[:8], y[:8]), [5])["note"]
    assert note.startswith("batch position(s) [5]; dataset row not traceable through") and "generator" in note
    mapped = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 2.0, b + 1.0)).batch(8)
    s = dataset_source(mapped)
    assert s.through == ["Map", "Batch"] and s.altering == ["Map"]
    note = trace_rows(s, (x[:8] * 2, y[:8] + 1), [5])["note"]
    assert "not traceable through Map" in note
    assert "script's own code" in trace_rows(None, (x[:8],), [5])["note"]


# ---------------------------------------------------------------------------------------- fit end to end

def _assert_row_proved(ev, bad=BAD):
    c = ev.cause
    assert c["category"] == "bad_input_data"
    assert ev.origin["source_rows"] == [bad]
    assert f"dataset row(s) [{bad}]" in c["summary"] and f"dataset row(s) [{bad}]" in ev.fixes[0]
    assert c["evidence"]["bad_samples"]["dataset_indices"] == [bad]
    assert c["confirmed_by"]["kind"] == "drop_samples"
    assert c["confirmed_by"]["params"]["rows"] == ev.origin["samples"]
    assert c["confidence"] >= 0.97


def test_fit_numpy_shuffled_names_dataset_row_and_proves_it():
    ev = _fit(_data(), batch_size=64, shuffle=True)
    _assert_row_proved(ev)
    assert ev.origin["samples"] != [BAD]   # a position in the batch, not the row


def test_fit_tf_data_shuffled_names_dataset_row():
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=1).batch(64).prefetch(2)
    _assert_row_proved(_fit((ds,)))


def test_fit_generator_pipeline_says_row_not_traceable():
    x, y = _data(512, bad=300)
    ev = _fit((_generated(x, y, 64),))
    bs = ev.cause["evidence"]["bad_samples"]
    assert "dataset_indices" not in bs and ev.cause["confirmed_by"]["kind"] == "drop_samples"
    assert bs["batch_rows"] == [300 % 64]
    assert "dataset row not traceable through" in bs["dataset_rows_note"]


def test_fit_float16_overflow_confirmed_by_a_layer_in_float32():
    class Square(keras.layers.Layer):
        def call(self, x):
            return x * x   # |x| ~ 300: 9e4 > float16's max 65504

    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        x = np.full((64, 4), 300.0, "float32")
        y = np.zeros((64, 1), "float32")
        model = keras.Sequential([keras.Input((4,)), Square(), keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(1e-9), loss="mse")
        cb = NanGuard(report=None, quiet=True)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    finally:
        keras.config.set_dtype_policy("float32")
    ev = cb.report.events[0]
    c = ev.cause
    assert c["confirmed_by"]["kind"] in ("upcast_module", "float64_step"), c
    assert c["category"] == "low_precision_overflow"
    kinds = [e["kind"] for e in c["evidence"]["experiments"]]
    assert "drop_samples" not in kinds or c["evidence"]["experiments"][0]["kind"] != "drop_samples"
    # the replays left the model as it was: its policy and (skipped update) finite weights
    assert model.layers[0].dtype_policy.name == "mixed_float16"
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


# ---------------------------------------------------------------------------------------- history replay

def test_lr_replay_from_the_step_before_tells_a_too_high_rate():
    """The re-run child's history replay, in-process: from the state at the start of step N-1, steps N-1
    and N replayed with the learning rate lowered are finite; at the same rate they are not (the same
    replay machinery, so a finite outcome is the rate's doing). The training state is left as it was."""
    from nanguard.core.config import GuardConfig
    from nanguard.core.experiments import Spec
    from nanguard.tensorflow.capture import StepCapture, variables_of
    from nanguard.tensorflow.experiments import KerasBench
    from nanguard.tensorflow.watch import TFWatcher

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = (10.0 * rng.normal(size=(256, 4))).astype("float32")
    y = (x @ np.array([[0.5], [-1.0], [2.0], [0.1]])).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(learning_rate=0.1)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    w = TFWatcher(GuardConfig(on_nonfinite="warn"), raise_on_stop=False)
    calls, values = {}, {}
    with w:
        for s in range(40):
            b = (tf.constant(x[(s * 64) % 256:(s * 64) % 256 + 64]), tf.constant(y[(s * 64) % 256:(s * 64) % 256 + 64]))
            if s > 0:
                values[s] = {k: np.array(v.numpy()) for k, v in variables_of([model], opt).items()}
            calls[s] = (train_step, b, {})
            if not np.isfinite(float(train_step(*b))):
                break
        n = s
        assert 2 <= n < 39
        cap = StepCapture(step=n, kind="fit", optimizer=opt, model=model, models=[model], watcher=w,
                          variables=variables_of([model], opt), values=values[n], inputs=(calls[n][1], {}),
                          step_fn=lambda i: train_step(*i[0], **i[1]))
        bench = KerasBench(cap, history={"calls": calls, "values": values})
        assert bench.capabilities({})["snapshots"] == list(range(1, n))
        low = bench.run(Spec("lr_replay", {"factor": 0.01, "from_step": n - 1, "to_step": n}))
        same = bench.run(Spec("lr_replay", {"factor": 1.0, "from_step": n - 1, "to_step": n}))
    assert low.finite is True and low.replays == 2, low
    assert same.finite is False, same
    assert float(np.asarray(opt.learning_rate)) == pytest.approx(0.1)
    # the replays leave the captured pre-step state (the bench's contract; investigate_fit then puts back
    # what was there before the experiments)
    for k, v in cap.variables.items():
        assert np.array_equal(np.asarray(v.numpy()), cap.values[k], equal_nan=True), k
