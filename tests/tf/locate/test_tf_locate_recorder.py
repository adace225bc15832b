"""The recorder's interface (part A's watcher drives it: ``make_recorder`` + set_stage / mark_loss /
mark_grads), its names (construction hook, fallbacks), its hygiene (hooks removed, state restored)
and robustness on Keras internals (RNN loops, tf.data, IndexedSlices gradients)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from nanguard.tensorflow.locate import (TFRecorder, construction_site, install_construction_hook,  # noqa: E402
                                        localize, make_recorder)
from tfl_helpers import category, line_of  # noqa: E402

HERE = __file__


def L(marker: str) -> int:
    return line_of(HERE, marker)


class Ratio(keras.layers.Layer):
    def call(self, x):
        return x[:, :1] / x[:, 1:2]  # <ratio>


def test_make_recorder_driven_like_the_watcher():
    """hooks=False: the caller marks the loss, the stages and the gradients, as part A's replay hooks do;
    a tf.function step runs eagerly while armed and graph-mode again after."""
    model = keras.Sequential([keras.Input((2,)), Ratio(), keras.layers.Dense(1, name="head")])
    opt = keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)
    cap = SimpleNamespace(model=model, models=[model], optimizer=opt,
                          variables={v.path: v for v in model.variables + opt.variables})
    rec = make_recorder(cap)
    assert rec.apply_update and not rec.hooks

    @tf.function
    def forward(x):
        return model(x, training=True)
    x = np.array([[1.0, 2.0], [3.0, 0.0], [0.0, 1.0]], "float32")
    rec.start()
    assert tf.config.functions_run_eagerly()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(forward(x)))
    rec.mark_loss(loss)
    rec.set_stage("backward")
    grads = tape.gradient(loss, model.trainable_variables)
    rec.set_stage("forward")
    rec.mark_grads(grads, model.trainable_variables)
    rec.set_stage("optimizer")
    opt.apply(grads, model.trainable_variables)
    rec.set_stage("forward")
    rec.stop()
    assert not tf.config.functions_run_eagerly()
    loc = rec.result()
    o = loc["origin"]
    assert loc["phase"] == "forward" and (o["tf_op"], o["layer"], o["line"]) == ("RealDiv", "ratio", L("# <ratio>"))
    assert loc["n_ops"] > 10 and o["samples"] == [1]
    assert category(loc) == "div_by_zero"
    # nothing of the recorder is left installed
    from tensorflow.python.eager import context
    assert not context.context().op_callbacks
    assert not getattr(keras.layers.Layer.__call__, "_nanguard_comp", False)


def test_a_recorder_without_a_sink_reproduces_nothing():
    rec = TFRecorder()
    rec.start()
    tf.math.log(tf.constant([0.0, 1.0]))   # -inf, but nothing marks a loss or gradients
    rec.stop()
    loc = rec.result()
    assert not loc["reproduced"] and loc["origins_seen"] == 1
    assert any("no loss or gradient" in n for n in loc["notes"])


def test_construction_hook_records_user_lines_and_keeps_keras_configs():
    dense = keras.layers.Dense(3, name="d3")  # <ctor>
    site = construction_site(dense)
    assert site is not None and site[1] == L("# <ctor>")
    cfg = dense.get_config()
    assert cfg["units"] == 3 and keras.layers.Dense.from_config(cfg).units == 3
    loss = keras.losses.Huber(delta=2.0)  # <loss-ctor>
    assert construction_site(loss)[1] == L("# <loss-ctor>")
    assert keras.losses.Huber.from_config(loss.get_config()).name == loss.name


def test_construction_hook_uninstall_restores_keras():
    from keras.src.layers.layer import Layer
    from keras.src.losses.loss import Loss
    before_layer, before_loss = Layer.__dict__["__new__"], Loss.__dict__.get("__new__")
    un = install_construction_hook()   # nested inside the fixture's install
    un()
    un()                               # idempotent
    assert Layer.__dict__["__new__"] is before_layer and Loss.__dict__.get("__new__") is before_loss


class BigProjection(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        big = keras.initializers.Constant(1e20)
        self.proj = keras.layers.Dense(2, kernel_initializer=big, name="proj")  # <inner-ctor>

    def call(self, x):
        return self.proj(x)


def test_builtin_layer_inside_a_custom_layer_is_named_by_its_construction_line():
    model = keras.Sequential([keras.Input((2,)), BigProjection(), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.array([[1e20, 1e20], [1.0, 1.0]], "float32")            # 2e40 > float32 max
    loc = localize(lambda a, b: _train(model, opt, a, b), x, np.zeros((2, 1), "float32"), model=model,
                   optimizer=opt)
    o = loc["origin"]
    assert o["tf_op"] == "MatMul" and o["layer"] == "proj" and o["layer_stack"][-2:] == ["big_projection", "proj"]
    assert o["line"] == L("# <inner-ctor>") and o["line_source"] == "constructor"
    assert loc["facts"]["float64_check"]["finite"] and loc["facts"]["overflow"]["dtype_max"] > 3e38


def _train(model, opt, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))  # <train-call>
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


@pytest.mark.no_ctor_hook
def test_without_the_hook_a_unique_named_constructor_is_found_in_the_source():
    model = keras.Sequential([keras.Input((2,)),
                              keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(1e20),
                                                 name="huge_fallback"),  # <scan-ctor>
                              keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    loc = localize(lambda a, b: _train(model, opt, a, b), np.full((2, 2), 1e20, "float32"),
                   np.zeros((2, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert construction_site(model.layers[0]) is None
    assert o["layer"] == "huge_fallback" and o["line_source"] == "constructor_scan"
    # the scan found the call expression that carries name="huge_fallback" (it starts one line above)
    assert o["line"] in (L("# <scan-ctor>") - 2, L("# <scan-ctor>") - 1)


@pytest.mark.no_ctor_hook
def test_without_the_hook_an_ambiguous_layer_falls_back_to_the_call_site():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.layers[0].set_weights([np.full((2, 2), 1e20, "float32"), np.zeros(2, "float32")])
    opt = keras.optimizers.SGD(0.01)
    loc = localize(lambda a, b: _train(model, opt, a, b), np.full((2, 2), 1e20, "float32"),
                   np.zeros((2, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert o["layer"] == "dense" and o["line_source"] == "call_site" and o["line"] == L("# <train-call>")


def test_rnn_while_loop_and_tfdata_batch_with_nan_is_bad_input_data():
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.SimpleRNN(4), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.random.default_rng(0).normal(size=(6, 5, 3)).astype("float32")
    x[4, 2, 1] = np.nan
    ds = iter(tf.data.Dataset.from_tensor_slices((x, np.zeros((6, 1), "float32"))).batch(6))

    def step():
        xb, yb = next(ds)
        _train(model, opt, xb, yb)
    loc = localize(step, model=model, optimizer=opt)
    pre = loc["preexisting"]
    assert loc["phase"] == "data" and pre["kind"] == "data" and pre["samples"] == [4]
    assert pre["first_use"]["layer"] == "simple_rnn"
    assert category(loc) == "bad_input_data"


def test_embedding_rows_of_a_corrupted_table_are_param_corruption():
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4, name="emb"),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-3)
    table = model.get_layer("emb").embeddings
    w = table.numpy()
    w[7] = np.nan
    table.assign(w)
    ids = np.array([[1, 2, 3], [7, 1, 0]], "int32")
    loc = localize(lambda a, b: _train(model, opt, a, b), ids, np.zeros((2, 1), "float32"), model=model,
                   optimizer=opt)
    pre = loc["preexisting"]
    assert loc["phase"] == "params" and pre["kind"] == "param" and pre["name"] == table.path
    assert pre["rows_in_tensor"] == [7]
    assert category(loc) == "param_corruption"
    np.testing.assert_array_equal(np.isnan(table.numpy()).any(1), np.arange(10) == 7)   # restored as found


def test_the_recorder_never_breaks_the_step():
    """An error inside the recorder is noted, not raised; the step's own exception is reported."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)

    def step(x):
        _train(model, opt, x, np.zeros((2, 1), "float32"))
        raise RuntimeError("user check failed")
    loc = localize(step, np.ones((2, 2), "float32"), model=model, optimizer=opt)
    assert not loc["reproduced"] and any("user check failed" in n for n in loc["notes"])


def test_batchnorm_statistics_of_a_nan_batch_stay_bad_input_data():
    """BatchNormalization writes the batch's NaN statistics into its moving averages during the step:
    that write carries the batch's taint, it is not a parameter corruption."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.ones((4, 3), "float32")
    x[2, 0] = np.nan
    loc = localize(lambda a, b: _train(model, opt, a, b), x, np.zeros((4, 1), "float32"), model=model,
                   optimizer=opt)
    assert loc["phase"] == "data" and loc["preexisting"]["kind"] == "data" and loc["preexisting"]["samples"] == [2]
    assert category(loc) == "bad_input_data"
    assert np.isfinite(model.layers[0].moving_mean.numpy()).all()      # restored
