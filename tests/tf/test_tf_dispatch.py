"""`nanguard run` picks the TensorFlow runner for TF/Keras scripts without importing either
framework first; `import nanguard` and the PyTorch backend never import TensorFlow."""
from __future__ import annotations

import subprocess
import sys

from nanguard.cli.run import script_backend


def test_script_backend_reads_the_imports(tmp_path):
    cases = {"import tensorflow as tf\n": "tensorflow", "import keras\n": "tensorflow",
             "from keras import layers\n": "tensorflow", "import torch\n": "torch",
             "import torch\nimport keras\n": "torch", "def f():\n    import tensorflow\n": "tensorflow",
             "print(1)\n": "torch", "this is not python(\n": "torch"}
    for i, (src, want) in enumerate(cases.items()):
        p = tmp_path / f"s{i}.py"
        p.write_text(src)
        assert script_backend(str(p)) == want, src


def test_no_tensorflow_import_on_the_pytorch_paths():
    code = ("import sys, nanguard, nanguard.cli.run, nanguard.cli.main, nanguard.pytorch.watch, "
            "nanguard.pytorch.guard; nanguard.Guard; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_torch_import_on_the_tensorflow_runner_until_the_script_runs(tmp_path):
    p = tmp_path / "s.py"
    # a Keras script (by its imports) that ends before importing keras: neither framework is imported
    p.write_text("import sys\nassert 'torch' not in sys.modules\nprint('ran')\nif False:\n    import keras\n")
    code = ("import sys; from nanguard.cli.main import main; "
            f"rc = main(['run', '--report', {str(tmp_path / 'r.json')!r}, {str(p)!r}]); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]; "
            "assert not bad, bad; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ran" in out.stdout
    import json
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["status"] == "unwatched" and "never imported" in rep["unwatched"]
