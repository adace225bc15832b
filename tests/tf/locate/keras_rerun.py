"""A minimal re-run child for Keras scenario scripts (test harness for the op recorder).

``python keras_rerun.py SCRIPT STEP OUT.json`` runs SCRIPT with every ``tf.function`` executed
eagerly, counts optimizer updates the way the scenarios count steps (each outermost
``optimizer.apply`` call is one attempt, skipped LossScaleOptimizer steps included), arms a
:class:`nanguard.tensorflow.locate.TFRecorder` (its own tape/optimizer hooks) when step STEP begins
(right after update STEP-1), stops it after update STEP, writes ``result()`` to OUT.json and exits.

This is what part A's ``nanguard run`` re-run child does for TensorFlow, reduced to what the recorder
needs; it lets the recorder be checked end to end on the scenario scripts before that lands.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import time


def main() -> None:
    script, step, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    from nanguard.core.jsonio import json_safe
    from nanguard.tensorflow.locate import TFRecorder, install_construction_hook

    install_construction_hook()
    tf.config.run_functions_eagerly(True)
    state = {"count": 0, "depth": 0, "rec": None, "t0": None}

    def arm() -> None:
        rec = TFRecorder(hooks=True, run_eagerly=True)
        state["rec"], state["t0"] = rec, time.time()
        rec.start()

    def finish() -> None:
        rec = state["rec"]
        rec.stop()
        res = rec.result()
        res["seconds"] = round(time.time() - state["t0"], 3)
        with open(out, "w") as fh:
            json.dump(json_safe(res), fh)
        sys.stdout.flush()
        os._exit(0)

    def wrap(cls):
        orig = cls.__dict__["apply"]

        def apply(opt, grads, trainable_variables=None):
            if state["depth"]:
                return orig(opt, grads, trainable_variables)
            state["depth"] += 1
            try:
                return orig(opt, grads, trainable_variables)
            finally:
                state["depth"] -= 1
                state["count"] += 1
                if state["count"] == step:
                    arm()
                elif state["count"] == step + 1 and state["rec"] is not None:
                    finish()
        cls.apply = apply

    wrap(BaseOptimizer)
    wrap(LossScaleOptimizer)
    if step == 0:
        arm()
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    if state["rec"] is not None:   # the script ended inside the armed step
        finish()
    with open(out, "w") as fh:
        json.dump({"error": f"the script made {state['count']} updates, step {step} never ran"}, fh)


if __name__ == "__main__":
    main()
