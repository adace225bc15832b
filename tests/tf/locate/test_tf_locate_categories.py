"""The TF op recorder on real Keras training steps: one test per cause category reachable in
TensorFlow, checking the origin op, layer, line, phase, and the category that
``nanguard.core.diagnosis.diagnose`` gives for the localization.

Every failure is decided by construction (an exact zero, a row of -inf, a value past a range, a
value injected into the batch or a variable), not by the last bits of a reduction.
"""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from nanguard.tensorflow.locate import localize  # noqa: E402
from tfl_helpers import category, line_of, same_file  # noqa: E402

HERE = __file__


def L(marker: str) -> int:
    return line_of(HERE, marker)


def _step(model, loss_fn, opt, *, compiled=True):
    """A custom training step (forward, loss, GradientTape.gradient, apply_gradients)."""
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return tf.function(train_step) if compiled else train_step


def _mse(y, p):
    return tf.reduce_mean(tf.square(p - y))


# ----------------------------------------------------------------------------- div_by_zero
class MeanOverItems(keras.layers.Layer):
    def call(self, emb, ids):
        mask = tf.cast(ids > 0, emb.dtype)[..., None]
        total = tf.reduce_sum(emb * mask, axis=1)
        count = tf.reduce_sum(mask, axis=1)
        return total / count  # <div>


def test_div_by_zero_empty_bag_in_a_tf_function_step():
    ids_in = keras.Input((6,), dtype="int32")
    emb = keras.layers.Embedding(50, 8)(ids_in)
    pooled = MeanOverItems()(emb, ids_in)
    model = keras.Model(ids_in, keras.layers.Dense(3)(keras.layers.Dense(16, activation="tanh")(pooled)))
    opt = keras.optimizers.Adam(1e-3)
    step = _step(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), opt)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (8, 6)).astype("int32")
    ids[5] = 0                                            # a user with no items
    y = rng.integers(0, 3, 8)
    before = [v.numpy().copy() for v in model.trainable_variables]
    loc = localize(step, ids, y, model=model, optimizer=opt)
    assert loc["reproduced"] and loc["phase"] == "forward" and loc["sink"]["kind"] == "loss"
    o = loc["origin"]
    assert (o["tf_op"], o["op"], o["layer"], o["module_type"]) == ("RealDiv", "div", "mean_over_items",
                                                                  "MeanOverItems")
    assert o["line"] == L("# <div>") and same_file(o["file"], HERE) and o["line_source"] == "op"
    assert o["samples"] == [5] and o["stage"] == "forward"
    zd = loc["facts"]["zero_denominator"]
    assert zd["zeros"] == 1 and zd["from_reduction"] and zd["zero_over_zero"] == 8
    assert loc["facts"]["float64_check"]["finite"] is False
    assert category(loc) == "div_by_zero"
    # the replay leaves the training state as it found it, and functions graph-mode again
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())
    assert not tf.config.functions_run_eagerly()


# ----------------------------------------------------------------------------- log_domain
def cross_entropy(y_true, y_pred):
    return -tf.reduce_sum(y_true * tf.math.log(y_pred), axis=-1)  # <log>


def test_log_domain_custom_loss_through_model_train_step():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=cross_entropy)
    k, b = model.layers[0].get_weights()
    model.layers[0].set_weights([np.zeros_like(k), np.array([200.0, 0, 0, 0], "float32")])  # p = [1, 0, 0, 0]
    x = np.ones((4, 3), "float32")
    y = keras.utils.to_categorical([0, 1, 2, 0], 4).astype("float32")
    model.optimizer.build(model.trainable_variables)
    loc = localize(model.train_step, (x, y), model=model, optimizer=model.optimizer)
    o = loc["origin"]
    assert loc["phase"] == "forward" and (o["tf_op"], o["op"]) == ("Log", "log")
    assert o["line"] == L("# <log>") and o["function"] == "cross_entropy" and o["layer"] is None
    assert loc["facts"]["log_domain"]["zeros"] == 12 and loc["facts"]["producers"][0][0] == "_softmax"
    assert category(loc) == "log_domain"


