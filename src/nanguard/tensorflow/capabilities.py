"""What the TensorFlow/Keras drivers implement (names: :mod:`nanguard.core.capabilities`; the table:
``docs/PARITY.md``). Imports no framework, so the parity test needs no TensorFlow.

Keras ``fit`` (``nanguard run``, the ``NanGuard`` callback) and a hand-written ``GradientTape`` loop
(eager or ``@tf.function``, under ``nanguard run`` or ``nanguard.keras.watch``) share the watcher,
the recovery actions (:class:`~.recover.KerasActions`) and the early warning (:mod:`.spikes`); they
differ in how a failing step is localized: a ``fit`` step is captured in-graph and replayed
in-process, a tape loop's step is the script's own code and is re-run in a child process.
"""
from __future__ import annotations

from ..core.capabilities import ON_SPIKE_CAPS, recovery_cap

__all__ = ["KERAS_FIT", "TAPE_LOOP", "DRIVERS"]

_SHARED = frozenset({"early_warning", *ON_SPIKE_CAPS, "recurrences", "replay_proof", "drop_samples_experiment",
                     "dataset_rows", "warning_fix_tested", "batch_assembly",
                     *(recovery_cap(a) for a in ("skip_step", "rollback", "lr_backoff", "clip", "upcast",
                                                 "drop_samples"))})

KERAS_FIT = _SHARED | {"replay_localization", "rerun_localization"}
TAPE_LOOP = _SHARED | {"rerun_localization"}

DRIVERS = {"Keras fit": KERAS_FIT, "TensorFlow tape loop": TAPE_LOOP}
