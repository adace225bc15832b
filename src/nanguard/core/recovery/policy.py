"""The recovery policy: a diagnosed failure -> actions, within a budget, every action recorded.

``recover="auto"``: the diagnosis' category picks the actions (see
:data:`~nanguard.core.recovery.table.AUTO`; anything not listed, e.g. a rare
log/sqrt/div domain error on some batch, gets ``skip_step``). With a list of
allowed actions the same table is used, restricted to them (an action that is
not allowed or not possible is left out; a plain skip is used only if
``skip_step`` is allowed). Whatever the category, weights that are already
non-finite are never trained on: they are rolled back to a healthy snapshot, or
the run stops. Past the budget (:mod:`~nanguard.core.recovery.budget`) the run
stops with the full diagnosis. A recovery is never silent: each is an event in
the report (``recovery`` = ``{"action": ..., "ok": true, "actions": {...}}``), a
one-line notice on stderr, and the run ends with a recovery summary line.

The policy works on plain numbers and records; it acts through a backend's
:class:`~nanguard.core.recovery.actions.RecoveryActions`, which the backend
passes to the four hooks: :meth:`RecoveryPolicy.on_step_start` (snapshots),
:meth:`~RecoveryPolicy.on_failure` (the decision), :meth:`~RecoveryPolicy.on_check`
and :meth:`~RecoveryPolicy.on_update` (the armed per-update actions: loss scale, clipping).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from ..render.terminal import print_line
from .actions import RecoveryActions, Snapshot
from .budget import DATA_CATEGORY, RecoveryBudget
from .estimates import DynamicLossScale, initial_loss_scale, rollback_bound
from .records import notice, summary_line
from .repeats import Repeats, samples_failed, samples_note, skip_failed, weights_note
from .snapshots import SnapshotStore
from . import beta2, stepsize, tried
from .table import ACTIONS, AUTO, CHANGES_TRAINING, DIVERGENCE, actions_for, check_allowed, record_order
from .verify import VERIFIED, per_sample, proof_record, verified_plan


def _store_attr(name: str) -> property:
    return property(lambda self: getattr(self.store, name), doc=f"``store.{name}``")


class RecoveryPolicy:
    """Chooses recovery actions for diagnosed failures, within a budget; records every action."""

    def __init__(self, allowed: Optional[Sequence[str]] = None, *, auto: bool = True, max_recoveries: Optional[int] = None,
                 window: int = 100, max_consecutive: int = 3, max_data_skips: int = 50, max_consecutive_data: int = 8,
                 snapshot_every: int = 10, keep_snapshots: int = 3, recent_snapshots: int = 2,
                 recent_max_bytes: int = 256 * 2 ** 20, lr_factor: float = 0.1, clip_quantile: float = 0.25,
                 quiet: bool = False, failures: bool = True, max_same_failure: int = 2) -> None:
        check_allowed(allowed or [])
        if not 0 < lr_factor < 1:
            raise ValueError(f"lr_factor must be in (0, 1), got {lr_factor}")
        self.allowed = list(allowed) if allowed else list(ACTIONS)
        self.auto = auto
        self.budget = RecoveryBudget(max_recoveries, window, max_consecutive, max_data_skips, max_consecutive_data)
        self.repeats = Repeats(max_same_failure)  # the same failure back after a rollback: escalate, then stop
        self._same = 0  # how many recoveries in a row the failure being recovered has had
        self._rate: Optional[float] = None  # the failure's non-finite learning rate (nonfinite_rate), if any
        self._stuck: Optional[str] = None  # why that rate stays non-finite (RecoveryActions.rate_stuck), if known
        self.store = SnapshotStore(snapshot_every, keep_snapshots, recent_snapshots, recent_max_bytes)
        self.lr_factor, self.clip_quantile = lr_factor, clip_quantile
        self.quiet = quiet
        self.failures = failures  # False: snapshots for the early-warning rollbacks only (failures: on_nonfinite)
        self.events: List[Any] = []           # the recovered events, in order
        self.acted: List[Any] = []            # the early warnings it acted on (their events are the detector's)
        self.grad_scale: Optional[float] = None  # armed by lr_backoff without optimizers (hand-written updates)
        self._last_cut: Optional[int] = None  # the step of the last step-size cut (lr, gradient scale, clip)
        self.clip_norm: Optional[float] = None  # armed by ``clip``: every later update is clipped
        self.loss_scaler: Optional[DynamicLossScale] = None  # armed by ``loss_scale``
        self.quarantined: List[int] = []      # dataset rows of bad input data
        self.quarantined_batch_rows: List[int] = []
        self.row_filters: List[Dict[str, Any]] = []  # each later batch a quarantined row was taken out of
        self.upcast_modules: List[str] = []
        self.stopped: Optional[str] = None    # why recovery stopped the run
        self.stopped_step: Optional[int] = None
        self._last_rec: Optional[tuple] = None
        self._element_repairs: set = set()  # steps whose param corruption was repaired element-wise

    @classmethod
    def from_spec(cls, spec: Any) -> "RecoveryPolicy":
        """``"auto"``, ``"skip_step,clip"``, a list of action names, or a RecoveryPolicy."""
        if isinstance(spec, cls):
            return spec
        if spec is True or spec == "auto":
            return cls()
        if isinstance(spec, str):
            spec = [s.strip() for s in spec.split(",") if s.strip()]
        if isinstance(spec, (list, tuple)) and spec:
            return cls(allowed=list(spec))
        raise ValueError(f"recover must be 'auto', a comma list or a list of actions, got {spec!r}")

    def choose(self, category: str) -> List[str]:
        """The actions ``auto`` takes for ``category``, restricted to the allowed ones (skip_step is implied)."""
        return actions_for(category, self.allowed)

    # ---------------------------------------------------------------- snapshots
    initial, snapshots, recent = _store_attr("initial"), _store_attr("snapshots"), _store_attr("recent")
    snapshot_every, keep = _store_attr("snapshot_every"), _store_attr("keep")
    recent_n, recent_max_bytes = _store_attr("recent_n"), _store_attr("recent_max_bytes")

    def all_snapshots(self) -> List[Snapshot]:
        return self.store.all()

    def snapshot_bytes(self) -> int:
        return self.store.nbytes()

    def best_snapshot(self, history: Sequence[dict] = (), step: Optional[int] = None,
                      divergence: bool = True) -> Optional[Snapshot]:
        """The snapshot to roll back to (see :func:`~nanguard.core.recovery.estimates.rollback_target`)."""
        return self.store.best(history, step, divergence)

    def on_step_start(self, step: int, actions: RecoveryActions, loss: Optional[float] = None) -> None:
        """The state at the start of ``step``: snapshot it if rollback is allowed and a tier wants it."""
        if "rollback" in self.allowed:
            pinned = self.store.pinned
            if pinned is not None and step - pinned.step > self.budget.window:
                self.store.pin_release()  # the cut step size held for a whole window: a later divergence is new
            self.store.maybe_take(step, actions, loss)

    # ---------------------------------------------------------------- armed actions, every update
    def on_check(self, actions: RecoveryActions) -> None:
        """Right before the per-step check: undo the policy's own loss scale on the gradients."""
        if self.loss_scaler is not None:
            actions.unscale_gradients(1.0 / self.loss_scaler.scale)

    def on_update(self, actions: RecoveryActions) -> bool:
        """Right before each update of a step that passed the check: the loss scale grows, clipping."""
        if self.loss_scaler is not None:
            self.loss_scaler.good_step()
        if self.grad_scale is not None:
            actions.unscale_gradients(self.grad_scale)
        if self.clip_norm is not None:
            actions.clip_gradients(self.clip_norm)
        return True

    # ---------------------------------------------------------------- a failure
    def on_failure(self, event, *, step: int, actions: RecoveryActions,
                   history: Sequence[dict]) -> Optional[Dict[str, Any]]:
        """Act on the diagnosed ``event`` (its ``cause`` and ``origin``). Returns the recovery record
        (also set as ``event.recovery``), or None to stop (budget, no action, non-finite weights)."""
        cause = event.cause if isinstance(event.cause, dict) else {}
        event.cause = cause
        cat = cause.get("category") or "other"
        if not self.failures:
            return None
        if self._last_rec is not None and self._last_rec[0] == step:
            # A second optimizer of the step that already recovered: drop its update too.
            actions.skip_step()
            return self._last_rec[1]
        few_rows = per_sample(event)  # a per-sample failure counts against the bad-data budget
        self._rate = nonfinite_rate(actions) if event.phase in ("optimizer", "params") else None
        self._stuck = actions.rate_stuck() if self._rate is not None else None
        why = self.budget.exhausted(step, cat, data=few_rows or None, consecutive=self._rate is None) or (
            self.budget.replay_failed(step, cat) if self._rate is None else None)
        if why:
            return self._stop(event, step, why + (f" (the learning rate is {self._rate} and stays so: {self._stuck}; "
                                                  "fix the schedule)" if self._stuck else ""))
        self._same = self.repeats.count(step, cat, "failure") if self._rate is None else 0
        if self.repeats.exhausted(self._same):
            return self._stop(event, step, self.repeats.why_stop(step, cat, self._same))
        params_ok = actions.state_finite()
        if params_ok and event.phase == "optimizer" and not actions.optimizer_state_finite():
            params_ok = False  # finite weights over an overflowed optimizer state: only a snapshot's state is sound
        unsound = (cause.get("evidence") or {}).get("recovery_unsound")
        # beta2 named and this backend can raise it: raise_beta2 for lr_backoff, sound after all (beta2.py)
        acts, unsound = beta2.plan(cause, self.choose(cat) if self.auto else [], self.allowed if self.auto else [],
                                   actions, unsound)
        if unsound and params_ok:
            return self._stop(event, step, f"recovery cannot be sound: {unsound}")
        bound = rollback_bound(cause) if cat in DIVERGENCE + (DATA_CATEGORY,) else None
        weights = params_ok and not few_rows and self._rate is None and step >= 2 \
            and skip_failed(self._last_rec, step, cat, acts, history)
        series = samples_failed(self.budget.sample_steps, self._last_rec, step, cat) \
            if params_ok and few_rows and self._rate is None else None
        if weights or series is not None:  # back to before the update that made the weights it fails on, and a
            acts = [a for a in ("rollback", "lr_backoff") if a in self.allowed]  # replayed rate cut
            # (before the skipped update's own predecessor: its optimizer's update before it)
            bound = 2 * self._last_rec[0] - step if series is None else max(series - 1, 0)
            bound, weights = max(bound, 0), True
        if cat == DATA_CATEGORY and bound is not None and bound < step and "rollback" in self.allowed \
                and "rollback" not in acts:
            acts = ["rollback"] + acts  # the outlier batch of an earlier step is already in the weights
        if not params_ok and "rollback" in self.allowed and "rollback" not in acts and cat != "loss_scale_collapse":
            acts = ["rollback"] + acts  # never train on non-finite weights
        if self.loss_scaler is not None and event.phase == "backward" and params_ok:
            acts, weights = ["loss_scale"], False  # our own loss scale overflowed: back off (and skip), like GradScaler
        if weights:  # its cut is tested by this recovery's own replays (tried.act), not the investigation's
            proofs, notes = {}, [weights_note(cat, step, self._last_rec[0]) if series is None
                                 else samples_note(cat, step, series)]
        else:
            acts, proofs, notes = verified_plan(cause, acts, self.allowed, event.phase)
        done: Dict[str, Any] = {}
        names: List[str] = []
        for a in acts:
            if a == "rollback":
                params_ok = self._rollback(event, step, cat, actions, history, params_ok, done, notes, bound)
                if "rollback" not in done and bound is not None and not weights:
                    return self._stop(event, step, f"no snapshot from before step {bound + 1}, where the growth "
                                      "began: rolling back to weights that are already diverging is not sound"
                                      + (f"; fix: {event.fixes[0]}" if getattr(event, "fixes", None) else ""))
            elif a == "clip":
                self._clip(history, done, step, proofs.get("clip"))
            elif a == "lr_backoff" and weights:
                if "rollback" not in done:
                    continue  # no snapshot from before those weights: a cut alone would keep training on them
                runs: List[dict] = []
                tried.act(self, a, cause, actions, history, step, done, runs)
                tried.record_on_event(event, runs)
            elif a == "lr_backoff":  # past a rate spike of the schedule, the rate now is replayed first
                tried.failure_cut(self, event, actions, history, step, done, proofs.get("lr_backoff"))
            elif a == "upcast":
                o = event.origin or {}
                path = (proofs.get("upcast") or {}).get("params", {}).get("module")  # "": the whole model
                if path is None:
                    path = o.get("module") or o.get("layer")  # Keras: the layer, by path or name
                rec = actions.upcast(path, self.upcast_modules.append)
                if rec is None:
                    notes.append("no origin module to upcast" if path is None else f"module {path!r} not found")
                    continue
                self.upcast_modules.append(path)
                done["upcast"] = rec
            elif a == "loss_scale":
                own_overflow = self.loss_scaler is not None and event.phase == "backward"
                # a value of low precision in the backward that no upcast fixed: a loss scale (above 1 for an
                # underflow, below 1 for an overflow), as GradScaler's
                scaled = cat.startswith("low_precision") and event.phase == "backward" and "upcast" not in done
                if not (own_overflow or scaled) or not actions.can_loss_scale():
                    continue
                if self.loss_scaler is None:
                    self.loss_scaler = DynamicLossScale(initial_loss_scale(cause))
                else:
                    self.loss_scaler.backoff()
                done["loss_scale"] = {"scale": self.loss_scaler.scale}
            elif a == beta2.ACTION:
                if not beta2.apply(cause, actions, step, done):
                    notes.append("no optimizer with betas to raise beta2 on")
            elif a == "drop_samples":
                rec = actions.drop_samples(list((proofs["drop_samples"].get("details") or {}).get("rows") or []))
                if rec is None:
                    notes.append("the offending samples could not be dropped here: the batch is skipped")
                    continue
                done["drop_samples"] = rec
            names += [n for n in (a, "grad_scale" if a == "lr_backoff" else "") if n in done and n not in names]
        if not params_ok and "rollback" not in names:
            return self._stop(event, step, "the parameters or buffers are non-finite and "
                              + ("rollback is not allowed" if "rollback" not in self.allowed
                                 else "there is no healthy snapshot to roll back to")
                              + ": training on them would only spread the NaN")
        if not names and ("skip_step" not in self.allowed or AUTO.get(cat) == []):
            why = (f"no allowed recovery action for {cat}" + (f" ({'; '.join(notes)})" if notes else ""))
            return self._stop(event, step, why)
        if proofs:
            done["verified"] = {a: proof_record(e) for a, e in proofs.items() if a in names}
        return self._record(event, step, cat, actions, done, names, notes, few_rows)

    def on_spike(self, event, *, step: int, actions: RecoveryActions, history: Sequence[dict],
                 rollback: bool = True) -> Optional[Dict[str, Any]]:
        """Act on an early warning (``kind`` "warning", every value still finite): drop this step's update
        and, with ``rollback``, go back to a snapshot from before the excursion began and apply what the
        warning's diagnosis calls for (lower the learning rate, or scale the gradients of hand-written
        updates; clip). Returns the record (also set as ``event.recovery``), or None when the diagnosis
        says no recovery can be sound (the warning then stands alone); it never stops the run."""
        cause = event.cause if isinstance(event.cause, dict) else {}
        cat = cause.get("category") or "other"
        unsound = (cause.get("evidence") or {}).get("recovery_unsound")
        acts, unsound = beta2.plan(cause, self.choose(cat), self.allowed, actions, unsound)
        if unsound:  # nothing to do that would help: the warning stands, the step is applied
            return None
        self._same = self.repeats.count(step, cat, "warning")
        if self.repeats.exhausted(self._same):  # no more rollbacks for it: the warning stands
            cause.setdefault("evidence", {})["recovery_unsound"] = self.repeats.why_stop(step, cat, self._same)
            return None
        done: Dict[str, Any] = {}
        notes: List[str] = []
        names: List[str] = []
        if rollback and "rollback" in self.allowed:
            bound = rollback_bound(cause)
            self._rollback(event, step, cat, actions, history, True, done, notes,
                           max(step - 1, 0) if bound is None else min(bound, max(step - 1, 0)))
            if "rollback" in done:
                names.append("rollback")
                runs: List[dict] = []
                for a in acts:  # a cut or clip (or beta2) is replayed from the snapshot first (tried.py, beta2.py)
                    if a == beta2.ACTION:
                        beta2.apply(cause, actions, step, done)
                    else:
                        tried.act(self, a, cause, actions, history, step, done, runs)
                    names += [n for n in (a, "grad_scale") if n in done and n not in names]
                tried.record_on_event(event, runs)
        done["skip_step"] = actions.skip_step()
        names.append("skip_step")
        if notes:
            done["notes"] = notes
        if any(a in names for a in CHANGES_TRAINING):
            self.budget.training_changed()
        rec = {"action": "+".join(record_order(names)), "ok": True, "actions": done, "category": cat}
        self._tries(step, cat, "warning", rec)
        event.recovery = rec
        self.acted.append(event)
        return rec

    def _tries(self, step: int, cat: str, kind: str, rec: Dict[str, Any], skip: bool = False) -> None:
        """Say how many tries are left (this failure; the run's budget, or a skip's) and arm the repeats."""
        # the allowance the next such failure is checked against (bad data: its skips', whatever this one did)
        rec["tries_left"] = {"same_failure": self.repeats.tries_left(self._same),
                             **self.budget.allowance(step, skip or cat == DATA_CATEGORY, skip and cat != DATA_CATEGORY)}
        if self._same:
            rec["repeat"] = self._same
        if self._rate is not None and kind == "failure":  # not a replay of this step: the next steps are new ones
            rec["tries_left"].pop("same_failure")
        self.repeats.note(step, cat, kind, rec if self._rate is None or kind != "failure" else {}, self._same)

    def _rollback(self, event, step: int, cat: str, actions: RecoveryActions, history: Sequence[dict],
                  params_ok: bool, done: Dict[str, Any], notes: List[str], before: Optional[int] = None) -> bool:
        """Roll back (or repair the non-finite elements); returns whether the parameters are now finite.
        ``before``: the latest step a snapshot may come from (the growth began after it)."""
        pinned = self.store.pinned  # set by a step-size cut with a rollback, released after a window
        again = cat in DIVERGENCE and pinned is not None and pinned.step <= step
        if again:
            # The step size was cut (or clipped) within the last window and the run diverged again: every
            # update since that cut was made at a step size now shown to be past its limit, so its weights
            # are not trusted. (The pin is released once the cut step size held for a whole window.)
            before = pinned.step if before is None else min(before, pinned.step)
        snap = self.store.best(history, step, cat in DIVERGENCE, before)
        if snap is None:
            notes.append("no healthy snapshot to roll back to" if before is None else
                         f"no snapshot from before step {before + 1}, where the growth began")
            return params_ok
        if cat == "param_corruption" and event.phase == "params" and not params_ok \
                and written_outside_update(event.cause, self._element_repairs) and actions.optimizer_state_finite():
            # Values made non-finite between updates (an in-place edit of the weights, not the
            # optimizer): put back only those elements, keeping the rest of the edit and the
            # training since the snapshot. Falls back to a full rollback if that is impossible.
            n = actions.repair_nonfinite(snap)
            if n > 0 and actions.state_finite():
                done["rollback"] = {"to_step": snap.step, "steps_lost": 0, "elements_only": True,
                                    "elements_restored": n, "snapshot_bytes": snap.nbytes,
                                    "snapshots_kept_bytes": self.snapshot_bytes()}
                self._element_repairs.add(step)
                return True
        # Bad data: the RNG is not rewound, or a script that samples its batches from it would draw the
        # outlier batches it rolled back from again (and again, at every rollback). Nor when this same
        # failure came back after the last rollback (repeats.py): the batch that made it is dropped.
        redraw = self.repeats.escalate(self._same)
        rewind_rng = cat != DATA_CATEGORY and not redraw
        extra = actions.restore(snap, rng=rewind_rng) or {}  # (+ what else it put back: a carried hidden state)
        self.store.forget_after(snap.step)
        done["rollback"] = {"to_step": snap.step, "steps_lost": step - snap.step, "rng_rewound": rewind_rng,
                            "snapshot_bytes": snap.nbytes, "snapshots_kept_bytes": self.snapshot_bytes(), **extra}
        if redraw:
            done["rollback"]["escalated"] = ("the same failure came back after the last rollback: the RNG is not "
                                             "rewound this time, so the batch that made it is not drawn again")
        if again:
            done["rollback"]["why"] = (f"back to the state the step-size cut restarted from (step {pinned.step}): "
                                       "the updates since were made at a step size that proved too large")
        return params_ok

    # the step-size cuts (a learning-rate cut, gradient scaling, a clip): stepsize.py
    _step_size_cut, _lr_backoff, _clip = stepsize.step_size_cut, stepsize.lr_backoff, stepsize.clip

    def _record(self, event, step: int, cat: str, actions: RecoveryActions, done: Dict[str, Any],
                names: List[str], notes: List[str], few_rows: bool = False) -> Dict[str, Any]:
        """Drop the failing update (unless its samples were dropped and its gradients recomputed without
        them), count the recovery, record it and say so."""
        if "drop_samples" not in done:
            done["skip_step"] = actions.skip_step()
            if "rollback" not in names:  # the failing forward's buffer updates (BatchNorm statistics) go too
                this = self.store.at(step)
                if this is not None and this.finite():
                    done["skip_step"]["buffers_restored"] = actions.restore_buffers(this)
            names.append("skip_step")
        if cat == DATA_CATEGORY or few_rows:
            quarantine(self, event, done, actions)
        notes += [RATE_NOTE.format(self._rate) + (f"; it stays so: {self._stuck}. Every later update is undone "
                  "until the run ends or the recovery budget is spent: fix the schedule" if self._stuck else "")] \
            if self._rate is not None else []
        if notes:
            done["notes"] = notes
        if any(a in names for a in CHANGES_TRAINING):
            self.budget.training_changed()
        if set(names) == {"rollback", "skip_step"} and not done["rollback"].get("elements_only") \
                and done["rollback"].get("rng_rewound") and self._rate is None:
            self.budget.plain_rollback(step, done["rollback"]["to_step"], cat)  # its replay will be identical
        skip = (cat == DATA_CATEGORY or few_rows) and names in (["skip_step"], ["drop_samples"])
        n = self.budget.spend(step, cat, data_skip=skip, plain_skip=names == ["skip_step"] and self._rate is None)
        rec = {"action": "+".join(record_order(names)), "ok": True, "actions": done, "category": cat,
               "recovery_number": n}
        if done.get("verified"):
            rec["verified"] = VERIFIED
        self._tries(step, cat, "failure", rec, skip)
        event.recovery = rec
        self.events.append(event)
        self._last_rec = (step, rec)
        if not self.quiet:
            print_line(notice(step, cat, rec))
        return rec

    def _stop(self, event, step: int, why: str) -> None:
        cause = event.cause if isinstance(event.cause, dict) else {}
        cause.setdefault("evidence", {})["recovery_stopped"] = why
        self.stopped, self.stopped_step = why, step
        if not self.quiet:
            print_line(f"recovery stopped at step {step}: {why}")
        return None

    # ---------------------------------------------------------------- end of run
    def summary(self) -> Optional[str]:  # one line on what recovery did (None when it did nothing)
        return summary_line(self)

    def print_summary(self) -> None:
        if not self.quiet and self.summary():
            print_line(self.summary())


