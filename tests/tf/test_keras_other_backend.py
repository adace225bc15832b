"""Keras 3 on its JAX backend (``KERAS_BACKEND=jax`` set by the script): nanguard's Keras hooks are TensorFlow's, so
nothing is checked. The run is reported ``unwatched`` with the reason, never ``clean`` (it was, with one bogus step
watched, while every loss the script printed was NaN); the explicit callback warns and reports the same."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("jax")

SCRIPT = '''
import os
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
import keras
{extra}
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32") * 1e3
y = np.zeros((64, 1), "float32")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation="exponential")])
model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=16, epochs=1, verbose=0{callbacks})
print("backend", keras.backend.backend())
'''


def test_nanguard_run_says_a_keras_on_jax_run_was_not_watched(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(extra="", callbacks=""))
    rep = tmp_path / "r.json"
    out = subprocess.run([sys.executable, "-m", "nanguard", "run", "--report", str(rep), "--no-html", "--no-bundle",
                          str(script)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "backend jax" in out.stdout
    data = json.loads(rep.read_text())
    assert data["status"] == "unwatched" and data["steps_watched"] == 0, data
    assert "jax backend" in data["unwatched"] and "KERAS_BACKEND=tensorflow" in data["unwatched"]
    assert "not watching" in out.stderr


def test_the_callback_on_a_keras_on_jax_fit_warns_and_reports_unwatched(tmp_path):
    script = tmp_path / "train.py"
    rep = tmp_path / "r.json"
    script.write_text(SCRIPT.format(extra="import warnings\nimport nanguard.keras",
                                    callbacks=f", callbacks=[nanguard.keras.NanGuard(report={str(rep)!r})]"))
    out = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NanGuard watches Keras on TensorFlow only" in out.stderr
    data = json.loads(rep.read_text())
    assert data["status"] == "unwatched" and "jax backend" in data["unwatched"]
