"""What a driver can do: the capability names, declared once (the rows of ``docs/PARITY.md``).

Each backend declares, in a module that imports no framework, the set of these names each of its
drivers implements (:mod:`nanguard.pytorch.capabilities`: ``Guard`` and ``nanguard run``;
:mod:`nanguard.tensorflow.capabilities`: Keras ``fit`` and a ``GradientTape`` loop), as
``DRIVERS = {column label: frozenset of names}``. ``tests/core/test_parity.py`` checks the table in
``docs/PARITY.md`` against those sets (a "yes" cell is a declared name, a "no" cell gives its reason)
and the backends' tests exercise cells for real.
"""
from __future__ import annotations

from typing import Dict

from .recovery.table import ACTIONS

__all__ = ["CAPABILITIES", "ON_SPIKE_CAPS", "RECOVERY_CAPS", "recovery_cap"]


def recovery_cap(action: str) -> str:
    """The capability name of recovery action ``action`` (one of ``core.recovery.table.ACTIONS``)."""
    return f"recover_{action}"


ON_SPIKE_CAPS = ("on_spike_warn", "on_spike_skip", "on_spike_rollback")
RECOVERY_CAPS = tuple(recovery_cap(a) for a in ACTIONS)

#: capability name -> its row label in docs/PARITY.md, in table order
CAPABILITIES: Dict[str, str] = {
    "early_warning": "early warning (a loss / gradient-norm spike or growth before any NaN)",
    "on_spike_warn": "--on-spike warn",
    "on_spike_skip": "--on-spike skip",
    "on_spike_rollback": "--on-spike rollback",
    "warning_fix_tested": "a warning's fix tested without --recover",
    **{recovery_cap(a): f"recovery: {a}" for a in ACTIONS},
    "replay_proof": "replay proof (confirmed_by)",
    "drop_samples_experiment": "drop-samples experiment",
    "dataset_rows": "dataset rows named",
    "rows_kept_out": "a bad dataset row kept out of later batches (--recover)",
    "recurrences": "recurrences folded",
    "clip_order": "a gradient clip placed before backward named in a divergence's fix",
    "zero_grad_missing": "an optimizer stepping with zero_grad never called named in a divergence's fix",
    "batch_assembly": "bad input data made as the batch is assembled (the dataset's items are finite): the "
                      "function that made it named (a collate_fn, a tf.data map)",
    "replay_localization": "localization by in-process replay",
    "rerun_localization": "localization by re-run (child process)",
    "child_process_training": "training in child processes (torch.multiprocessing workers, Hogwild)",
}
