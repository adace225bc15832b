"""What the JAX driver implements (names: :mod:`nanguard.core.capabilities`; the table: ``docs/PARITY.md``).
Imports no framework, so the parity test needs no JAX.

``nanguard run`` and ``nanguard.jax.watch`` share one driver: in-graph detection next to the optax
update, localization by an in-process replay of the failing step call (primitive by primitive), and
counterfactual replays of that call proving the cause (:mod:`.experiments`); recovery by an in-graph skip, a
rollback by input substitution, a learning-rate backoff and clipping; the early warning on the same per-step
vector (:mod:`.spikes`).
"""
from __future__ import annotations

from ..core.capabilities import ON_SPIKE_CAPS, recovery_cap

__all__ = ["JAX_RUN", "DRIVERS"]

JAX_RUN = frozenset({"recurrences", "replay_localization", "early_warning", *ON_SPIKE_CAPS, "warning_fix_tested",
                     "replay_proof", "drop_samples_experiment",
                     *(recovery_cap(a) for a in ("skip_step", "rollback", "lr_backoff", "clip"))})

DRIVERS = {"JAX (run / watch)": JAX_RUN}
