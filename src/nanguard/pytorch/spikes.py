"""Early warning for the PyTorch drivers: the detector on the monitor, warning events, the on-spike action.

The :class:`~nanguard.core.spike.SpikeDetector` is judged inside :meth:`StepMonitor.check` on the numbers
its one sync already read (no tensor, no extra sync); a driver calls :meth:`SpikeResponder.after_check`
right after each check that found nothing. On a warning it builds the event (``kind`` "warning", the
cause diagnosed from the step history: :mod:`nanguard.core.alerts`), prints one line on stderr and,
with ``on_spike``:

* ``"warn"`` (default): nothing else, the step is applied;
* ``"skip"``: the step's gradients are dropped (its update changes nothing), like OLMo's spike skipping;
* ``"rollback"``: back to a snapshot from before the excursion began, the learning rate lowered as the
  diagnosis says (the gradients scaled for hand-written updates; clipping for a gradient jump), and
  the step dropped: needs the recovery policy's snapshots.

``after_check`` returns True when the driver must treat the step as skipped.

Sync-free mode (:mod:`nanguard.pytorch.syncfree`): the detector is judged when a check's values are
read, one or more steps after its update was applied (``late=True``). A warning is then the same
event; ``"skip"`` cannot take back an applied update (the warning says so and the run goes on), and
``"rollback"`` still goes back to a snapshot from before the excursion (dropping the updates since).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from ..core.alerts import warning_event, warning_line
from ..core.events import Event
from ..core.render.terminal import print_line
from ..core.spike import ON_SPIKE, SpikeConfig, SpikeDetector
from .detect.verdict import total_norm as _total
from .recover.skip import skip_step


class SpikeResponder:
    """The early warnings of one driver (a Guard or a Watcher)."""

    def __init__(self, monitor: Any, on_spike: str = "warn", quiet: bool = False,
                 config: Optional[SpikeConfig] = None) -> None:
        if on_spike not in ON_SPIKE:
            raise ValueError(f"on_spike must be one of {', '.join(ON_SPIKE)}, got {on_spike!r}")
        self.monitor = monitor
        self.on_spike = on_spike
        self.quiet = quiet
        self.events: List[Event] = []
        monitor.spikes = SpikeDetector(config)

    def after_check(self, opt: Any, *, modules: Sequence[Any], optimizers: Sequence[Any], scaler: Any = None,
                    policy: Any = None, context: Optional[Dict[str, Any]] = None, late: bool = False) -> bool:
        """Right after a check of ``opt`` (None: backward counting) that found nothing. True: skip the step
        (``late``, read after its update was applied: True only when the weights were rolled back)."""
        hit = self.monitor.spike
        if hit is None:
            return False
        self.monitor.spike = None
        step = int(hit.get("step", self.monitor.step_of(opt)))
        hist = [h for h in self.monitor.history.raw_dicts() if h.get("step", 0) < step]
        hist.append(self._current(step, opt))
        ctx = dict(context) if context is not None else optimizer_context(optimizers)
        ev = warning_event(hit, hist, ctx)
        self.events.append(ev)
        act = None
        skip = self.on_spike != "warn"
        if late and self.on_spike == "skip":  # sync-free: the update is applied by now
            skip, act = False, "not skipped: read after its update was applied (sync-free)"
        elif self.on_spike == "rollback" and policy is not None:
            rec = policy.spike(ev, step=step, modules=list(modules), optimizers=list(optimizers), scaler=scaler,
                               roots=list(modules), history=hist[:-1], rollback=True)
            if rec is None:  # no sound action (e.g. Adam's beta2): the warning stands, the step is applied
                skip, act = False, "no action: " + str((ev.cause.get("evidence") or {}).get("recovery_unsound"))
            else:
                act = rec.get("action")
                back = (rec.get("actions") or {}).get("rollback")
                if back:  # the replayed run is judged against the state before the excursion
                    self.monitor.spikes.rewind(back["to_step"])
                elif late:  # no rollback: the step itself cannot be dropped any more
                    skip, act = False, f"{act}: too late to drop the step (read after its update, sync-free)"
                    rec["late"] = True
        elif skip:
            ev.recovery = {"action": "skip_step", "ok": True, "category": (ev.cause or {}).get("category"),
                           "actions": {"skip_step": skip_step(list(optimizers), list(modules))}}
            act = "skip_step"
        if not self.quiet:
            print_line(warning_line(ev, act))
        return skip

    def _current(self, step: int, opt: Any) -> Dict[str, Any]:
        """The record of the warning's own step, from what its check read (the history gets it after the update)."""
        last = getattr(self.monitor, "_last", None) or {}
        lrs = []
        if opt is not None:
            lrs = [float(g["lr"]) for g in opt.param_groups if isinstance(g.get("lr"), (int, float))]
        pn = _total(last.get("pn"))
        gn = _total(last.get("gn"))
        ratio = lrs[0] * gn / pn if lrs and pn and gn is not None and math.isfinite(gn) else None
        return {"step": step, "loss": last.get("loss"), "grad_norm": gn, "param_norm": pn, "lr": lrs,
                "update_ratio": ratio, "batch_max": last.get("batch_max"), "skipped": False}


def optimizer_context(optimizers: Sequence[Any]) -> Dict[str, Any]:
    """The optimizer facts the diagnosis reads (first optimizer, first group): its name, the learning
    rates, eps, betas, momentum."""
    ctx: Dict[str, Any] = {}
    for opt in optimizers:
        if opt is None:
            continue
        ctx["optimizer"] = type(opt).__name__
        ctx["lr"] = [g.get("lr") for g in opt.param_groups if not hasattr(g.get("lr"), "shape")]
        g = opt.param_groups[0] if opt.param_groups else {}
        for k in ("eps", "betas", "momentum"):
            v = g.get(k)
            if isinstance(v, (int, float)) or (isinstance(v, (tuple, list)) and all(isinstance(x, (int, float))
                                                                                   for x in v)):
                ctx[k] = list(v) if isinstance(v, (tuple, list)) else v
        break
    return ctx
