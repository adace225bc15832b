"""Early warning for the PyTorch drivers: the detector on the monitor and the torch port of the on-spike actions.

The :class:`~nanguard.core.spike.SpikeDetector` is judged inside :meth:`StepMonitor.check` on the numbers
its one sync already read (no tensor, no extra sync); a driver calls :meth:`SpikeResponder.after_check`
right after each check that found nothing. What a warning does (its event, its line, ``on_spike``
warn/skip/rollback) is the core's :class:`~nanguard.core.alerts.SpikeResponse`; this module supplies
the step's record and :class:`TorchSpikePort`: ``"skip"`` drops the step's gradients (its update
changes nothing); ``"rollback"`` acts through the PyTorch recovery policy (needs its snapshots).

``after_check`` returns True when the driver must treat the step as skipped.

Sync-free mode (:mod:`nanguard.pytorch.syncfree`): the detector is judged when a check's values are
read, one or more steps after its update was applied (``late=True``). A warning is then the same
event; ``"skip"`` cannot take back an applied update (the warning says so and the run goes on), and
``"rollback"`` still goes back to a snapshot from before the excursion (dropping the updates since).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Union

from ..core.alerts import SpikeResponse
from ..core.events import Event
from ..core.script import main_names
from ..core.spike import SpikeConfig
from .detect.verdict import total_norm as _total
from .recover.skip import skip_step

LATE = "read after its update was applied (sync-free)"


class TorchSpikePort:
    """The on-spike actions on one PyTorch step's training objects (:class:`~nanguard.core.alerts.SpikePort`)."""

    late_reason = "read after its update, sync-free"

    def __init__(self, modules: Sequence[Any], optimizers: Sequence[Any], scaler: Any, policy: Any,
                 test_fix: Any = None) -> None:
        self.modules, self.optimizers, self.scaler, self.policy = list(modules), list(optimizers), scaler, policy
        self.can_rollback = policy is not None
        self.test_fix = test_fix  # on_spike="warn": the driver's replay of the warning's fix (or None)

    def skip_step(self, step: int, late: bool) -> Union[Dict[str, Any], str]:
        if late:  # sync-free: the update is applied by now
            return LATE
        return skip_step(self.optimizers, self.modules)

    def rollback(self, event: Event, step: int, history: Sequence[dict], late: bool) -> Optional[Dict[str, Any]]:
        return self.policy.spike(event, step=step, modules=self.modules, optimizers=self.optimizers,
                                 scaler=self.scaler, roots=self.modules, history=history, rollback=True)


class SpikeResponder(SpikeResponse):
    """The early warnings of one driver (a Guard or a Watcher): the core response, judged on the monitor."""

    def __init__(self, monitor: Any, on_spike: str = "warn", quiet: bool = False,
                 config: Optional[SpikeConfig] = None) -> None:
        super().__init__(on_spike, quiet, config)
        self.monitor = monitor
        monitor.spikes = self.detector

    def after_check(self, opt: Any, *, modules: Sequence[Any], optimizers: Sequence[Any], scaler: Any = None,
                    policy: Any = None, context: Optional[Dict[str, Any]] = None, late: bool = False,
                    test_fix: Any = None) -> bool:
        """Right after a check of ``opt`` (None: backward counting) that found nothing. True: skip the step
        (``late``, read after its update was applied: True only when the weights were rolled back).
        ``test_fix``: see :attr:`nanguard.core.alerts.SpikePort.test_fix`."""
        hit = self.monitor.spike
        if hit is None:
            return False
        self.monitor.spike = None
        step = int(hit.get("step", self.monitor.step_of(opt)))
        hist = [h for h in self.monitor.history.raw_dicts() if h.get("step", 0) < step]
        hist.append(self._current(step, opt))
        ctx = dict(context) if context is not None else optimizer_context(optimizers)
        return self.respond(hit, hist, ctx, TorchSpikePort(modules, optimizers, scaler, policy, test_fix), late=late)

    def _current(self, step: int, opt: Any) -> Dict[str, Any]:
        """The record of the warning's own step, from what its check read (the history gets it after the update)."""
        last = getattr(self.monitor, "_last", None) or {}
        lrs = []
        if opt is not None:
            lrs = [float(g["lr"]) for g in opt.param_groups if isinstance(g.get("lr"), (int, float))]
        pn = _total(last.get("pn"))
        gn = _total(last.get("gn"))
        ratio = lrs[0] * gn / pn if lrs and pn and gn is not None and math.isfinite(gn) else None
        # the optimizer's index, as its history records carry it: without it the warning's own step went with
        # the record before it (a GAN's generator), and the discriminator's steps were not read apart
        index = getattr(self.monitor, "opt_index", {}).get(id(opt)) if opt is not None else None
        return {"step": step, "loss": last.get("loss"), "grad_norm": gn, "param_norm": pn, "lr": lrs,
                "update_ratio": ratio, "batch_max": last.get("batch_max"), "skipped": False, "optimizer": index}


