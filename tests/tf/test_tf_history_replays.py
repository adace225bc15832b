"""History replays on TensorFlow (issue 22/23's "fixes that are tested"): ``clip_replay`` (the steps
from a snapshot replayed with the gradients' global norm clipped, through the optimizer's own
``global_clipnorm``) and, for ``model.fit`` under recovery, ``lr_replay`` from the recovery snapshot
and the batches the fit kept, feeding ``cause.confirmed_by`` and ``cause.tested_fixes``."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
from nanguard.core.config import GuardConfig  # noqa: E402
from nanguard.core.experiments import Spec  # noqa: E402


def _bench_two_steps():
    """A tape step whose first update, unclipped, blows the weights up so that the second step's loss
    is non-finite; the bench holds both calls and the state before the first."""
    from nanguard.tensorflow.capture import StepCapture, variables_of
    from nanguard.tensorflow.experiments import KerasBench
    from nanguard.tensorflow.watch import TFWatcher
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(1e18)
    opt.build(model.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    batches = [(rng.normal(size=(8, 4)).astype("float32"), 100 * rng.normal(size=(8, 1)).astype("float32"))
               for _ in range(2)]
    w = TFWatcher(GuardConfig())
    w.models.add(model)
    cap = StepCapture(step=1, kind="fit", optimizer=opt, model=model, models=[model], watcher=w)
    cap.variables = variables_of([model], opt)
    cap.values = {k: np.array(v.numpy()) for k, v in cap.variables.items()}
    cap.inputs = ((batches[1][0], batches[1][1]), {})
    cap.step_fn = lambda inputs: step(*inputs[0], **inputs[1])
    history = {"calls": {0: (step, batches[0], {}), 1: (step, batches[1], {})}, "values": {0: dict(cap.values)}}
    return KerasBench(cap, history=history), opt, w


def test_clip_replay_clips_with_the_optimizers_own_global_clipnorm_and_leaves_it_as_it_was():
    bench, opt, w = _bench_two_steps()
    assert bench.snapshots() == [0]
    with w:
        clipped = bench.run(Spec("clip_replay", {"max_norm": 1.0, "from_step": 0, "to_step": 1}), 3.0)
        unclipped = bench.run(Spec("clip_replay", {"max_norm": 1e30, "from_step": 0, "to_step": 1}), 3.0)
    assert clipped.error is None and clipped.finite is True, clipped
    assert clipped.details["steps"] == 2 and len(clipped.details["losses"]) == 2
    assert unclipped.finite is False and unclipped.details["failed_at"] == 1, unclipped
    assert opt.global_clipnorm is None and opt.clipnorm is None       # the optimizer as it was
    for k, v in bench.cap.variables.items():                            # and the state
        np.testing.assert_array_equal(v.numpy(), bench.cap.values[k])


def test_fit_under_recovery_replays_a_lower_learning_rate_from_its_snapshot():
    import nanguard.keras
    from tf_helpers import diverging_sgd_fit
    cb = nanguard.keras.NanGuard(report=None, quiet=True, recover="auto", on_spike="warn")
    diverging_sgd_fit(cb)
    ev = [e for e in cb.report.events if not e.is_warning][0]
    assert ev.cause["category"] == "lr_too_high"
    exps = ev.cause["evidence"]["experiments"]
    lr = [e for e in exps if e["kind"] == "lr_replay"]
    assert lr and lr[0]["finite"] is True and lr[0]["params"]["from_step"] == ev.step - 1, exps
    assert (ev.cause.get("confirmed_by") or {}).get("kind") == "lr_replay"
    assert "lr_replay" not in (ev.cause["evidence"].get("experiments_unavailable") or [])
    tested = ev.cause["tested_fixes"][0]
    assert tested["kind"] == "lr_replay" and tested["passed"] and tested["steps"] == 2
    assert ev.recovery["action"].startswith("rollback+lr_backoff")
    assert ev.recovery["actions"]["lr_backoff"]["factor"] == pytest.approx(lr[0]["params"]["factor"])
