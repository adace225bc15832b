"""Shared helpers for the TensorFlow/Keras backend's tests (skipped when tensorflow is absent).

Scripts are written to ``tmp_path`` and run in-process through
:func:`nanguard.tensorflow.run.run_tf_script` (TensorFlow is imported once per test session).
"""
from __future__ import annotations

import os
import runpy
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")  # the importing test module is skipped without it
keras = pytest.importorskip("keras")
try:  # the scripts the tests run in-process pin TensorFlow to one thread: its runtime starts that way (a
    # test that starts it first with the defaults would make their set_*_parallelism_threads(1) raise)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # already started
    pass

from ngtest import load_report  # noqa: E402  (tests/ngtest.py)

# A small regression trained four ways (MODE): an eager GradientTape loop, a @tf.function step,
# model.fit under `nanguard run` ("fit"), model.fit with the NanGuard callback ("fit_cb").
# CASE injects a failure at step BAD (argv), or nothing with BAD = -1. OUT: final weights (.npz).
SCRIPT = '''\
import sys
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
try:  # run in-process after another test started TensorFlow's runtime: its threads stay as they are
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:
    pass
MODE, BAD, CASE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
OUT = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
LIMIT = int(sys.argv[6]) if len(sys.argv) > 6 else None
STEPS = {steps}
rng = np.random.default_rng(0)
x = rng.normal(size=(32 * STEPS, 4)).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [0.3]]) + 0.1 * rng.normal(size=(32 * STEPS, 1))).astype("float32")
if LIMIT is not None:  # the same run, cut after LIMIT steps
    STEPS, x, y = LIMIT, x[:32 * LIMIT], y[:32 * LIMIT]
if CASE == "data" and BAD >= 0:
    x[32 * BAD + 3, 1] = np.nan
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dropout(0.1), keras.layers.Dense(1)])
opt = {opt}
flag_f = tf.Variable(0.0, trainable=False)
flag_b = tf.Variable(0.0, trainable=False)


def loss_fn(yt, yp):
    mse = tf.reduce_mean(tf.square(yp - yt))
    mse = tf.cond(flag_f > 0, lambda: mse * tf.math.log(-flag_f), lambda: mse)
    w = model.layers[0].kernel
    return tf.cond(flag_b > 0, lambda: mse + flag_b * tf.sqrt(tf.reduce_sum(tf.square(w - tf.stop_gradient(w)))),
                   lambda: mse)


def inject(step):
    flag_f.assign(1.0 if step == BAD and CASE == "forward" else 0.0)
    flag_b.assign(1.0 if step == BAD and CASE == "backward" else 0.0)
    if step == BAD and CASE == "params":
        k = model.layers[0].kernel
        k.assign(tf.tensor_scatter_nd_update(k, [[0, 0]], [float("nan")]))
    if step == BAD and CASE == "optimizer":
        opt.learning_rate.assign(float("inf"))


def step_body(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


train_step = tf.function(step_body) if MODE == "function" else step_body
try:
    if MODE in ("eager", "function"):
        for step in range(STEPS):
            inject(step)
            loss = train_step(x[32 * step:32 * step + 32], y[32 * step:32 * step + 32])
            print(f"step={{step}} loss={{float(loss):.6f}}")
    else:
        model.compile(optimizer=opt, loss=loss_fn)
        cbs = [keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: inject(b))]
        if MODE == "fit_cb":
            import nanguard.keras
            cbs.append(nanguard.keras.NanGuard(report=sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-"
                                               else None, quiet=True))
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=cbs)
    {after}
finally:  # also when nanguard stops the run: the weights as they are then
    if OUT:
        np.savez(OUT, *[v.numpy() for v in model.trainable_variables])
print("done")
'''


def script(tmp_path: Path, steps: int = 6, opt: str = "keras.optimizers.SGD(0.05)", after: str = "pass",
           name: str = "train_tf.py") -> str:
    p = Path(tmp_path) / name
    p.write_text(SCRIPT.format(steps=steps, opt=opt, after=after))
    return str(p)


def write(tmp_path: Path, text: str, name: str = "train_tf.py") -> str:
    p = Path(tmp_path) / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def run_tf(tmp_path: Path, script_path: str, args: Sequence[Any] = (), report: Optional[str] = None,
           **kw) -> Tuple[int, Optional[Dict[str, Any]]]:
    """``nanguard run`` (TensorFlow runner) in-process: (exit status, parsed report or None)."""
    from nanguard.tensorflow.run import run_tf_script
    report = report or str(Path(tmp_path) / "report.json")
    if os.path.exists(report):
        os.unlink(report)
    kw.setdefault("quiet", True)
    code = run_tf_script(script_path, [str(a) for a in args], report_path=report, **kw)
    return code, (load_report(report) if os.path.exists(report) else None)


def run_plain(script_path: str, args: Sequence[Any] = ()) -> None:
    old = sys.argv
    sys.argv = [script_path] + [str(a) for a in args]
    try:
        runpy.run_path(script_path, run_name="__main__")
    finally:
        sys.argv = old


def diverging_sgd_fit(callback: Any) -> Any:
    """A regression ``model.fit`` at SGD(3.0) that diverges to a non-finite loss within its first batches (a
    learning rate too high), run in this process with ``callback``; returns the model."""
    import numpy as np
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) * 3).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(3.0), loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    return model


def weights(path: str) -> list:
    import numpy as np
    with np.load(path) as z:
        return [z[k] for k in sorted(z.files, key=lambda s: int(s.split("_")[1]))]


def assert_same_weights(a: str, b: str) -> None:
    import numpy as np
    wa, wb = weights(a), weights(b)
    assert len(wa) == len(wb) and wa
    for i, (u, v) in enumerate(zip(wa, wb)):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert np.array_equal(u, v, equal_nan=True), f"variable {i} differs"


@pytest.fixture(autouse=True)
def _tf_state():
    """Scripts run in this process: keep TensorFlow/Keras global state from leaking between tests."""
    yield
    from nanguard.tensorflow import watch as W
    assert W.active() is None, "a TensorFlow watcher was left installed"
    keras.mixed_precision.set_global_policy("float32")
    tf.config.run_functions_eagerly(False)
    keras.backend.clear_session()
