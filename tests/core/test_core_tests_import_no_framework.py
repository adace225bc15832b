"""tests/core runs without PyTorch or TensorFlow: collecting it (the root conftest, any tests/core
conftest and every tests/core module, other helpers included) imports neither framework."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torch", "tensorflow", "keras")

PROBE = '''\
import json, os, sys


def pytest_collection_finish(session):
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
    files = sorted({str(item.path) for item in session.items})
    with open(os.environ["CORE_PROBE_OUT"], "w") as f:
        json.dump({"frameworks": loaded, "files": files}, f)
''' % (FRAMEWORKS,)


def test_collecting_tests_core_imports_neither_torch_nor_tensorflow(tmp_path):
    (tmp_path / "core_import_probe.py").write_text(PROBE)
    out = tmp_path / "probe.json"
    env = dict(os.environ, CORE_PROBE_OUT=str(out),
               PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "core_import_probe", "tests/core"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    probe = json.loads(out.read_text())
    assert probe["frameworks"] == [], probe
    assert str(Path(__file__).resolve()) in probe["files"]  # the probe saw this folder's modules
