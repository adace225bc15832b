"""What ``nanguard run`` and ``nanguard.watch()`` share: localizing a failure, and the run's report.

**Localization** (:class:`Localizer`), in the hook that saw the failure, before the update:

1. in-process, from the step tape (:meth:`~nanguard.pytorch.watch.Watcher.step_replay`, see
   :mod:`nanguard.pytorch.stepreplay`): about one instrumented step, whatever the step number; the
   repro bundle is then written from the process's own (pre-update) state;
2. else the full re-run of the script up to the failing step (``nanguard run`` only: ``rerun``;
   at report time in stop/warn mode, at once under ``--recover``), with the reason the in-process
   replay was not possible in ``localization.fallback_from``.

``localization.method_kind`` says which ran: ``replay-tape``, ``rerun`` or ``replay-eval`` (the
failing evaluation call, replayed in-process).

**The report** (:func:`make_report`): the first failure is a full event. Later failures are
*recurrences* of it (``recurrence_of``: its step, ``count``: how many failing steps the record
stands for, ``last_step``) when they follow from the value warn mode let through (parameters or
optimizer state non-finite after it) or have the same cause (localized again in-process, same
category, op and line); a failure with a different cause is an event of its own.
"""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from ..core.events import Detection, Report, one_line
from ..core.optimizers import optimizer_switch as switch_of
from ..core.guarded import disabled_note
from ..core.engine import FailurePipeline, Ports, RunFacts, assemble_report, info_rows
from ..core.render.terminal import print_line
from ..core.script import Terminated
from .bundle import save_bundle
from .distributed import report_extra, share_event
from .rng import capture_rng
from .observer import WatchObserver
from .spikes import each_optimizer, optimizer_context

__all__ = ["LocalizeSpec", "Localizer", "Announcer", "make_report", "run_context", "pre_step_state", "announce"]


@dataclass(frozen=True)
class LocalizeSpec:
    """How a zero-code run localizes its failures (the Watcher builds its :class:`Localizer` from it).

    ``rerun(det, bundle)``: the full re-run of the script up to the failing step (``nanguard run``
    only; None: no re-run), ``bundle`` the repro bundle's path for it to write (None once one was
    written); ``bundle``: where the repro bundle of the first localized failure goes; ``config``: the
    settings the re-run's child needs; ``at_once``: re-run at the failing step (``--recover``), not
    at report time.
    """

    rerun: Optional[Callable[[Detection, Optional[str]], Optional[Dict[str, Any]]]] = None
    bundle: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)
    at_once: bool = False


