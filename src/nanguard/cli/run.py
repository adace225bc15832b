"""``nanguard run``: pick the backend for a script and run it there.

Exit status: the script's own when nanguard did not stop it (0, the ``sys.exit``
code, 1 for an uncaught exception, 130 for Ctrl-C); ``3`` when nanguard stopped
the run at a non-finite value; ``2`` for a usage error (no such script).
"""
from __future__ import annotations

import os
import sys
from typing import Any, List, Optional

from ..core.exitcodes import EXIT_USAGE
from . import backends


def run_script(script: str, args: List[str], *, report_path: Optional[str] = "nanguard_report.json",
               on_nonfinite: str = "stop", recover: Optional[str] = None, localize: bool = True,
               strict: bool = False, quiet: bool = False, bundle: Optional[str] = None,
               tensorboard: Optional[str] = None, html: Optional[str] = "auto", experiments: Any = "auto",
               on_spike: Optional[str] = None) -> int:
    """Run ``script`` as ``__main__`` under the guard of its framework; write the report however it ends.

    ``html``: the HTML page of a run that had an event, ``"auto"`` beside the JSON report, a path,
    or None for none. ``experiments``: the counterfactual replays (every backend; see
    :class:`nanguard.core.experiments.ExperimentConfig`). The backend is chosen from the script's imports by the
    registry in :mod:`.backends`; each imports its framework only then, so a TensorFlow user needs no
    torch and the reverse.
    """
    if not os.path.isfile(script):
        print(f"nanguard: no such script: {script}", file=sys.stderr)
        return EXIT_USAGE
    return backends.run(script, args, report_path=report_path, on_nonfinite=on_nonfinite, recover=recover,
                        localize=localize, strict=strict, quiet=quiet, bundle=bundle, tensorboard=tensorboard,
                        html=html, experiments=experiments, on_spike=on_spike)


def script_backend(script: str) -> str:
    """The name of the backend ``nanguard run`` picks for ``script`` (:mod:`.backends`)."""
    return backends.backend_for(script).name
