"""The JAX backend (Flax NNX and Linen, Equinox, plain JAX with optax) on the one engine.

Imports jax, optax and ``nanguard.core``, never torch, TensorFlow nor another backend; nothing here is
imported by ``import nanguard``.

* :mod:`.check`   the in-graph per-step check (one small flag vector per optimizer update);
* :mod:`.hooks`   the zero-code hooks (optax transforms, ``jax.value_and_grad``, ``jax.jit``);
* :mod:`.calls`   a guarded step call's inputs: the pre-step state, the pure function the replay runs;
* :mod:`.driver`  the host side: steps, phases, history, localization, the report;
* :mod:`.recover` recovery actions (in-graph skip, rollback by input substitution, lr backoff, clip);
* :mod:`.run`     ``nanguard run`` for JAX scripts;
* :mod:`.locate`  the replay of a failing step, primitive by primitive.

Explicit use, for a loop outside ``nanguard run``::

    with nanguard.jax.watch(report="r.json") as w:   # build the optimizer and jit the step inside
        tx = optax.adam(1e-3)
        step = jax.jit(train_step)
        ...
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

__all__ = ["watch"]


@contextlib.contextmanager
def watch(report: Optional[str] = "nanguard_report.json", on_nonfinite: str = "stop", *,
          recover: Any = None, localize: bool = True, strict: bool = False, quiet: bool = False,
          user_files: Any = (), on_spike: Optional[str] = None, experiments: Any = "auto") -> Iterator[Any]:
    """Guard the optax updates and jitted steps created inside the block (the hooks of ``nanguard run``).

    ``on_nonfinite="stop"``: the block ends with :class:`nanguard.NonFiniteError` (``err.report``) at the
    step call after the failing one; ``"warn"`` reports and carries on; ``recover="auto"``: the core
    recovery policy. ``user_files``: source files whose lines an origin may name (the caller's file is
    added). ``on_spike``: what an early warning does (``"warn"``, ``"skip"``, ``"rollback"``: :mod:`.spikes`;
    ``"warn"`` by default, with ``recover`` too). ``experiments``: the counterfactual replays that test a failure's
    cause (:mod:`.experiments`; ``"off"`` for none). Yields the driver (``.history``, ``.detections``); its ``.report`` is set at the end."""
    import inspect
    import os

    from ..core.config import GuardConfig
    from ..core.events import NonFiniteError
    from .driver import JaxDriver, StopRun

    caller = inspect.stack()[2].filename
    drv = JaxDriver(GuardConfig(on_nonfinite=on_nonfinite, strict=strict), os.path.abspath(caller),
                    recover=recover, localize=localize, quiet=quiet, user_files=list(user_files),
                    on_spike=on_spike, experiments=experiments)
    drv.install()
    stopped = False
    try:
        yield drv
    except StopRun:
        stopped = True
    finally:
        drv.uninstall()
        rep = drv.make_report()
        drv.report = rep
        if report:
            rep.write(report)
        if not quiet:
            from .run import _print_outcome
            _print_outcome(rep, report, drv)
        if not rep.steps_watched and not drv.disabled:
            import warnings
            warnings.warn("nanguard.jax.watch saw no optimizer update in its block: optax transformations are "
                          "hooked when they are built, so build the optimizer (optax.adam(...), nnx.Optimizer, "
                          "TrainState.create) and jit the step inside the block", RuntimeWarning, stacklevel=3)
    if stopped or drv.stopped:
        ev = next((e for e in rep.events if e.recovery is None), rep.first)
        raise NonFiniteError(rep, ev)