class Localizer:
    """Localizes the failures of a zero-code run (see the module docstring)."""

    def __init__(self, watcher: Any, spec: Optional[LocalizeSpec] = None) -> None:
        spec = spec if spec is not None else LocalizeSpec()
        self.w, self.rerun, self.bundle, self.config, self.at_once = \
            watcher, spec.rerun, spec.bundle, dict(spec.config), spec.at_once
        self.bundle_written = False

    def wants(self, det: Detection) -> bool:
        """Localize at the failing step: the first failure (and the first evaluation failure), and later
        ones that are not consequences of a value let through (parameters or optimizer state made
        non-finite by an update warn mode allowed); at most 8 in a run (each costs about one step)."""
        done = self.w.loc_runs
        if len(done) >= 8:
            return False
        if det.phase == "eval":
            return not any(d.phase == "eval" for d in self.w.detections)
        first = next((d for d in self.w.detections if d.phase != "eval"), None)
        return first is None or det.phase not in ("params", "optimizer")

    def __call__(self, det: Detection) -> Optional[Dict[str, Any]]:
        if det.phase == "eval":
            return self.w.evals.replay(self.recorder)
        if det.phase == "params" and det.step == 0 and self.rerun is not None:
            res = {"method": "replay-tape", "reproduced": False,
                   "reason": "the parameters were non-finite at the first update: re-running the script from its "
                             "start (its setup included) is cheap and shows where they were written"}
        else:
            res = self.in_process(det)
        if self.at_once and not res.get("reproduced"):
            return self.fallback(det, res)
        return res

    def recorder(self, roots: Any = None) -> Any:
        w = self.w
        from .replay import make_recorder  # (the op recorder: loaded at the first failure)
        return make_recorder(list(w.monitor.roots) if roots is None else roots, w.optimizers(),
                             data_rows=w.data.rows_of)

    def in_process(self, det: Detection) -> Dict[str, Any]:
        rep = self.w.step_replay(det.step)
        if rep is None:
            return {"method": "replay-tape", "reproduced": False, "reason": self.w.replay_unavailable}
        out = rep.run(recorder=self.recorder())
        res = {"method": "replay-tape", "reproduced": bool(out.get("reproduced")),
               "localization": out.get("localization"), "seconds": out.get("seconds")}
        loc = out.get("localization") or {}
        if res["reproduced"] and (loc.get("preexisting") or {}).get("kind") == "data" \
                and rep.data_unexplained(self.w.data.loaded):
            res["reproduced"] = False
            out["error"] = ("the batch was non-finite when the recorded calls began (the calls that built it "
                            "were not all recorded)")
        elif res["reproduced"] and _handed_to_loss(loc.get("preexisting")):
            res["reproduced"] = False  # (a criterion built in the loop with a weight the script computed)
            out["error"] = ("a loss module's weight was non-finite when the recorded calls began: the script computed "
                            "it before them")
        if not res["reproduced"]:
            res["reason"] = out.get("error") or (
                "the replay did not give back the step's loss bit for bit" if out.get("same_loss") is False
                else "the replay of the recorded calls stayed finite: the non-finite value is outside them (code "
                     "between backward and the optimizer step, such as gradient clipping, or a forward whose loss "
                     "the script never backpropagated, such as a skipped non-finite loss)")
        else:
            _param_write(loc, rep, self.w)
            _assembled(loc, self.w)
            if self.bundle and not self.bundle_written:
                res["bundle"] = self._bundle(det, rep)
        return res

    def fallback(self, det: Detection, first: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """The full re-run when the in-process replay did not reproduce (``first``)."""
        if self.rerun is None:
            return first
        res = self.rerun(det, None if self.bundle_written else self.bundle)
        if res is not None and first is not None:
            res["fallback_from"] = {"method": first.get("method"), "reason": first.get("reason")}
        return res

    def _bundle(self, det: Detection, rep: Any) -> Any:
        try:
            st = pre_step_state(self.w)
            rng = rep.rng()
            if rng is not None:
                st["rng"] = {"torch": rng[0]}
            self.bundle_written = True
            return save_bundle(self.bundle, step=det.step, phase=det.phase, batch=rep.batch(), config=self.config,
                               **st)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:200]}


_LOSS_OPS = ("cross_entropy", "nll_loss", "binary_cross_entropy", "mse_loss", "l1_loss", "smooth_l1_loss",
             "huber_loss", "kl_div", "margin_ranking_loss", "multilabel", "soft_margin", "poisson_nll")


def _handed_to_loss(pre: Any) -> bool:
    """A buffer non-finite before the recorded calls, that no recorded op wrote and a loss op reads first: a
    weight the script handed to a loss module (``BCEWithLogitsLoss(pos_weight=neg / pos)`` built in the loop), whose
    computation a re-run from the step's start sees."""
    if not isinstance(pre, dict) or pre.get("kind") != "buffer" or pre.get("written_by"):
        return False
    op = str((pre.get("first_use") or {}).get("op") or "")
    return any(k in op for k in _LOSS_OPS)


