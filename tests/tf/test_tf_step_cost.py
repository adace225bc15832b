"""TensorFlow/Keras cost (issues 23 and 25), counted rather than timed: the Keras callback has no per-batch
hook (no Python call per batch; Keras' batch-end dispatch is left as it is) and still stops fit at the
failing step; the check's slow paths are built with few ops (one float64
sum of squares per tensor gives both the exact flag and the norm) and the capture of a failing fit step
has no ``tf.cond`` of its own; a healthy ``nanguard run`` of a Keras script loads no diagnosis,
experiments or op recorder module."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import nanguard.keras as nk  # noqa: E402
from nanguard.tensorflow import detect as D  # noqa: E402
from test_tf_trace_cost import _data, _model  # noqa: E402  (a 4-8-1 Adam model, 64 rows)


def test_the_callback_has_no_per_batch_hook_and_still_stops_fit_at_the_failing_step(tmp_path):
    from keras.src.utils import python_utils
    cb = nk.NanGuard(report=str(tmp_path / "r.json"), quiet=True)
    # what Keras checks before dispatching batch ends off the training thread (on backends that allow it)
    assert all(python_utils.is_default(getattr(cb, h)) for h in (
        "on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end"))

    x, y = _data(bad_row=16 + 5)   # batch 1 of 4
    model = _model()
    steps = []
    counter = keras.callbacks.Callback()
    counter.on_train_batch_begin = lambda b, logs=None: steps.append(b)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[cb, counter])
    assert cb.stopped
    assert steps == [0, 1]   # fit's loop ended right after the failing step (else 2 epochs of 4 batches)
    assert (cb.report.events[0].step, cb.report.events[0].phase) == (1, "data")


def _tf_functions(fn, depth: int = 3) -> list:
    """The ``tf.function``s behind Keras' train function (a Python closure over them)."""
    if hasattr(fn, "_list_all_concrete_functions_for_serialization"):
        return [fn]
    out: list = []
    for cell in (getattr(fn, "__closure__", None) or ()) if depth > 0 else ():
        try:
            out += _tf_functions(cell.cell_contents, depth - 1)
        except ValueError:   # an empty cell
            pass
    return out


def _if_ops(fn) -> int:
    cfs = [cf for f in _tf_functions(fn) for cf in f._list_all_concrete_functions_for_serialization()]
    assert cfs
    seen, n, stack = set(), 0, [cf.graph for cf in cfs[:1]]
    while stack:
        g = stack.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        n += sum(1 for o in g.get_operations() if o.type in ("If", "StatelessIf"))
        stack += [f.graph for f in getattr(g, "_functions", {}).values() if getattr(f, "graph", None) is not None]
    return n


def test_the_traced_check_adds_three_conds_and_the_capture_none_of_its_own(tmp_path):
    x, y = _data()
    plain = _model()
    plain.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    n_plain = _if_ops(plain.train_function)
    guarded = _model()
    cb = nk.NanGuard(report=None, quiet=True)   # localize on: the failing-step capture is built
    fns = []
    probe = keras.callbacks.Callback()
    probe.on_train_end = lambda logs=None: fns.append(guarded.train_function)
    guarded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[probe, cb])
    # before the update (fast/slow), the update itself, after it (fast/slow); the capture's py_function
    # sits in the slow path's branch with no cond of its own (before: a fourth)
    assert _if_ops(fns[0]) - n_plain == 3
    for a, b in zip(plain.get_weights(), guarded.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_sq64_flags_are_exact_and_its_norm_is_the_float64_norm(dtype):
    big = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1e200}[dtype]
    finite = tf.constant([big, -big, 1.0, 0.0], dtype)   # its squares overflow its own dtype
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = tf.constant([1.0, bad, 2.0], dtype)
        ok, _ = D.exact64([finite, t])
        assert not bool(ok.numpy())
        marks, _ = D.sq64([finite, t])
        assert [bool(tf.math.is_finite(m).numpy()) for m in marks] == [True, False]
    ok, norm = D.exact64([finite, tf.constant([3.0, 4.0], dtype)])
    assert bool(ok.numpy())
    if dtype == "float64":
        assert np.isinf(norm.numpy())   # the squares of 1e200 overflow float64 too: inf, yet flagged finite
    else:
        want = np.sqrt(np.sum(np.square(np.concatenate([finite.numpy().astype(np.float64), [3.0, 4.0]]))))
        assert norm.numpy() == pytest.approx(want, rel=1e-12)


HEALTHY = """
    import numpy as np, keras
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, x.sum(1, keepdims=True), batch_size=16, epochs=2, verbose=0)
"""

PROBE = """
import json, sys
from nanguard.tensorflow.run import run_tf_script
code = run_tf_script(sys.argv[1], [], report_path=sys.argv[2], quiet=True)
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules if m.startswith("nanguard"))}))
"""


@pytest.mark.slow
def test_a_healthy_keras_run_loads_no_failure_only_module(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HEALTHY))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    p = subprocess.run([sys.executable, "-c", PROBE, str(script), str(tmp_path / "r.json")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["code"] == 0
    mods = out["modules"]
    assert "nanguard.tensorflow.watch" in mods   # it did watch the script
    loaded = [m for m in mods if m.startswith(("nanguard.core.diagnosis", "nanguard.core.experiments",
                                               "nanguard.core.recovery", "nanguard.tensorflow.experiments",
                                               "nanguard.tensorflow.recover", "nanguard.tensorflow.locate.recorder",
                                               "nanguard.tensorflow.capture", "nanguard.tensorflow.replay"))]
    assert loaded == []
