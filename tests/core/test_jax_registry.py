"""`nanguard run` hands a JAX script (jax, flax, optax or equinox imported) to the JAX backend, decided from
the script's imports without importing any framework; the options that backend does not take are named."""
from __future__ import annotations

import sys

from nanguard.cli.backends import backend_for, by_name, split_options


def test_a_script_importing_jax_flax_optax_or_equinox_goes_to_the_jax_backend(tmp_path):
    for line in ("import jax", "from flax import nnx", "import optax", "import equinox as eqx",
                 "import flax.linen as nn\nimport numpy as np"):
        script = tmp_path / "train.py"
        script.write_text(line + "\n")
        assert backend_for(str(script)).name == "jax", line
    b = by_name("jax")
    assert b.runner == "nanguard.jax.run:run_jax_script" and b.framework == "jax"


def test_the_jax_backend_names_the_options_it_does_not_take():
    taken, note = split_options(by_name("jax"), {"report_path": "r.json", "recover": "auto", "bundle": "b.zip",
                                                 "on_spike": "skip"})
    assert taken == {"report_path": "r.json", "recover": "auto", "on_spike": "skip"}  # early warnings are taken
    assert note and "bundle" in note and "jax" in note


def test_choosing_the_backend_imports_no_framework(tmp_path):
    import subprocess
    script = tmp_path / "train.py"
    script.write_text("import jax\nimport optax\n")
    code = ("import sys; from nanguard.cli.backends import backend_for; b = backend_for(sys.argv[1]);"
            "print(b.name, sorted(m for m in ('jax', 'flax', 'optax', 'torch', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(script)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "jax []"