def replay_warning_fix(event: Event, step: int, history: Sequence[dict], step_now: Any, modules: Sequence[Any],
                       optimizers: Sequence[Any], quiet: Any = None,
                       opt_index: Optional[Dict[int, int]] = None) -> Optional[str]:
    """``on_spike="warn"``: the warning's fix replayed on ``step_now`` (the warning step as a replayable step:
    the Guard's or the step tape's) from the weights now, put back after
    (:func:`nanguard.core.recovery.tried.test_warning_fix`); the words for the warning's line, or None.
    ``opt_index`` (the monitor's id -> history index): a learning-rate cut changes only the optimizer the
    cause names, of several (:mod:`.recover.focus`)."""
    from ..core.recovery.tried import test_warning_fix, warning_fix_words  # loaded at a warning, not in a healthy run
    from .experiments.history import replay_kept
    from .recover.focus import focused, named_index
    kept = {step: step_now}
    cut = focused(optimizers, opt_index, named_index(event.cause))
    only = {"lr_only": cut} if len(cut) < len(optimizers) else {}
    lrs = [float(g["lr"]) for o in cut for g in o.param_groups if isinstance(g.get("lr"), (int, float))]
    test_warning_fix(event, history, step, lrs, lambda **kw: replay_kept(
        kept, list(modules), list(optimizers), step, step, quiet=quiet, **only, **kw))
    return warning_fix_words(event)


def optimizer_context(optimizers: Sequence[Any]) -> Dict[str, Any]:
    """The optimizer facts the diagnosis reads (first optimizer, first group): its name, the learning
    rates, eps, betas, momentum; for an optimizer that makes several inner updates per step (LBFGS),
    ``max_iter`` and ``line_search_fn`` (None: each inner update is taken at the full lr)."""
    for opt in optimizers:
        if opt is not None:
            return optimizer_facts(opt)
    return {}


def optimizer_facts(opt: Any) -> Dict[str, Any]:
    """One optimizer's facts (its first group): see :func:`optimizer_context`."""
    ctx: Dict[str, Any] = {"optimizer": type(opt).__name__,
                           "lr": [g.get("lr") for g in opt.param_groups if not hasattr(g.get("lr"), "shape")]}
    g = opt.param_groups[0] if opt.param_groups else {}
    for k in ("eps", "betas", "momentum"):
        v = g.get(k)
        if isinstance(v, (int, float)) or (isinstance(v, (tuple, list)) and all(isinstance(x, (int, float))
                                                                               for x in v)):
            ctx[k] = list(v) if isinstance(v, (tuple, list)) else v
    if isinstance(g.get("max_iter"), int) and "line_search_fn" in g:
        ctx["max_iter"] = g["max_iter"]
        ls = g.get("line_search_fn")
        ctx["line_search_fn"] = ls if isinstance(ls, str) else None
    return ctx


def each_optimizer(indexed: Sequence[Any], roots: Sequence[Any] = ()) -> List[Dict[str, Any]]:
    """``context["optimizers"]`` (read at a failure or a warning, never in a healthy step): per optimizer
    of ``indexed`` (``(index, optimizer)``, the index the history records carry), its facts and a label
    users recognise: the script's variable of it and of the model it trains, when ``__main__`` holds them
    (``optimizerD (Adam over netD)``), else its class and position (``the 2nd optimizer (Adam)``)."""
    from ..core.diagnosis.per_optimizer import label  # loaded at an event (the diagnosis package), not at start-up
    names = main_names()
    out = []
    for i, opt in indexed:
        if opt is None:
            continue
        facts = dict(optimizer_facts(opt), index=int(i))
        mine = {id(p) for g in opt.param_groups for p in g.get("params", ())}
        model = next((m for m in roots if any(id(p) in mine for p in m.parameters())), None)
        over = f" over {names.get(id(model)) or type(model).__name__}" if model is not None else ""
        facts["label"] = label(int(i), facts["optimizer"], names.get(id(opt)), over)
        out.append(facts)
    return out