def _param_write(loc: Dict[str, Any], rep: Any, watcher: Any) -> None:
    """A parameter non-finite before the step that the tape saw written in place (between steps):
    name the write (its API call and line; the recorder did not see its op)."""
    pre = loc.get("preexisting") or {}
    if pre.get("kind") != "param" or pre.get("written_by"):
        return
    names = {n: p for r in watcher.monitor.roots for n, p in r.named_parameters()}
    p = names.get(str(pre.get("name")).split(":", 1)[-1])
    wb = rep.param_writes.get(id(p)) if p is not None else None
    if wb is not None:
        pre["written_by"] = dict(wb, op=wb.get("api"), stage="forward", kind="recorded call")


def pre_step_state(watcher: Any) -> Dict[str, Any]:
    """Model/optimizer/scaler/RNG state now (before the failing step's update), for a repro bundle."""
    roots = list(watcher.monitor.roots)
    model_state: Dict[str, torch.Tensor] = {}
    for r in roots:
        prefix = (type(r).__name__ + ":") if len(roots) > 1 else ""
        model_state.update({prefix + k: v.detach().clone() for k, v in r.state_dict().items()})
    scaler = watcher.scalers[0] if watcher.scalers else None
    return {"model_state": model_state, "optimizer_states": [o.state_dict() for o in watcher.optimizers()],
            "scaler_state": scaler.state_dict() if scaler is not None else None, "rng": capture_rng()}


def run_context(watcher: Any) -> dict:
    """What the diagnosis knows about the run: optimizer, learning rates, eps, dtype, scaler, counting."""
    mon = watcher.monitor
    ctx: dict = {"scaler": bool(watcher.scalers), "counting": mon.counting}
    order = latest_first(mon)
    ctx.update(optimizer_context([o for _, o in order]))  # name, lr, eps, betas, momentum: the latest update's
    switch = optimizer_switch(mon)
    if switch:
        ctx["optimizer_switch"] = switch
    if len(mon.opt_index) > 1:  # each optimizer's own facts: the history records name the one of each step
        ctx["optimizers"] = each_optimizer([(mon.opt_index.get(k), o) for k, o in order], list(mon.roots))
    clips = getattr(watcher, "clips", None)
    clip = clips.context() if clips is not None else None
    if clip:
        ctx["clip_before_backward"] = clip
    elif clips is not None and clips.used():
        ctx["clip_used"] = clips.used()
    tape = getattr(watcher, "tape", None)
    if tape is not None and mon.steps_watched - max(tape.zeroed_at, 0) >= 3 and mon.views:
        # an optimizer that stepped 3+ times since the script's last zero_grad: its gradients were never reset
        ctx["no_zero_grad"] = {"steps": mon.steps_watched - max(tape.zeroed_at, 0), "ever": tape.zero_grads > 0}
    for v in mon.views.values():
        ps = v.all_params()
        if ps:
            ctx.setdefault("dtype", str(ps[0].dtype).replace("torch.", ""))
    return ctx


def latest_first(mon: Any) -> list:
    """The watched optimizers as ``(key, optimizer)``, the one that made the latest step first (a fine-tuning
    stage's new optimizer names the failing update, not the first stage's; optimizers stepping together
    keep their order)."""
    out = [(k, v.opt_ref()) for k, v in mon.views.items() if v.opt_ref() is not None]
    last = {k: r.step for k, r in mon._records.items()}
    return sorted(out, key=lambda kv: -last.get(kv[0], -1))


def optimizer_switch(mon: Any) -> dict:
    """The switch (:func:`nanguard.core.optimizers.optimizer_switch`) from what the monitor kept: each
    optimizer's updates before it was first seen and its last step (the script may have freed the first
    optimizer by the time the report is written). Guard numbering (one step per ``guard.step``): none."""
    if not mon.per_update:
        return {}
    last = {k: r.step for k, r in mon._records.items()}
    return switch_of([(first, last.get(k), name) for k, (first, name) in mon.born.items()])


