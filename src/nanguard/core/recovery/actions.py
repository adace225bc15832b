"""The interface between the recovery policy (here, framework-neutral) and a backend's actions.

The policy decides on plain numbers and records: the diagnosis, the step
history, the budget, the snapshots' steps and sizes. Everything that touches a
framework's objects (tensors, modules, optimizers, a loss scaler) is a method
of :class:`RecoveryActions`, which a backend implements once
(:class:`nanguard.pytorch.recover.actions.TorchActions` for PyTorch), bound to
the training objects of the failing step. A snapshot is the backend's too: the
policy only reads its ``step`` and ``nbytes`` and asks whether it is finite.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Dict, List, Optional, Protocol


class Snapshot(Protocol):
    """A backend's copy of the training state at the start of one step."""

    step: int
    nbytes: int  # bytes it holds (reported, and compared with ``recent_max_bytes``)

    def finite(self) -> bool:
        """Every floating value it holds is finite (computed once, then cached)."""

    def mark_finite(self) -> None:
        """It was just filled from a state that was checked finite."""


class RecoveryActions(abc.ABC):
    """What a backend does to its training objects for the policy (one instance per call).

    Records returned by the actions go into the report as they are (``recovery.actions``).
    """

    # -------------------------------------------------------------- the state
    @abc.abstractmethod
    def state_finite(self, with_optimizers: bool = True) -> bool:
        """Every parameter and buffer of the model(s) (and, ``with_optimizers``, every parameter the
        optimizers hold) is finite."""

    @abc.abstractmethod
    def optimizer_state_finite(self) -> bool:
        """Every floating tensor of the optimizers' per-parameter state (moments...) is finite."""

    # -------------------------------------------------------------- snapshots
    @abc.abstractmethod
    def take_snapshot(self, step: int, loss: Optional[float]) -> Snapshot:
        """A new snapshot of the state now, as the start of ``step`` (``loss``: the previous step's)."""

    @abc.abstractmethod
    def refill_snapshot(self, snap: Snapshot, step: int, loss: Optional[float]) -> bool:
        """Make ``snap`` the snapshot of the state now by copying into its own storage; False when the
        structure changed (``snap`` is then unusable)."""

    @abc.abstractmethod
    def restore(self, snap: Snapshot, rng: bool = True) -> Optional[Dict[str, Any]]:
        """Roll back: model, optimizer state (not its hyperparameters), loss scaler and, with ``rng``, the
        RNG as in ``snap``. ``rng=False`` leaves the RNG where the run is now, so a script that draws its
        batches from it moves on to new data instead of drawing the batches it rolled back from again.
        Returns what else was put back, for the rollback's record (None: nothing)."""

    @abc.abstractmethod
    def repair_nonfinite(self, snap: Snapshot) -> int:
        """Put back only the non-finite elements of the parameters/buffers from ``snap``; how many, or -1
        when one has no finite saved value."""

    @abc.abstractmethod
    def restore_buffers(self, snap: Snapshot) -> int:
        """Put back the buffers (normalisation statistics) from ``snap``; how many."""

    # -------------------------------------------------------------- actions on a failure
    @abc.abstractmethod
    def skip_step(self) -> Dict[str, Any]:
        """Make the coming update a no-op (drop the gradients). Record: ``{"grads_dropped": n}``."""

    @abc.abstractmethod
    def learning_rates(self) -> List[float]:
        """The current learning rate of every param group."""

    def learning_rate_peaks(self) -> List[float]:
        """The highest rate each param group's schedule reaches in the coming steps (a warm-up's peak),
        in :meth:`learning_rates`' order; by default the current rates (no schedule known)."""
        return self.learning_rates()

    def rate_stuck(self) -> Optional[str]:
        """Why a non-finite learning rate of now stays non-finite at every coming update a skipped step leads to,
        when that is known (a schedule evaluated apart); None when it may come back finite or cannot be told."""
        return None

    @abc.abstractmethod
    def lr_backoff(self, factor: float) -> Dict[str, Any]:
        """Scale every learning rate (and the schedulers' base rates) by ``factor``.
        Record: ``{"lr_before": [...], "lr_after": [...], "factor": f}``."""

    @abc.abstractmethod
    def upcast(self, module: Optional[str], on_downstream: Callable[[str], None]) -> Optional[Dict[str, Any]]:
        """Run the module at path ``module`` in float32 from now on (None: no such module). Modules
        further down that then receive float32 are upcast when that happens, calling
        ``on_downstream(path)``. Record: ``{"dtype_before", "dtype_after", "module", "downstream"}``."""

    def drop_samples(self, rows: List[int]) -> Optional[Dict[str, Any]]:
        """Re-run the failing step without batch ``rows`` and keep its gradients for the update (instead of
        skipping the batch). None when the backend cannot (the batch is then skipped). Record:
        ``{"rows": [...], "kept_rows": n, "loss": x}``."""
        return None

    def exclude_rows(self, rows: List[int]) -> Optional[Dict[str, Any]]:
        """Keep dataset ``rows`` (proven bad by a drop-samples replay) out of every later batch of the run,
        each time saying so. Record: ``{"rows": [...], "how": ...}``; None where the backend cannot (the
        rows are then only quarantined on the record, and a batch that draws one again fails again)."""
        return None

    def scales_update(self) -> bool:
        """The backend lowers the step size by scaling the optimizer's update in the step (JAX), so
        :meth:`lr_backoff` works even when no learning rate can be read (an optax schedule inside a chain);
        False: with no rate read, the policy scales the gradients of a hand-written update instead."""
        return False

    def can_raise_beta2(self) -> bool:
        """An optimizer of the run has betas that :meth:`raise_beta2` can set (False: not in this backend)."""
        return False

    def raise_beta2(self, beta2: float, optimizer: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """Set the second-moment decay (Adam's ``betas[1]``) of every param group that has one to ``beta2``,
        from now on (``optimizer``: only the optimizer of that history index; None: all of them). None when
        the backend cannot or no optimizer has betas. Record: ``{"beta2_before": [...], "beta2_after": [...],
        "optimizers": [...]}``."""
        return None

    def replay_beta2(self, from_step: int, to_step: int, *, steps: int, beta2: float,
                     optimizer: Optional[int] = None) -> Dict[str, Any]:
        """:meth:`replay_kept` with every (``optimizer``'s) ``betas[1]`` set to ``beta2`` instead of a learning-rate
        factor: the replay that tests :meth:`raise_beta2` before it is applied (same result dict)."""
        return {"unavailable": "this backend does not replay kept steps with another beta2"}

    def replay_kept(self, from_step: int, to_step: int, *, steps: int, lr_factor: Optional[float] = None,
                    max_norm: Optional[float] = None) -> Dict[str, Any]:
        """Replay the kept steps ``from_step..to_step`` (cycled to ``steps`` steps, updates included) from the
        state now (a snapshot of ``from_step`` just restored), every learning rate times ``lr_factor`` and the
        gradient norm clipped at ``max_norm``, and put the state back (:mod:`.tried`). Returns ``{"finite":
        bool | None, "replays": n, "losses": [...], "failed_at": step | None, "error": ...}``, or
        ``{"unavailable": why}`` when this backend cannot."""
        return {"unavailable": "this backend does not replay kept steps"}

    @abc.abstractmethod
    def can_loss_scale(self) -> bool:
        """The run has optimizers and no framework loss scaler of its own (GradScaler)."""

    # -------------------------------------------------------------- every update, once armed
    @abc.abstractmethod
    def clip_gradients(self, max_norm: float) -> None:
        """Clip the global gradient norm of every optimizer's parameters at ``max_norm``."""

    @abc.abstractmethod
    def unscale_gradients(self, factor: float) -> None:
        """Multiply every gradient by ``factor`` (the policy's own loss scale, undone before the check)."""
