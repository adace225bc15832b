"""The early warning on TensorFlow/Keras (nanguard.tensorflow.spikes): a Keras ``fit`` and a custom
GradientTape loop whose learning-rate warm-up peaks too high warn before their first NaN; healthy Keras
runs never warn; ``on_spike`` skip and rollback do what they say, in eager and traced steps, under
``nanguard run``, the Keras callback and ``nanguard.keras.watch``."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state, assert_same_weights, run_plain, run_tf, script, write  # noqa: E402,F401
from ngtest import load_report  # noqa: E402
from nanguard.core.config import GuardConfig  # noqa: E402
from nanguard.tensorflow.driver import RunDriver  # noqa: E402

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios_keras"

# A regression MLP trained with model.fit; the learning rate warms up linearly over 40 steps to PEAK
# (a LearningRateSchedule), SGD with momentum. Peak 0.1 is past the stability limit: the loss blows up a
# few steps after the warm-up ends and overflows to NaN. HOW: "run" (nanguard run) or "callback" (the
# NanGuard callback, ON_SPIKE).
WARMUP_FIT = '''\
import sys
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
PEAK, HOW = float(sys.argv[1]), sys.argv[2]
ON_SPIKE = sys.argv[4] if len(sys.argv) > 4 else None
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 16)).astype("float32")
w = rng.normal(size=(16, 1)).astype("float32")
y = (x @ w + 0.1 * rng.normal(size=(2048, 1))).astype("float32")


class Warmup(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, peak, steps):
        self.peak, self.steps = peak, steps

    def __call__(self, step):
        return self.peak * tf.minimum(1.0, (tf.cast(step, tf.float32) + 1.0) / self.steps)


model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(Warmup(PEAK, 40), momentum=0.9), loss="mse")
losses = []
cbs = [keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(logs["loss"]))]
if HOW == "callback":
    import nanguard.keras
    cbs.append(nanguard.keras.NanGuard(report=sys.argv[3], quiet=True, on_nonfinite="warn", on_spike=ON_SPIKE))
model.fit(x, y, batch_size=64, epochs=4, shuffle=True, verbose=0, callbacks=cbs)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
'''

# A custom GradientTape loop (eager, or a @tf.function step) on a small convnet over synthetic images:
# SGD with momentum, the learning rate warmed up by hand (optimizer.learning_rate.assign each step) over
# 30 steps to PEAK; at 2.0 the loss grows geometrically from about step 26 and overflows at step 46.
WARMUP_TAPE = '''\
import sys
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
PEAK, MODE = float(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 8, 8, 1)).astype("float32")
y = (x.mean(axis=(1, 2, 3)) * 8.0 + 0.1 * rng.normal(size=1024)).astype("float32")[:, None]
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
opt = keras.optimizers.SGD(learning_rate=0.0, momentum=0.9)


def step_body(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


train_step = tf.function(step_body) if MODE == "function" else step_body
losses = []
for step in range(96):
    opt.learning_rate.assign(PEAK * min(1.0, (step + 1) / 30))
    i = (step * 32) % 1024
    losses.append(float(train_step(x[i:i + 32], y[i:i + 32])))
    print(f"step={step} loss={losses[-1]:.6g}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
'''


def _warnings(rep):
    return [e for e in rep["events"] if e.get("kind") == "warning"]


def _failures(rep):
    return [e for e in rep["events"] if e.get("kind") != "warning"]


def _lead(rep):
    """(first warning step, first non-finite step): the warning must come first."""
    warns, fails = _warnings(rep), _failures(rep)
    assert warns, f"no early warning (status {rep['status']})"
    assert fails, "the run was expected to reach a non-finite value"
    return min(e["step"] for e in warns), min(e["step"] for e in fails)


def test_a_fit_whose_warmup_peak_is_too_high_warns_before_the_first_nan(tmp_path):
    path = write(tmp_path, WARMUP_FIT, "warmup_fit.py")
    code, rep = run_tf(tmp_path, path, [0.1, "run"], on_nonfinite="stop", localize=False)
    warned, first_nan = _lead(rep)
    assert warned < first_nan  # measured: warning at step 47, first NaN at step 50
    w = _warnings(rep)[0]
    assert w["phase"] == "any" and w["cause"]["category"] == "lr_too_high" and w["recovery"] is None
    assert "kind" not in rep["events"][0] and rep["status"] == "nonfinite"  # the failure comes first


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_tape_loop_whose_warmup_peak_is_too_high_warns_before_the_first_nan(tmp_path, mode):
    path = write(tmp_path, WARMUP_TAPE, "warmup_tape.py")
    code, rep = run_tf(tmp_path, path, [2.0, mode], on_nonfinite="stop", localize=False)
    warned, first_nan = _lead(rep)
    assert warned < first_nan  # measured: warning at step 31, first NaN at step 46
    assert _warnings(rep)[0]["cause"]["category"] == "lr_too_high"


@pytest.mark.parametrize("name", sorted(p.name for p in SCENARIOS.glob("clean_*.py")))
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_healthy_keras_scenarios_never_warn(tmp_path, name):
    code, rep = run_tf(tmp_path, str(SCENARIOS / name), [])
    assert code == 0 and rep["steps_watched"] > 0
    assert rep["status"] == "clean" and rep["events"] == []


@pytest.mark.parametrize("mode", ["eager", "function", "fit"])
def test_a_healthy_regression_never_warns_and_trains_bit_for_bit_with_on_spike_rollback(tmp_path, mode):
    # on_spike rollback keeps per-step snapshots and a scalable learning rate: none of it may change
    # what a healthy run computes
    path = script(tmp_path, steps=40)
    run_plain(path, [mode, -1, "none", tmp_path / "plain.npz"])
    code, rep = run_tf(tmp_path, path, [mode, -1, "none", tmp_path / "guarded.npz"], on_spike="rollback")
    assert code == 0 and rep["steps_watched"] == 40
    assert rep["status"] == "clean" and rep["events"] == []
    assert_same_weights(str(tmp_path / "plain.npz"), str(tmp_path / "guarded.npz"))


# ------------------------------------------------------------------ on_spike, step by step

def _spike_run(graph: bool, on_spike: str, spike_at: int = 14, steps: int = 20):
    """A healthy regression whose batch ``spike_at`` has its targets scaled x1e3 (a loss spike, every
    value finite), trained under a RunDriver. Returns (report, weights before/after each step)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05)

    def body(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = tf.function(body) if graph else body
    drv = RunDriver(GuardConfig(on_nonfinite="warn"), localize=False, quiet=True, on_spike=on_spike)
    drv.install()
    states = []
    try:
        for i in range(steps):
            xb = rng.normal(size=(32, 4)).astype("float32")
            yb = (xb @ np.array([[1.0], [-2.0], [0.5], [0.3]], "float32"))
            if i == spike_at:
                yb = yb * 1e3
            before = [v.numpy().copy() for v in model.trainable_variables]
            step(xb, yb)
            states.append((before, [v.numpy().copy() for v in model.trainable_variables]))
    finally:
        drv.uninstall()
    rep = drv.make_report()
    return rep, states


def _same(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("graph", [False, True])
def test_on_spike_warn_applies_the_spiking_update(graph):
    rep, states = _spike_run(graph, "warn")
    (w,) = rep.warnings
    assert w.step == 14 and w.recovery is None and rep.status == "warning"
    before, after = states[14]
    assert not _same(before, after)


@pytest.mark.parametrize("graph", [False, True])
def test_on_spike_skip_drops_the_spiking_update(graph):
    rep, states = _spike_run(graph, "skip")
    (w,) = rep.warnings
    assert w.step == 14 and w.recovery["action"] == "skip_step" and rep.status == "recovered"
    before, after = states[14]
    assert _same(before, after)  # the weights after the warning step are those before it
    assert not _same(*states[15])  # and training goes on
    rec = w.recovery["actions"]["skip_step"]
    if graph:  # the update ran in the traced step: the state of its start was put back
        assert rec["update_undone"] and rec["restored_from_step"] == 14
    else:  # eager: read before the update, which is not run
        assert rec["grads_dropped"] == 4
    assert {h["step"]: h for h in rep.history}[14]["skipped"] is True


@pytest.mark.parametrize("graph", [False, True])
def test_on_spike_rollback_goes_back_to_before_the_excursion(graph):
    rep, states = _spike_run(graph, "rollback")
    (w,) = rep.warnings
    rec = w.recovery
    assert w.step == 14 and rec is not None and rec["ok"] and "rollback" in rec["action"]
    to = rec["actions"]["rollback"]["to_step"]
    assert to < 14
    # the weights after the warning step are those at the start of step `to`
    assert _same(states[14][1], states[to][0])


def test_the_keras_callback_takes_on_spike_and_rolls_back_a_diverging_fit(tmp_path, capsys):
    path = write(tmp_path, WARMUP_FIT, "warmup_fit.py")
    report = tmp_path / "cb.json"
    run_plain(path, [0.1, "callback", report, "rollback"])
    rep = load_report(report)
    final = float(capsys.readouterr().out.strip().splitlines()[-1].split("=")[1])
    (w,) = _warnings(rep)
    assert w["recovery"]["action"].startswith("rollback") and "lr_backoff" in w["recovery"]["action"]
    assert _failures(rep) == [] and rep["status"] == "recovered"
    # unguarded, the loss is NaN from step 50 on (and starts near 30). The schedule's peak is cut to half the rate
    # at which the loss left its best level (0.055 -> 0.0275): still converging at the end (epoch losses 14.7, 4.4,
    # 1.7, 1.0); a peak of 0.044 (half the rate at which the weights' growth began) stalled near 28
    assert math.isfinite(final) and final < 1.5


def test_nanguard_run_on_spike_reaches_a_tensorflow_script(tmp_path):
    # cli.run used to print "--on-spike is not supported for TensorFlow scripts yet" and drop it
    from nanguard.cli.run import run_script
    path = write(tmp_path, WARMUP_FIT, "warmup_fit.py")
    report = tmp_path / "r.json"
    code = run_script(path, ["0.1", "run"], report_path=str(report), quiet=True, html=None, on_spike="skip",
                      localize=False)
    rep = load_report(report)
    (w,) = _warnings(rep)[:1]
    assert w["recovery"]["action"] == "skip_step" and w["recovery"]["actions"]["skip_step"]["update_undone"]
    assert code == 3  # skipping one step does not cure a learning rate past the limit: it still overflows
