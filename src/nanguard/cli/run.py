"""``nanguard run``: pick the backend for a script and run it there.

Exit status: the script's own when nanguard did not stop it (0, the ``sys.exit``
code, 1 for an uncaught exception, 130 for Ctrl-C); ``3`` when nanguard stopped
the run at a non-finite value; ``2`` for a usage error (no such script).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
from typing import Any, List, Optional

from ..core.exitcodes import EXIT_USAGE

_TF_NAMES = {"tensorflow", "keras", "tf_keras"}


def run_script(script: str, args: List[str], *, report_path: Optional[str] = "nanguard_report.json",
               on_nonfinite: str = "stop", recover: Optional[str] = None, localize: bool = True,
               strict: bool = False, quiet: bool = False, bundle: Optional[str] = None,
               tensorboard: Optional[str] = None, html: Optional[str] = "auto", experiments: Any = "auto",
               on_spike: Optional[str] = None) -> int:
    """Run ``script`` as ``__main__`` under the guard of its framework; write the report however it ends.

    ``html``: the HTML page of a run that had an event, ``"auto"`` beside the JSON report, a path,
    or None for none. ``experiments``: the counterfactual replays (PyTorch; see
    :class:`nanguard.core.experiments.ExperimentConfig`). A TensorFlow/Keras script goes to :mod:`nanguard.tensorflow.run`, anything
    else to :mod:`nanguard.pytorch.run` (see :func:`script_backend`); each imports its framework only
    then, so a TensorFlow user needs no torch and the reverse.
    """
    if not os.path.isfile(script):
        print(f"nanguard: no such script: {script}", file=sys.stderr)
        return EXIT_USAGE
    kw = dict(report_path=report_path, on_nonfinite=on_nonfinite, recover=recover, localize=localize,
              strict=strict, quiet=quiet, bundle=bundle, tensorboard=tensorboard, html=html)
    if script_backend(script) == "tensorflow":
        from ..tensorflow.run import run_tf_script
        if on_spike not in (None, "warn"):
            print("nanguard: --on-spike is not supported for TensorFlow scripts yet (warnings only)", file=sys.stderr)
        return run_tf_script(script, args, **kw)
    from ..pytorch.run import run_torch_script
    return run_torch_script(script, args, experiments=experiments, on_spike=on_spike, **kw)


def script_backend(script: str) -> str:
    """``"tensorflow"`` for a script that imports tensorflow/keras and not torch (read from its
    import statements, without importing anything), or when torch is not installed; else ``"torch"``."""
    names = set()
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=script)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.partition(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.partition(".")[0])
    except (OSError, SyntaxError, ValueError):
        pass
    if names & _TF_NAMES and "torch" not in names:
        return "tensorflow"
    if importlib.util.find_spec("torch") is None and importlib.util.find_spec("tensorflow") is not None:
        return "tensorflow"
    return "torch"
