"""What the PyTorch drivers implement (names: :mod:`nanguard.core.capabilities`; the table:
``docs/PARITY.md``). Imports no framework, so the parity test needs no torch.

The explicit :class:`~.guard.Guard` owns the step (model, batch, loss function): it replays it
in-process, re-runs it without rows for ``drop_samples``, and has no script to re-run.
``nanguard run`` watches the script's own code: the step tape replays a failing step in-process
(the script is re-run in a child process when the tape cannot), and a failing batch is skipped,
not re-run without its rows.
"""
from __future__ import annotations

from ..core.capabilities import ON_SPIKE_CAPS, RECOVERY_CAPS, recovery_cap

__all__ = ["GUARD", "RUN", "DRIVERS"]

_SHARED = frozenset({"early_warning", *ON_SPIKE_CAPS, "replay_proof", "drop_samples_experiment", "dataset_rows",
                     "recurrences", "replay_localization", "warning_fix_tested"})

GUARD = _SHARED | set(RECOVERY_CAPS)
RUN = _SHARED | (set(RECOVERY_CAPS) - {recovery_cap("drop_samples")}) | {"rerun_localization", "rows_kept_out",
                                                                         "clip_order", "zero_grad_missing",
                                                                         "batch_assembly"}

DRIVERS = {"Guard": GUARD, "nanguard run (PyTorch)": RUN}