def written_outside_update(cause: Dict[str, Any], repaired: Any) -> bool:
    """The replay traced the corrupted parameter to a write by the program between updates (an in-place
    edit under no_grad, not the optimizer), or this is a recurrence of such a failure (``repaired``: the
    steps whose corruption was repaired element-wise)."""
    ev = cause.get("evidence") or {}
    wb = (ev.get("preexisting") or {}).get("written_by") or {}
    if wb.get("op") and wb.get("stage") != "optimizer":
        return True
    return ev.get("same_as_step") in repaired


def quarantine(policy: RecoveryPolicy, event, done: Dict[str, Any], actions: Optional[RecoveryActions] = None) -> None:
    """Record the bad samples of a bad-data (or per-sample) recovery in ``done`` and in the policy's
    quarantine lists. Dataset rows a drop-samples replay proved bad (:func:`proven_rows`) are kept out of
    every later batch where the backend can (``actions.exclude_rows``: ``quarantine.excluded``)."""
    origin = event.origin or {}
    ev = (event.cause or {}).get("evidence") or {}
    proven = proven_rows(event, done)
    q: Dict[str, Any] = {}
    relocalized = (getattr(event, "localization", None) or {}).get("reproduced") is True
    if ev.get("same_as_step") is not None and not relocalized:
        if not proven:
            # (a random batch holds other rows than the first failure's: none are named, none claimed)
            done["quarantine"] = {"same_as_step": ev["same_as_step"],
                                  "note": f"not re-localized: its own samples are not known (taken as a recurrence "
                                          f"of step {ev['same_as_step']}'s failure)"}
            return
        # a recurrence whose own drop-samples replay named its rows: those rows, not the first failure's
        # (two empty records of a dataset are two rows, each coming back)
        rows = proven
        batch_rows = [int(r) for r in ((done.get("drop_samples") or {}).get("rows") or []) if isinstance(r, int)]
    else:  # a first failure, or a recurrence replayed on its own (its origin holds its own rows)
        rows = [int(r) for r in (origin.get("source_rows") or (ev.get("bad_samples") or {}).get("dataset_indices")
                                 or []) if isinstance(r, int)]
        batch_rows = [int(r) for r in (origin.get("samples") or []) if isinstance(r, int)]
    if ev.get("same_as_step") is not None and rows and all(r in policy.quarantined for r in rows):
        q["same_as_step"] = ev["same_as_step"]  # the same rows came back
    if rows:
        q["rows"] = rows
        policy.quarantined.extend(r for r in rows if r not in policy.quarantined)
    if batch_rows:
        q["batch_rows"] = batch_rows
        policy.quarantined_batch_rows.extend(batch_rows)
    if origin.get("tensor"):
        q["tensor"] = origin.get("tensor")
    proven = [r for r in proven if r in rows]
    ex = actions.exclude_rows(proven) if actions is not None and proven else None
    if ex:
        q["excluded"] = ex
    elif proven:
        q["kept_out"] = False
        q["note"] = ("not kept out of later batches (this backend cannot filter them): a later batch that draws "
                     "them fails again and is recovered again")
    done["quarantine"] = q
    done["quarantined_samples"] = rows or batch_rows


