"""``nanguard run`` for JAX scripts (Flax NNX or Linen, Equinox, plain JAX with optax): the script runs
as ``__main__`` under the JAX hooks (:mod:`.hooks`).

Same contract as the other runners: exit status 0 / the script's own status when nanguard did not stop
it, ``3`` when nanguard stopped the run at a non-finite value, ``2`` for a usage error; the report is
written however the script ends. jax and optax are imported before the script runs (that starts no
XLA backend, so the script's own ``XLA_FLAGS`` still apply).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, List, Optional

from ..core.config import GuardConfig
from ..core.exitcodes import EXIT_NONFINITE, EXIT_USAGE
from ..core.outputs import absolute
from ..core.render.html import html_target
from ..core.render.terminal import print_line
from ..core.reportsink import open_run_report
from ..core.script import close_run, run_to_end


def run_jax_script(script: str, args: List[str], *, report_path: Optional[str] = "nanguard_report.json",
                   on_nonfinite: str = "stop", recover: Optional[str] = None, localize: bool = True,
                   strict: bool = False, quiet: bool = False, bundle: Optional[str] = None,
                   tensorboard: Optional[str] = None, html: Optional[str] = "auto",
                   on_spike: Optional[str] = None, experiments: Any = "auto") -> int:
    """Run a JAX ``script`` as ``__main__`` under the guard; write the report however it ends.
    ``experiments``: the counterfactual replays of a failing step (:mod:`nanguard.jax.experiments`)."""
    if not os.path.isfile(script):
        print(f"nanguard: no such script: {script}", file=sys.stderr)
        return EXIT_USAGE
    script_abs = os.path.abspath(script)
    page_path = absolute(html_target(report_path, html))
    try:
        sink = open_run_report(script=script_abs, report=report_path, html=page_path, extra={"framework": "jax"})
    except OSError as e:
        print(f"nanguard: {e}", file=sys.stderr)
        return EXIT_USAGE
    from .driver import JaxDriver, StopRun
    drv = JaxDriver(GuardConfig(on_nonfinite=on_nonfinite, strict=strict), script_abs, recover=recover,
                    localize=localize, quiet=quiet, on_spike=on_spike, experiments=experiments)
    if not quiet:
        mode = "recover" if recover else on_nonfinite
        spike = f"; on spike: {drv.on_spike}" if drv.on_spike != "warn" else ""
        print_line(f"watching {os.path.basename(script)} (on non-finite: {mode}{spike}; report: {report_path})")
    t0 = time.time()
    owner = os.getpid()

    def finish(outcome: Any) -> int:
        """The run's end: at the script's end, or inside its ``os._exit`` (``run_to_end``)."""
        drv.uninstall()
        if os.getpid() != owner:
            return outcome.code

        def build() -> Any:
            report = drv.make_report(run_seconds=time.time() - t0)
            outcome.stopped = outcome.stopped or drv.stopped
            return report

        code = close_run(build, outcome, sink=sink, report_path=report_path, page_path=page_path, quiet=quiet,
                         strict=strict, show=lambda report: _print_outcome(report, report_path, drv))
        if code is not None:
            return code
        if outcome.stopped or (drv.stopped and not drv.recovering):
            return EXIT_NONFINITE
        return outcome.code

    drv.install()
    return run_to_end(script, list(args), lambda e: isinstance(e, StopRun), finish, drv.uninstall)


def _print_outcome(report: Any, report_path: Optional[str], drv: Any) -> None:
    from ..core.render.terminal import print_outcome
    print_outcome(report, report_path, drv.recovery)