def pipeline_for(watcher: Any, localizer: Optional[Localizer] = None, localize: bool = True) -> FailurePipeline:
    """The run's :class:`~nanguard.core.engine.FailurePipeline` on PyTorch's ports: the run context, the
    re-run fallback (a signal during it cuts it short) and the distributed sharing."""
    relocalize = None
    if localize and localizer is not None:
        def relocalize(det: Detection, first: Any) -> Any:
            return _safe_fallback(localizer, det, first.as_dict() if first is not None else None)
    return FailurePipeline(Ports(context=lambda: run_context(watcher), relocalize=relocalize,
                                 share=lambda ev, det: share_event(ev, det.rank)))


def make_report(watcher: Any, localizer: Optional[Localizer] = None, policy: Any = None,
                localize: bool = True) -> Report:
    """The report of a watched run (see the module docstring for events and recurrences)."""
    mon = watcher.monitor
    pipe = pipeline_for(watcher, localizer, localize)
    history = mon.history.raw_dicts()
    events = list(policy.events) if policy is not None else []
    for det in watcher.detections:
        if det.event is not None:  # already diagnosed during the run (recovery, or tested by experiments)
            events.append(det.event)
            pipe.remember(det.event, det)
            continue
        hist = [h for h in history if h["step"] < det.step]
        events.append(pipe.explain(det, hist, watcher.loc_runs.get(id(det)), relocalize=True))
    extra = {}
    tape = watcher.tape
    if tape is not None and tape.off_reason:
        extra["step_tape"] = tape.off_reason
    report = assemble_report(RunFacts(
        counting=mon.counting, steps_watched=mon.steps_watched,
        max_grad_norm=mon.history.max_grad_norm if len(mon.history) else None, history=mon.history.as_dicts(),
        info=info_rows(watcher.info), events=events,
        warnings=list(watcher.spikes.events) if watcher.spikes is not None else [], extra=extra,
        dropped_events=watcher.dropped_events, disabled=disabled_note(watcher)))
    report_extra(report)
    return report


def _safe_fallback(localizer: Localizer, det: Detection, loc_run: Any) -> Any:
    try:
        return localizer.fallback(det, loc_run)
    except (KeyboardInterrupt, Terminated) as e:  # SIGTERM/Ctrl-C during the re-run: the signal wins (run.py)
        sig = "SIGINT" if isinstance(e, KeyboardInterrupt) else signal.Signals(e.signum).name
        out = dict(loc_run or {"method": "rerun"})
        out.update(reproduced=False, interrupted=sig, reason=f"localization was interrupted by {sig}")
        return out
    except Exception as e:
        out = dict(loc_run or {"method": "rerun", "reproduced": False})
        out["reason"] = f"the re-run was stopped: {type(e).__name__}"
        return out


class Announcer(WatchObserver):
    """The observer that prints :func:`announce`'s line after a failure was handled."""

    def event(self, watcher: Any, det: Detection) -> None:
        announce(watcher, det)


def announce(watcher: Any, det: Detection) -> None:
    """One line on stderr at the failing step (watch(), warn mode): what failed, where and why."""
    kind = det.phase == "eval"
    if any((d.phase == "eval") == kind for d in watcher.detections if d is not det):
        return  # later failures are summed up at the end
    hist = [h for h in watcher.monitor.history.raw_dicts() if h["step"] < det.step]
    ev = watcher.pipeline.diagnose(det, hist, watcher.loc_runs.get(id(det)))
    try:
        print_line(one_line(ev) + " (full report at the end)")
    except Exception:
        print(f"nanguard: {one_line(ev)}", file=sys.stderr)


def _assembled(loc: Dict[str, Any], w: Any) -> None:
    """Bad input data whose dataset rows read finite again: the NaN was made as the batch was assembled (the
    loader's collate_fn), which the report names (``preexisting.assembled``)."""
    pre = loc.get("preexisting") or {}
    rows = pre.get("source_rows")
    if pre.get("kind") != "data" or not rows or not all(isinstance(r, int) for r in rows):
        return
    got = w.data.reread(list(rows))
    if got is not None:
        pre["assembled"] = got