def proven_rows(event, done: Dict[str, Any]) -> List[int]:
    """The dataset rows a drop-samples replay proved bad: the step without them was finite (the experiment
    ``drop_samples`` of the investigation, or the recovery's own ``drop_samples`` re-run)."""
    ev = (event.cause or {}).get("evidence") or {}
    found: List[int] = []
    tries = [e.get("details") or {} for e in ev.get("experiments") or []
             if isinstance(e, dict) and e.get("kind") == "drop_samples" and e.get("finite") is True]
    tries += [done["drop_samples"]] if isinstance(done.get("drop_samples"), dict) else []
    for d in tries:
        found += [int(r) for r in d.get("dataset_indices") or [] if isinstance(r, int) and int(r) not in found]
    return found


RATE_NOTE = ("the learning rate is {}: the update made with it is undone; the next steps are new ones, each undone "
             "the same way while the rate stays non-finite")


def nonfinite_rate(actions: RecoveryActions) -> Optional[float]:
    """A learning rate of the optimizers that is NaN or inf now (a schedule past its end), else None (or when none
    can be read). Each update made with it is undone, and the next steps are new ones (no replay of the failing
    one: neither the in-a-row limit nor the repeat rule applies), until the rate is finite or the budget is spent."""
    try:
        rates = list(actions.learning_rates())
    except Exception:
        return None
    return next((float(r) for r in rates if not math.isfinite(float(r))), None)
