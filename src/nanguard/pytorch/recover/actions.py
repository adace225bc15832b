"""The PyTorch side of recovery: :class:`TorchActions` carries out the policy's decisions on the
model(s), optimizer(s) and GradScaler of one step (see :class:`nanguard.core.recovery.RecoveryActions`)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...core.recovery import RecoveryActions
from ..gradscaler import scaler_enabled
from ..rng import capture_rng, restore_rng
from .betas import beta2_for_replay, raise_beta2, with_betas
from .clip import clip_grads
from .focus import focused
from .loss_scale import unscale_grads
from .loose import hand_params
from .lr_backoff import HeldRates, learning_rates, lr_backoff, scale_grads, schedule_peaks, stuck_schedule
from .skip import skip_step
from .snapshot import Snapshot
from .state import optimizer_state_finite, state_finite
from .upcast import find_modules, upcast_downstream, upcast_module


class TorchActions(RecoveryActions):
    """Recovery actions on PyTorch training objects.

    ``modules``: the models whose state is checked, snapshotted and rolled back;
    ``roots``: where the origin module (a path as in ``named_modules()``) is looked up;
    ``hooks``: where the handles of the hooks an upcast installs are kept;
    ``drop``: re-runs the failing step without some batch rows, keeping its gradients (the driver's,
    when it can replay the step: :meth:`nanguard.Guard.drop_samples_fn`);
    ``held``: where the learning-rate cuts are held against a script's own per-step rates;
    ``replayer``: replays the driver's kept steps (:meth:`replay_kept`; an early warning's, before its
    change is applied), None where the driver keeps none;
    ``exclude``: keeps dataset rows out of every later batch (``nanguard run``'s DataLoader hooks), None
    where the driver has none.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any], scaler: Any = None,
                 roots: Sequence[torch.nn.Module] = (), hooks: Optional[List[Any]] = None,
                 drop: Optional[Callable[[List[int]], Optional[Dict[str, Any]]]] = None,
                 held: Optional[HeldRates] = None, replayer: Optional[Callable[..., Dict[str, Any]]] = None,
                 exclude: Optional[Callable[[List[int]], Optional[Dict[str, Any]]]] = None) -> None:
        self.modules, self.optimizers, self.roots = list(modules), list(optimizers), list(roots)
        self.exclude = exclude
        self.replayer = replayer
        self.held = held if held is not None else HeldRates()
        self.scaler = scaler
        self.hooks = hooks if hooks is not None else []
        self.drop = drop
        self.opt_index: Dict[int, int] = {}  # id(optimizer) -> the history's index of it (the driver's monitor)
        self.focus: Optional[List[int]] = None  # the history indices of the optimizers the diagnosis names (focus.py)
        self.carried: Optional[Callable[[int], Optional[Dict[str, Any]]]] = None  # the driver's carried state
        # the driver's loss code run in float32 (nanguard run's step tape), for an op outside every module
        self.loss_code: Optional[Callable[[], Optional[Dict[str, Any]]]] = None

    # -------------------------------------------------------------- the state
    def state_finite(self, with_optimizers: bool = True) -> bool:
        return state_finite(self.modules, self.optimizers if with_optimizers else ())

    def optimizer_state_finite(self) -> bool:
        return optimizer_state_finite(self.optimizers)

    # -------------------------------------------------------------- snapshots
    def take_snapshot(self, step: int, loss: Optional[float]) -> Snapshot:
        return Snapshot(step, self.modules, self.optimizers, self.scaler, loss)

    def refill_snapshot(self, snap: Snapshot, step: int, loss: Optional[float]) -> bool:
        return snap.refill(step, self.modules, self.optimizers, self.scaler, loss)

    def restore(self, snap: Snapshot, rng: bool = True) -> Optional[Dict[str, Any]]:
        live = None if rng else capture_rng(plain=False)
        snap.restore(self.modules, self.optimizers, self.scaler)
        if live is not None:
            restore_rng(live)
        # the state the script carries between calls (a detached hidden state): handed back at the next call
        return self.carried(snap.step) if self.carried is not None else None

    def repair_nonfinite(self, snap: Snapshot) -> int:
        return snap.repair_nonfinite(self.modules)

    def restore_buffers(self, snap: Snapshot) -> int:
        return snap.restore_buffers(self.modules)

    # -------------------------------------------------------------- actions on a failure
    def skip_step(self) -> Dict[str, Any]:
        return skip_step(self.optimizers, self.modules)

    def _lr_optimizers(self) -> List[Any]:
        """Whose learning rates a cut changes: the optimizer the diagnosis names, else every one."""
        return focused(self.optimizers, self.opt_index, self.focus)

    def learning_rates(self) -> List[float]:
        return learning_rates(self._lr_optimizers())

    def learning_rate_peaks(self) -> List[float]:
        return schedule_peaks(self._lr_optimizers())

    def rate_stuck(self) -> Optional[str]:
        return stuck_schedule(self.optimizers)

    def lr_backoff(self, factor: float) -> Dict[str, Any]:
        opts = self._lr_optimizers()
        rec = lr_backoff(opts, factor)
        if len(opts) < len(self.optimizers):
            rec["optimizers"] = list(self.focus or [])  # the history indices of those cut (the others keep theirs)
        held = self.held.cut(opts, factor)
        if held:
            rec["held"] = held
        return rec

    def upcast(self, module: Optional[str], on_downstream: Callable[[str], None]) -> Optional[Dict[str, Any]]:
        mods = find_modules(self.roots, module)
        if not mods:  # an op outside every module: the loss code, where the driver can run it in float32
            return self.loss_code() if module is None and self.loss_code is not None else None
        rec = dict(upcast_module(mods[0], self.optimizers), module=module, downstream=[])
        for mod in mods[1:]:  # the other roots of the type a root's name stands for (a dual encoder's towers)
            upcast_module(mod, self.optimizers)
        for mod in mods:
            self.hooks.extend(upcast_downstream(self.roots, mod, self.optimizers, rec, on_downstream))
        if len(mods) > 1:
            rec["modules"] = len(mods)
        return rec

    def replay_kept(self, from_step: int, to_step: int, *, steps: int, lr_factor: Optional[float] = None,
                    max_norm: Optional[float] = None) -> Dict[str, Any]:
        if self.replayer is None:
            return {"unavailable": "no steps kept to replay (experiments off)"}
        if not self.optimizers:
            return {"unavailable": "no optimizer to replay the updates with (hand-written updates)"}
        if self.scaler is not None and scaler_enabled(self.scaler):
            return {"unavailable": "a GradScaler's steps are not replayed"}
        opts = self._lr_optimizers()
        only = {"lr_only": opts} if lr_factor is not None and len(opts) < len(self.optimizers) else {}
        return self.replayer(from_step, to_step, steps=steps, lr_factor=lr_factor, max_norm=max_norm, **only)

    def can_raise_beta2(self) -> bool:
        return bool(with_betas(self.optimizers))

    def raise_beta2(self, beta2: float, optimizer: Optional[int] = None) -> Optional[Dict[str, Any]]:
        return raise_beta2(with_betas(self.optimizers, self.opt_index, optimizer), beta2)

    def replay_beta2(self, from_step: int, to_step: int, *, steps: int, beta2: float,
                     optimizer: Optional[int] = None) -> Dict[str, Any]:
        with beta2_for_replay(with_betas(self.optimizers, self.opt_index, optimizer), beta2):
            return self.replay_kept(from_step, to_step, steps=steps)

    def drop_samples(self, rows: List[int]) -> Optional[Dict[str, Any]]:
        return self.drop(rows) if self.drop is not None else None

    def exclude_rows(self, rows: List[int]) -> Optional[Dict[str, Any]]:
        return self.exclude(rows) if self.exclude is not None else None

    def can_loss_scale(self) -> bool:
        return bool(self.optimizers) and not (self.scaler is not None and scaler_enabled(self.scaler))

    # -------------------------------------------------------------- every update, once armed
    def clip_gradients(self, max_norm: float) -> None:
        if self.optimizers:
            clip_grads(self.optimizers, max_norm)
        else:  # hand-written updates: the watched modules' gradients
            params = hand_params(self.modules)
            if params:
                torch.nn.utils.clip_grad_norm_(params, max_norm)

    def unscale_gradients(self, factor: float) -> None:
        if self.optimizers:
            unscale_grads(self.optimizers, factor)
        else:
            scale_grads(hand_params(self.modules), factor)
