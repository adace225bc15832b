"""``model.fit`` under the guard (issue 23): recovery snapshots from a fit's first step, optimizer steps
counted across the whole script (fit calls, fine-tuning stages) with the fit call / epoch / step in the
event, a skipped step's loss kept out of fit's running mean, and the run-end line naming the first
failure. In-process (``run_tf``: ``nanguard run``'s runner), a few seconds each."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state, run_tf, write  # noqa: E402,F401

# A fit on NumPy arrays whose SGD step size is far too large for an unscaled feature: the loss grows
# ~1e10 per step from step 0 and overflows at step 4 (before any snapshot but the first one's).
EARLY_DIVERGENCE = '''
import numpy as np, keras
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
n = 512
x = np.stack([rng.random(n) * 2, rng.random(n) * 2000], 1).astype("float32")
y = (x @ np.array([[1.5], [0.001]]) + 2.0).astype("float32")
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss="mse")
losses = []
cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
model.fit(x, y, batch_size=64, epochs=4, verbose=0, shuffle=False, callbacks=[cb])
print("final", sum(losses[-5:]) / 5)
'''


def test_a_fit_diverging_in_its_first_steps_rolls_back_to_its_first_weights(tmp_path, capsys):
    code, rep = run_tf(tmp_path, write(tmp_path, EARLY_DIVERGENCE), recover="auto", localize=False)
    assert code == 0, rep and rep["events"][:1]
    rolls = [e["recovery"]["actions"]["rollback"] for e in rep["events"]
             if (e.get("recovery") or {}).get("actions", {}).get("rollback")]
    assert rolls, [e.get("recovery") for e in rep["events"]]
    first = min(rolls, key=lambda r: r["to_step"])
    assert first["to_step"] == 0
    # the first snapshot of the fit holds the model's weights (kernel 2x1 + bias, float32), not only
    # the optimizer's counter and the seed state
    assert first["snapshot_bytes"] >= 12 + 8, first
    final = float(capsys.readouterr().out.split("final")[1])
    assert math.isfinite(final), final
    assert rep["status"] == "recovered"


# Transfer learning: a head trained in one fit (12 steps), then the whole model fine-tuned in a second
# fit with a new optimizer; row 32 + 5 of the fine-tuning data holds a NaN (second batch: step 13).
TWO_FITS = '''
import numpy as np, keras
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(384, 8)).astype("float32")
y = x[:, :1] * 0.5
x_ft = x.copy()
x_ft[37, 3] = np.nan
base = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu")])
model = keras.Sequential([base, keras.layers.Dense(1)])
base.trainable = False
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
base.trainable = True
model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
model.fit(x_ft, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
'''


# the fine-tuning fit as tf.data users write it, two batches per train-function call
TF_DATA = ('model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", steps_per_execution=2)\n'
           'import tensorflow as tf\n'
           'model.fit(tf.data.Dataset.from_tensor_slices((x_ft, y)).batch(32), epochs=2, verbose=0)\n')


@pytest.mark.parametrize("shape", ["arrays", "tf.data+steps_per_execution"])
def test_steps_count_across_fit_calls_with_the_fit_position_in_the_event(tmp_path, shape):
    text = TWO_FITS
    if shape != "arrays":
        head, _, _ = text.partition('model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")')
        text = head + TF_DATA
    code, rep = run_tf(tmp_path, write(tmp_path, text), localize=False)
    assert code == 3
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (13, "data"), (ev["step"], ev["phase"])
    assert ev["detected"]["fit"] == {"call": 1, "epoch": 0, "step_in_epoch": 1, "step_in_fit": 1}
    assert rep["steps_watched"] == 14
    env = rep["environment"]   # the HTML's environment section: framework and its version recorded
    assert env["framework"] == "tensorflow" and env["framework_version"] == tf.__version__, env


# Two hand-written stages: a GradientTape loop with one optimizer for 5 steps, then the same model with a
# new optimizer (a fine-tuning stage); the second stage's third step sees a NaN batch.
TWO_STAGES = '''
import numpy as np, keras, tensorflow as tf
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
x = np.ones((8, 3), "float32")
def stage(opt, steps, bad=-1):
    for i in range(steps):
        xb = x.copy()
        if i == bad:
            xb[0, 0] = np.nan
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
stage(keras.optimizers.SGD(0.01), 5)
stage(keras.optimizers.Adam(1e-3), 4, bad=2)
'''


def test_a_new_optimizer_on_the_same_weights_continues_the_count(tmp_path):
    code, rep = run_tf(tmp_path, write(tmp_path, TWO_STAGES), localize=False)
    assert code == 3
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (7, "data"), (ev["step"], ev["phase"])
    assert "fit" not in ev["detected"]


# A NaN target in one batch of the first epoch: under recovery the step is skipped, and fit's printed
# running mean must not carry that step's NaN to the end of the epoch.
BAD_ROW = '''
import numpy as np, keras
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 4)).astype("float32")
y = x[:, :1] * 0.5
y[2 * 32 + 7, 0] = np.nan
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
printed = []
cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: printed.append(float(logs["loss"])))
model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
import json
print("printed", json.dumps(printed))
'''


def test_a_skipped_step_leaves_fits_running_mean(tmp_path, capsys):
    code, rep = run_tf(tmp_path, write(tmp_path, BAD_ROW), recover="auto", localize=False)
    assert code == 0 and rep["status"] == "recovered"
    assert [e["step"] for e in rep["events"]] == [2]
    printed = json.loads(capsys.readouterr().out.split("printed")[1])
    assert math.isnan(printed[2])   # the failing batch's own log (computed in the step)
    assert all(math.isfinite(v) for v in printed[3:]), printed  # the mean of the steps that trained


def test_the_callback_keeps_fits_running_mean_clean_too():
    from nanguard.keras import NanGuard
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = x[:, :1] * 0.5
    y[2 * 32 + 7, 0] = np.nan
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
    printed = []
    log = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: printed.append(float(logs["loss"])))
    guard = NanGuard(recover="auto", localize=False, quiet=True, report=None)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[guard, log])
    assert guard.report is not None and guard.report.status == "recovered"
    assert math.isnan(printed[2]) and all(math.isfinite(v) for v in printed[3:8]), printed
    assert math.isnan(printed[10]) and all(math.isfinite(v) for v in printed[11:]), printed



# mixed_float16: the MSE's gradient (targets ~5e4 left in watts) overflows float16 in the output Dense's
# backward at every loss scale the LossScaleOptimizer tries; float32 holds it
LSTM_WATTS = '''
import numpy as np, keras
keras.utils.set_random_seed(0)
keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 12, 3)).astype("float32")
y = (52000.0 + 3000.0 * x[:, -1, :1]).astype("float32")
model = keras.Sequential([keras.Input((12, 3)), keras.layers.LSTM(16), keras.layers.Dense(1, name="out")])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
printed = []
cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: printed.append(float(logs["loss"])))
model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
print("last", printed[-1], model.layers[-1].compute_dtype)
keras.mixed_precision.set_global_policy("float32")
'''


@pytest.mark.slow   # the failing step is localized by a re-run of the script in a child process
def test_a_float16_overflow_behind_an_lstm_is_named_and_recovered_by_a_float32_layer(tmp_path, capsys):
    """The cause is the float16 overflow (not the collapsing loss scale it drives) and recovery runs that
    layer in float32."""
    code, rep = run_tf(tmp_path, write(tmp_path, LSTM_WATTS), recover="auto")
    ev = rep["events"][0]
    assert ev["cause"]["category"] == "low_precision_overflow", (ev["cause"]["summary"], ev.get("localization"))
    assert "dtype=\"float32\"" in ev["fixes"][0] and "out" in ev["fixes"][0], ev["fixes"]
    ups = [e["recovery"]["actions"]["upcast"] for e in rep["events"]
           if "upcast" in ((e.get("recovery") or {}).get("actions") or {})]
    # recovery applies the upcast the replays passed: 'out' alone stays non-finite (the LSTM cell's float16
    # backward overflows too), the whole model in float32 is finite
    tested = {t["fix"]: t["passed"] for t in ev["cause"].get("tested_fixes") or []}
    want = "out" if any(f.endswith("out' in float32") and ok for f, ok in tested.items()) else "the whole model"
    assert ups and ups[0]["layer"] == want and ups[0]["dtype_after"] == "float32", (tested, [
        e.get("recovery") for e in rep["events"]])
    # the first fix names the scope that passed (core/experiments/reconcile.py), in Keras words
    passed = [t for t in ev["cause"]["tested_fixes"] if t["passed"] and t["kind"] == "upcast_module"]
    assert passed and passed[0]["fix_index"] == 0, ev["cause"]["tested_fixes"]
    scope = "run the whole model in float32" if want == "the whole model" else "run layer"
    assert ev["fixes"][0].startswith(scope) and "torch" not in ev["fixes"][0], ev["fixes"]
    last, dtype = capsys.readouterr().out.split("last")[1].split()
    assert code == 0 and rep["status"] == "recovered" and math.isfinite(float(last)) and dtype == "float32"
