"""A test double for the op-level recorder (``NANGUARD_TF_RECORDER=tf_fake_recorder:make``): it
implements the recorder interface of ``nanguard.tensorflow.capture`` without looking at ops, and
writes what the replay showed it (stages, losses, gradient finiteness, the capture) to the JSON
file named by ``FAKE_RECORDER_OUT``, so tests can check the replay machinery on its own."""
from __future__ import annotations

import json
import math
import os

import numpy as np


class FakeRecorder:
    def __init__(self, capture) -> None:
        self.apply_update = False
        self.stages = []
        self.losses = []
        self.grads_finite = []
        self.started = self.stopped = False
        self.cap = {"kind": capture.kind, "step": capture.step,
                    "n_values": len(capture.values), "n_variables": len(capture.variables),
                    "n_seeds": len(capture.seeds),
                    "has_inputs": capture.inputs is not None}

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def set_stage(self, stage: str) -> None:
        if not self.stages or self.stages[-1] != stage:
            self.stages.append(stage)

    def mark_loss(self, t) -> None:
        a = np.asarray(t.numpy(), dtype=np.float64)
        self.losses.append(float(a.reshape(-1)[0]) if a.size == 1 else float("nan") if not np.isfinite(a).all()
                           else float(a.sum()))

    def mark_grads(self, grads, sources) -> None:
        for g in grads:
            if g is None:
                continue
            v = getattr(g, "values", g)
            self.grads_finite.append(bool(np.isfinite(np.asarray(v.numpy())).all()))

    def result(self) -> dict:
        bad_loss = any(not math.isfinite(x) for x in self.losses)
        bad_grad = not all(self.grads_finite)
        out = {"stages": self.stages, "losses": [repr(x) for x in self.losses], "grads_finite": self.grads_finite,
               "started": self.started, "stopped": self.stopped, "capture": self.cap,
               "apply_update": self.apply_update}
        path = os.environ.get("FAKE_RECORDER_OUT")
        if path:
            with open(path, "w") as f:
                json.dump(out, f)
        return {"reproduced": bad_loss or bad_grad, "phase": "forward" if bad_loss else "backward",
                "origin": None, "preexisting": None, "facts": {}, "n_ops": 0, "notes": ["fake recorder"],
                "sink": {"kind": "loss" if bad_loss else "grad", "names": []}}


def make(capture):
    return FakeRecorder(capture)