# ----------------------------------------------------------------------------- masked_softmax, built-in layer
class MaskScores(keras.layers.Layer):
    def call(self, scores, keep):
        return tf.where(keep, scores, -np.inf)


def test_masked_softmax_inside_a_builtin_layer_is_named_by_its_construction_line():
    s_in = keras.Input((5,))
    k_in = keras.Input((5,), dtype="bool")
    softmax = keras.layers.Softmax()  # <softmax-ctor>
    att = softmax(MaskScores()(keras.layers.Dense(5)(s_in), k_in))
    model = keras.Model([s_in, k_in], att)
    opt = keras.optimizers.SGD(0.01)
    step = _step(model, _mse, opt)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 5)).astype("float32")
    keep = rng.random((6, 5)) < 0.6
    keep[:, 0] = True
    keep[4] = False                                      # every key of row 4 masked
    loc = localize(step, (x, keep), np.zeros((6, 5), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "forward" and o["tf_op"] == "Softmax" and o["op"] == "_softmax"
    assert o["layer"] == "softmax" and o["module_type"] == "Softmax"
    assert o["line"] == L("# <softmax-ctor>") and o["line_source"] == "constructor"
    sm = loc["facts"]["softmax_all_masked_rows"]
    assert sm["count"] == 1 and sm["batch_rows"] == [4]
    assert category(loc) == "masked_softmax"


# ----------------------------------------------------------------------------- exp_overflow
def softmax_xent(y_true, logits):
    e = tf.exp(logits)  # <exp>
    p = e / tf.reduce_sum(e, axis=-1, keepdims=True)
    return -tf.reduce_mean(tf.reduce_sum(y_true * tf.math.log(p + 1e-9), axis=-1))


def test_exp_overflow_in_a_hand_written_softmax():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.layers[0].set_weights([np.array([[60.0, 0, 0], [60.0, 0, 0]], "float32"), np.zeros(3, "float32")])
    opt = keras.optimizers.SGD(0.01)
    step = _step(model, softmax_xent, opt, compiled=False)        # an eager step
    x = np.array([[1.0, 1.0], [0.1, 0.2]], "float32")              # 120 > 88.7 in row 0
    y = keras.utils.to_categorical([0, 1], 3).astype("float32")
    loc = localize(step, x, y, model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "forward" and o["tf_op"] == "Exp" and o["line"] == L("# <exp>")
    assert o["output"]["posinf"] == 1 and o["samples"] == [0]
    assert loc["facts"]["exp_input_max"] == pytest.approx(120.0) and loc["facts"]["float64_check"]["finite"]
    assert category(loc) == "exp_overflow"


def info_nce(y_view, z):
    sim = tf.matmul(z, y_view, transpose_b=True)   # two views: the negative pair (0, 1) beats the positive
    allp = tf.reduce_sum(tf.exp(sim / 0.01), axis=1)  # <negexp>
    pos = tf.exp(tf.linalg.diag_part(sim) / 0.01)
    return -tf.reduce_mean(tf.math.log(pos / allp))


def test_an_overflow_a_division_made_zero_is_the_origin_of_the_log_of_that_zero():
    """exp(95) = inf on a negative pair, exp(80) on the positive is finite: pos / inf = 0, log(0) = -inf.
    The failure was born at the exp (the log only met its consequence)."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, use_bias=False)])
    model.layers[0].set_weights([np.eye(2, dtype="float32")])
    opt = keras.optimizers.SGD(0.01)
    step = _step(model, info_nce, opt, compiled=False)
    x = np.array([[1.0, 0.0], [0.0, 0.5]], "float32")
    y = np.array([[0.8, 0.0], [0.95, 0.0]], "float32")
    loc = localize(step, x, y, model=model, optimizer=opt)
    o = loc["origin"]
    assert o["tf_op"] == "Exp" and o["line"] == L("# <negexp>"), o
    assert category(loc) == "exp_overflow"


@tf.custom_gradient
def unit_rows(x):
    y = x / tf.maximum(tf.norm(x, axis=1, keepdims=True), 1e-6)

    def grad(dy):
        return (dy - tf.reduce_sum(dy * y, axis=1, keepdims=True) * y) / tf.norm(x, axis=1, keepdims=True)  # <own>
    return y, grad


def test_a_backward_op_in_a_custom_gradient_is_born_at_its_own_line():
    """A tf.custom_gradient whose gradient divides by the row norm, a zero row (a dead ReLU row): the
    origin is the user's gradient function's line, judged on that division's own inputs."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, activation="relu", use_bias=False)])
    head = keras.layers.Dense(1)
    head.build((None, 3))
    opt = keras.optimizers.SGD(0.01)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((head(unit_rows(model(x))) - y) ** 2)
        vs = model.trainable_variables + head.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs))
        return loss
    x = np.array([[1.0, 2.0], [0.0, 0.0]], "float32")
    loc = localize(step, x, np.zeros((2, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "backward" and o["line"] == L("# <own>") and o.get("custom_backward"), o
    assert category(loc) == "div_by_zero"


# ----------------------------------------------------------------------------- sqrt_domain (backward)
def test_sqrt_backward_at_a_zero_distance_triplet_hinge():
    emb = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="embed")])
    opt = keras.optimizers.SGD(0.01)

    def step(xa, xp, xn):
        with tf.GradientTape() as tape:
            a, p, n = emb(xa, training=True), emb(xp, training=True), emb(xn, training=True)
            d_ap = tf.sqrt(tf.reduce_sum(tf.square(a - p), axis=-1))  # <sqrt-ap>
            d_an = tf.sqrt(tf.reduce_sum(tf.square(a - n), axis=-1))
            loss = tf.reduce_mean(tf.nn.relu(d_ap - d_an + 10.0))
        grads = tape.gradient(loss, emb.trainable_variables)
        opt.apply_gradients(zip(grads, emb.trainable_variables))
    rng = np.random.default_rng(2)
    xa = rng.normal(size=(4, 4)).astype("float32")
    xp = rng.normal(size=(4, 4)).astype("float32")
    xp[1] = xa[1]                                           # the positive is the anchor itself
    xn = rng.normal(size=(4, 4)).astype("float32")
    loc = localize(step, xa, xp, xn, model=emb, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "backward" and loc["sink"]["kind"] == "grad"
    assert o["stage"] == "backward" and o["forward_tf_op"] == "Sqrt" and o["forward_op"] == "sqrt"
    assert o["line"] == L("# <sqrt-ap>") and o["autograd_node"] == "SqrtGrad"
    assert loc["facts"]["sqrt_domain"]["zeros"] == 1 and loc["facts"]["where_trap"] is False
    assert category(loc) == "sqrt_domain"


# ----------------------------------------------------------------------------- trig_domain
class Angle(keras.layers.Layer):
    def call(self, x):
        return tf.concat([tf.acos(x[:, :1]), x[:, 1:]], axis=-1)  # <acos>


def test_trig_domain_acos_beyond_one():
    model = keras.Sequential([keras.Input((3,)), Angle(), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.array([[0.5, 1, 2], [1.5, 0, 1], [-0.2, 1, 1]], "float32")
    loc = localize(_step(model, _mse, opt), x, np.zeros((3, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert (o["tf_op"], o["layer"], o["line"]) == ("Acos", "angle", L("# <acos>"))
    assert loc["facts"]["trig_domain"]["abs_gt_1"] == 1 and o["samples"] == [1]
    assert category(loc) == "trig_domain"


# ----------------------------------------------------------------------------- mixed precision
class QuadraticFeatures(keras.layers.Layer):
    def call(self, inputs):
        squares = inputs * inputs  # <square>
        return tf.concat([inputs, squares], axis=-1)


def test_low_precision_overflow_float16_custom_layer():
    model = keras.Sequential([keras.Input((2,)), QuadraticFeatures(dtype="mixed_float16"),
                              keras.layers.Dense(1, dtype="float32")])
    opt = keras.optimizers.SGD(1e-6)
    x = np.array([[100.0, 3.0], [300.0, 4.0], [50.0, 1.0]], "float32")   # 300^2 = 90000 > 65504
    loc = localize(_step(model, _mse, opt), x, np.zeros((3, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "forward" and (o["tf_op"], o["dtype"]) == ("Mul", "float16")
    assert o["layer"] == "quadratic_features" and o["line"] == L("# <square>") and o["samples"] == [1]
    f32 = loc["facts"]["float32_check"]
    assert f32["direct_finite"] and f32["max_abs"] == pytest.approx(90000.0)
    assert category(loc) == "low_precision_overflow"


class LogProbs(keras.layers.Layer):
    def call(self, logits):
        p = tf.nn.softmax(logits)
        return tf.math.log(p + 1e-8)  # <fp16-log>


def test_low_precision_underflow_float16_log_of_softmax():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, dtype="mixed_float16", name="head"),
                              LogProbs(dtype="mixed_float16")])
    model.get_layer("head").set_weights([np.eye(3, dtype="float32") * 10, np.zeros(3, "float32")])
    opt = keras.optimizers.SGD(0.01)

    def nll(y, logp):
        return -tf.reduce_mean(tf.reduce_sum(y * tf.cast(logp, tf.float32), axis=-1))
    x = np.array([[2.0, 0.0, 0.0], [0.1, 0.2, 0.3]], "float32")       # exp(-20) = 2e-9: 0 in float16
    y = keras.utils.to_categorical([0, 1], 3).astype("float32")
    loc = localize(_step(model, nll, opt), x, y, model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "forward" and (o["tf_op"], o["dtype"], o["layer"]) == ("Log", "float16", "log_probs")
    assert o["line"] == L("# <fp16-log>")
    f32 = loc["facts"]["float32_check"]
    assert f32["chain_finite"] and not f32["direct_finite"] and "_softmax" in f32["chain_ops"]
    assert any(e["rounds_to_zero"] for e in loc["facts"]["eps_constants"])
    assert category(loc) == "low_precision_underflow"


class NormalizedRBF(keras.layers.Layer):
    def build(self, shape):
        self.centers = self.add_weight(shape=(4, shape[-1]), initializer="zeros")

    def call(self, x):
        d2 = tf.reduce_sum(tf.square(x[:, None, :] - self.centers[None]), axis=-1)
        phi = tf.exp(-d2)
        return phi / tf.reduce_sum(phi, axis=-1, keepdims=True)  # <rbf-div>


def test_a_normalized_rbf_whose_exp_underflows_in_float16_is_not_a_variance():
    # sum(exp(-sum((x - c) ** 2))): the sum of squares under the exp is a distance, not a variance (was:
    # variance_zero, "add an eps to the standard deviation")
    model = keras.Sequential([keras.Input((2,)), NormalizedRBF(dtype="mixed_float16", name="rbf"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.array([[0.1, 0.2], [4.0, 3.0], [0.3, 0.0]], "float32")   # exp(-25) = 1.4e-11: 0 in float16
    loc = localize(_step(model, _mse, opt), x, np.zeros((3, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert (o["tf_op"], o["dtype"], o["line"]) == ("RealDiv", "float16", L("# <rbf-div>")), o
    assert not loc["facts"]["zero_denominator"]["from_std_var"]
    assert loc["facts"]["float32_check"]["chain_finite"]
    assert category(loc) == "low_precision_underflow"


class Phase(keras.layers.Layer):
    def call(self, h):
        return tf.math.atan2(h[:, :3], h[:, 3:])  # <atan2>


def test_the_phase_of_a_zero_vector_is_a_backward_division_by_zero():
    # a learned transform's phase over a zero-padded frame: atan2(0, 0) = 0, TensorFlow's gradient
    # (x, -y) / (x^2 + y^2) divides by 0 (was: other, "its inputs sit on a pole"); PyTorch's is 0 there
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, use_bias=False), Phase(name="phase"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    x[3] = 0.0
    loc = localize(_step(model, _mse, opt), x, np.zeros((5, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "backward" and o["forward_tf_op"] == "Atan2", o
    assert o["line"] == L("# <atan2>")
    assert category(loc) == "div_by_zero"


def test_a_built_in_schedules_nan_rate_is_named_at_the_line_that_built_it():
    # CosineDecayRestarts with t_mul < 1: its cycles sum to a finite length, past which the schedule's own log
    # of a shrinking cycle is log(0) (was: the line of the step call that evaluated it)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    sched = keras.optimizers.schedules.CosineDecayRestarts(1e-2, 4, t_mul=0.5)  # <restarts>
    opt = keras.optimizers.Adam(sched)
    opt.build(model.trainable_variables)
    opt.iterations.assign(12)
    x = np.ones((4, 3), "float32")
    loc = localize(_step(model, _mse, opt), x, np.zeros((4, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "optimizer" and o["line"] == L("# <restarts>"), (loc["phase"], o)
    assert o.get("line_source") == "constructor_scan", o


# ----------------------------------------------------------------------------- masked_softmax, hand-written
class MaskedAttention(keras.layers.Layer):
    def call(self, q, k, keep):
        s = tf.matmul(q, k, transpose_b=True)
        s = tf.where(keep[:, None, :], s, -np.inf)
        return tf.nn.softmax(s, axis=-1)  # <att-softmax>


def _attention_model():
    q_in, k_in = keras.Input((2, 4)), keras.Input((3, 4))
    keep_in = keras.Input((3,), dtype="bool")
    att = MaskedAttention()(keras.layers.Dense(4)(q_in), k_in, keep_in)
    return keras.Model([q_in, k_in, keep_in], att)


def _attention_batch(all_masked_row):
    rng = np.random.default_rng(3)
    q = rng.normal(size=(3, 2, 4)).astype("float32")
    k = rng.normal(size=(3, 3, 4)).astype("float32")
    keep = np.array([[1, 1, 0], [1, 0, 0], [0, 1, 1]], bool)
    if all_masked_row is not None:
        keep[all_masked_row] = False
    return (q, k, keep), np.zeros((3, 2, 3), "float32")


def test_masked_softmax_all_keys_masked():
    model = _attention_model()
    opt = keras.optimizers.SGD(0.01)
    x, y = _attention_batch(all_masked_row=1)
    loc = localize(_step(model, _mse, opt), x, y, model=model, optimizer=opt)
    o = loc["origin"]
    assert (o["tf_op"], o["layer"], o["line"]) == ("Softmax", "masked_attention", L("# <att-softmax>"))
    assert loc["facts"]["softmax_all_masked_rows"]["count"] == 2 and o["samples"] == [1]
    assert category(loc) == "masked_softmax"


def test_partially_masked_attention_is_clean():
    model = _attention_model()
    opt = keras.optimizers.SGD(0.01)
    x, y = _attention_batch(all_masked_row=None)
    loc = localize(_step(model, _mse, opt), x, y, model=model, optimizer=opt)
    assert not loc["reproduced"] and loc["origin"] is None and loc["sink"]["kind"] is None


# ----------------------------------------------------------------------------- variance_zero
class Standardize(keras.layers.Layer):
    def call(self, x):
        mean = tf.reduce_mean(x, axis=-1, keepdims=True)
        return (x - mean) / tf.math.reduce_std(x, axis=-1, keepdims=True)  # <std-div>


def test_variance_zero_standardizing_a_constant_row():
    model = keras.Sequential([keras.Input((4,)), Standardize(), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.array([[1, 2, 3, 4], [5, 5, 5, 5], [0, 1, 0, 1]], "float32")   # row 1: std = 0
    loc = localize(_step(model, _mse, opt), x, np.zeros((3, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert (o["tf_op"], o["layer"], o["line"]) == ("RealDiv", "standardize", L("# <std-div>"))
    assert loc["facts"]["zero_denominator"]["from_std_var"] and o["samples"] == [1]
    assert category(loc) == "variance_zero"


# ----------------------------------------------------------------------------- where_gradient_trap
class LogFeatures(keras.layers.Layer):
    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        z = x * self.scale
        return tf.where(z > 0, tf.math.log(z), tf.zeros_like(z))  # <where-log>


def test_where_gradient_trap_log_of_zero_in_the_unselected_branch():
    model = keras.Sequential([keras.Input((3,)), LogFeatures(), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.array([[1.0, 2.0, 0.0], [0.5, 0.0, 3.0]], "float32")          # exact zeros: log(0) = -inf
    loc = localize(_step(model, _mse, opt), x, np.ones((2, 1), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "backward" and o["stage"] == "backward"
    assert o["forward_tf_op"] == "Log" and o["line"] == L("# <where-log>") and o["layer"] == "log_features"
    assert loc["facts"]["where_trap"] is True
    assert category(loc) == "where_gradient_trap"


class SafeLogFeatures(LogFeatures):
    def call(self, x):
        z = x * self.scale
        ok = z > 0
        return tf.where(ok, tf.math.log(tf.where(ok, z, tf.ones_like(z))), tf.zeros_like(z))


def test_safe_double_where_is_clean():
    model = keras.Sequential([keras.Input((3,)), SafeLogFeatures(), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.array([[1.0, 2.0, 0.0], [0.5, 0.0, 3.0]], "float32")
    loc = localize(_step(model, _mse, opt), x, np.ones((2, 1), "float32"), model=model, optimizer=opt)
    assert not loc["reproduced"] and loc["origins_seen"] == 0


def test_masked_log_of_an_input_without_gradient_is_clean():
    """log(0) appears in the forward but an unselected where branch hides it, and no gradient flows
    back through it (it is computed from the batch only): not an origin."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)

    def step(x, y):
        feats = tf.where(x > 0, tf.math.log(x), 0.0)
        with tf.GradientTape() as tape:
            loss = _mse(y, model(feats, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    x = np.array([[1.0, 0.0, 2.0]], "float32")
    loc = localize(step, x, np.ones((1, 1), "float32"), model=model, optimizer=opt)
    assert not loc["reproduced"] and loc["masked_nonfinite_origins"] == 1


# ----------------------------------------------------------------------------- data and parameters
def test_bad_input_data_names_the_batch_rows():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = np.ones((5, 3), "float32")
    x[3, 1] = np.nan
    loc = localize(_step(model, _mse, opt), x, np.zeros((5, 1), "float32"), model=model, optimizer=opt)
    pre = loc["preexisting"]
    assert loc["phase"] == "data" and pre["kind"] == "data" and pre["samples"] == [3]
    assert pre["rows_in_tensor"] == [3] and pre["stats"]["nan"] == 1
    assert category(loc) == "bad_input_data"


def test_param_corruption_names_the_variable_path():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    k, b = model.get_layer("hidden").get_weights()
    k[2, 1] = np.inf
    model.get_layer("hidden").set_weights([k, b])
    loc = localize(_step(model, _mse, opt), np.ones((2, 3), "float32"), np.zeros((2, 1), "float32"),
                   model=model, optimizer=opt)
    pre = loc["preexisting"]
    assert loc["phase"] == "params" and pre["kind"] == "param" and pre["name"] == model.get_layer("hidden").kernel.path == "sequential/hidden/kernel"
    assert pre["stats"]["posinf"] == 1
    assert category(loc) == "param_corruption"


# ----------------------------------------------------------------------------- optimizer
def test_optimizer_numerics_adam_with_zero_epsilon_on_a_zero_gradient():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="out")])
    opt = keras.optimizers.Adam(1e-3, epsilon=0.0)
    x = np.array([[1.0, 2.0, 0.0], [0.5, -1.0, 0.0]], "float32")          # feature 2 is always 0
    loc = localize(_step(model, _mse, opt), x, np.ones((2, 2), "float32"), model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "optimizer" and loc["sink"]["kind"] == "optimizer" and o["stage"] == "optimizer"
    assert model.get_layer("out").kernel.path in loc["sink"]["names"]
    assert loc["optimizer"]["optimizer"] == "Adam" and loc["optimizer"]["eps"] == 0.0
    assert category(loc) == "optimizer_numerics"


# ----------------------------------------------------------------------------- large but finite
def test_large_but_finite_values_are_clean():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(1e-32, momentum=0.9)

    def l1_kg(y, p):
        return tf.reduce_mean(tf.abs(p[:, 0] * 1.989e30 - y))
    x = np.random.default_rng(4).normal(size=(16, 3)).astype("float32")
    y = np.full(16, 3e30, "float32")
    loc = localize(_step(model, l1_kg, opt), x, y, model=model, optimizer=opt)
    assert not loc["reproduced"] and loc["origins_seen"] == 0 and loc["n_ops"] > 20


# ----------------------------------------------------------------------------- kl_misuse does not apply
def test_keras_kl_divergence_with_log_probability_targets_is_finite():
    """kl_misuse (PyTorch's F.kl_div fed log-probabilities as target) has no TensorFlow counterpart:
    keras.losses.KLDivergence clips both arguments to [eps, 1], so log-probability targets give a wrong
    but finite loss; the recorder must report nothing."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    opt = keras.optimizers.SGD(0.01)
    target_logp = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], "float32"))
    loc = localize(_step(model, keras.losses.KLDivergence(), opt), np.ones((2, 4), "float32"), target_logp,
                   model=model, optimizer=opt)
    assert not loc["reproduced"] and loc["origins_seen"] == 0


# ----------------------------------------------------------------------------- built-in loss
class MaskLogits(keras.layers.Layer):
    def call(self, logits, allowed):
        return tf.where(allowed, logits, -np.inf)


def test_op_inside_a_builtin_loss_is_named_by_the_loss_construction_line():
    """Constrained decoding: disallowed classes get -inf logits; a row with no allowed class makes the
    built-in cross-entropy's fused log-softmax NaN. The op is inside keras' loss, so the line is where
    that loss object was constructed."""
    x_in, a_in = keras.Input((4,)), keras.Input((3,), dtype="bool")
    model = keras.Model([x_in, a_in], MaskLogits()(keras.layers.Dense(3)(x_in), a_in))
    opt = keras.optimizers.SGD(0.01)
    xent = keras.losses.CategoricalCrossentropy(from_logits=True)  # <loss-ctor>
    allowed = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 1]], bool)       # row 1: nothing allowed
    y = keras.utils.to_categorical([0, 1, 2], 3).astype("float32")
    loc = localize(_step(model, xent, opt), (np.ones((3, 4), "float32"), allowed), y, model=model, optimizer=opt)
    o = loc["origin"]
    assert loc["phase"] == "forward" and o["tf_op"] == "SoftmaxCrossEntropyWithLogits"
    assert o["line"] == L("# <loss-ctor>") and o["line_source"] == "constructor" and o["layer"] is None
    assert loc["facts"]["softmax_all_masked_rows"]["batch_rows"] == [1]
    assert category(loc) == "masked_softmax"
