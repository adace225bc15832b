"""Start-up cost of ``nanguard run``: whole-process time over the plain script.

Runs a short healthy PyTorch script and a short Keras script (written to a temporary folder) as
``python SCRIPT`` and as ``python -m nanguard run SCRIPT``, interleaved (plain, guarded, plain, ...)
so that a load change on the machine hits both alike, and prints the medians and the median of the
paired differences (guarded - plain) per framework, in wall time and in CPU time (user + system of
the process and its threads: steadier than wall time on a busy machine). The target (issue 25) is
<= 0.5 s each. ``keras_cnn`` is a keras.io-style convnet trained for 3 epochs with ``fit`` (issue 23:
``nanguard run`` <= 1.05x the plain script as a whole process): its line prints the ratio.

    python -m benchmarks.startup                 # all three, 15 pairs each (5 for keras_cnn)
    python -m benchmarks.startup --repeats 25 --only torch
    python -m benchmarks.startup --only keras_cnn --threads 1
    python -m benchmarks.startup --json out.json

No framework is imported here: every run is a fresh process.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

TORCH_SCRIPT = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for _ in range(20):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
print(f"loss {loss.item():.4f}")
"""

KERAS_SCRIPT = """\
import numpy as np
import keras
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
y = x.sum(1, keepdims=True)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
print(f"loss {hist.history['loss'][-1]:.4f}")
"""

KERAS_CNN_SCRIPT = """\
import numpy as np
import keras
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.random((2048, 28, 28, 1)).astype("float32")
y = rng.integers(0, 10, 2048)
L = keras.layers
model = keras.Sequential([keras.Input((28, 28, 1)), L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(),
                          L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(), L.Flatten(), L.Dropout(0.5),
                          L.Dense(10, activation="softmax")])
model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
hist = model.fit(x, y, batch_size=128, epochs=3, validation_split=0.1, verbose=0)
print(f"loss {hist.history['loss'][-1]:.4f}")
"""

SCRIPTS = {"torch": ("train_torch.py", TORCH_SCRIPT), "keras": ("train_keras.py", KERAS_SCRIPT),
           "keras_cnn": ("train_keras_cnn.py", KERAS_CNN_SCRIPT)}
REPEATS = {"torch": 15, "keras": 15, "keras_cnn": 5}   # pairs per script by default


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _time(cmd: List[str], cwd: str, env: Dict[str, str]) -> Tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``cmd`` (runs are sequential: the CPU delta is its own)."""
    c0, t0 = _cpu(), time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt, dc = time.perf_counter() - t0, _cpu() - c0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return dt, dc


def measure(kind: str, repeats: int, folder: str, threads: int = 0) -> Dict[str, object]:
    name, text = SCRIPTS[kind]
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    # Byte-code as an installed package has it: compiled once (by the warm-up runs) and reused, in a
    # cache of our own (PYTHONDONTWRITEBYTECODE would make every run compile nanguard from source).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(folder, "pycache")
    if threads:  # one compute thread: CPU time then reads as wall time would on an idle machine
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TF_NUM_INTRAOP_THREADS=str(threads), TF_NUM_INTEROP_THREADS=str(threads))
    plain_cmd = [sys.executable, path]
    guarded_cmd = [sys.executable, "-m", "nanguard", "run", "--report", os.path.join(folder, "r.json"), path]
    _time(plain_cmd, folder, env), _time(guarded_cmd, folder, env)  # warm the file cache
    plain: List[Tuple[float, float]] = []
    guarded: List[Tuple[float, float]] = []
    for _ in range(repeats):
        plain.append(_time(plain_cmd, folder, env))
        guarded.append(_time(guarded_cmd, folder, env))
    out: Dict[str, object] = {"script": kind, "repeats": repeats, "threads": threads or "default"}
    for i, what in ((0, "wall"), (1, "cpu")):
        p, g = [x[i] for x in plain], [x[i] for x in guarded]
        out[f"{what}_plain_median_s"] = round(statistics.median(p), 3)
        out[f"{what}_guarded_median_s"] = round(statistics.median(g), 3)
        out[f"{what}_overhead_median_s"] = round(statistics.median([b - a for a, b in zip(p, g)]), 3)
        out[f"{what}_ratio_median"] = round(statistics.median([b / a for a, b in zip(p, g)]), 3)
    return out


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="pairs per script (default: 15; 5 for keras_cnn)")
    ap.add_argument("--only", choices=sorted(SCRIPTS), default=None)
    ap.add_argument("--threads", type=int, default=0, help="compute threads of torch/TensorFlow in both runs "
                    "(0: their default); 1 makes the CPU time steady on a loaded machine")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="nanguard-startup-") as folder:
        for kind in ([a.only] if a.only else list(SCRIPTS)):
            n = a.repeats or REPEATS[kind]
            r = measure(kind, n, folder, a.threads)
            out.append(r)
            for what in ("wall", "cpu"):
                print(f"{kind:6s} {what:4s} plain {r[what + '_plain_median_s']:.3f} s  nanguard run "
                      f"{r[what + '_guarded_median_s']:.3f} s  over the plain script: "
                      f"{r[what + '_overhead_median_s']:+.3f} s, x{r[what + '_ratio_median']:.3f} "
                      f"(median of {n} pairs; load {os.getloadavg()[0]:.1f})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
