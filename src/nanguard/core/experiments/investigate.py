"""The investigation of one diagnosed failure: experiments cheapest first, within a budget counted in
work (replays of one step, never seconds: the same failure gets the same experiments, and so the same
cause, however loaded or slow the machine is), stopping at the first that confirms or refutes the leading cause; a refuted cause is dropped and
the next candidate (the cause the experiment proves, or the diagnosis re-run without the refuted
categories) is tested in turn.

The backend supplies a :class:`Bench` (its replayable step, able to run a :class:`Spec`); the event
is updated in place:

* ``cause.evidence.experiments``: every experiment (what was changed, finite or not, seconds);
* ``cause.evidence.experiments_cost``: the replays spent and the budget in replays (what decides which
  experiments run), total seconds, one training step's seconds and their ratio (for information);
* ``cause.confirmed_by``: the experiment whose change made the step finite, when one confirmed it;
* ``cause.ruled_out``: the categories experiments refuted, and how;
* ``cause.confidence``: calibrated from the outcome (:mod:`.verdict`).
"""
from __future__ import annotations

import abc
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .config import ExperimentConfig
from .implied import implied_cause
from .kinds import KINDS, judge
from .planner import Situation, plan
from .records import CONFIRMS, Experiment, Spec, ruled_out_record
from .tested import passes
from .verdict import NEEDS_PROOF, finalize

MAX_HYPOTHESES = 4


class Bench(abc.ABC):
    """A backend's replayable failing step, able to run experiments on it. ``framework``: the words of the
    fixes the experiments reword (``nanguard.core.diagnosis.fixes``)."""

    framework: str = "pytorch"

    @abc.abstractmethod
    def capabilities(self, origin: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """What it can do (see :class:`~nanguard.core.experiments.planner.Situation`'s ``caps``)."""

    @abc.abstractmethod
    def run(self, spec: Spec, replays_left: float) -> Experiment:
        """Run one experiment (never raises: a failure to run is ``Experiment.error``); the training
        state, gradients, buffers and RNG are as before afterwards. ``replays_left``: the budget left, in
        replays of one step (an experiment of many replays, a bisection, stays within it); the
        experiment counts its replays in ``Experiment.replays``."""

    @abc.abstractmethod
    def step_seconds(self) -> Optional[float]:
        """The wall time of one ordinary training step (reported beside the cost, never decides), if known."""


def run_with(bench: Bench, spec: Spec, replays_left: float, runners: Dict[str, Callable[..., None]],
             who: str) -> Experiment:
    """A backend's :meth:`Bench.run`: the runner of ``spec.kind`` (``runner(bench, experiment,
    replays_left)``) fills the experiment; an error is recorded in it, never raised (``who``: the
    backend, in the error of a kind it has no runner for)."""
    from .kinds import describe
    e = Experiment(kind=spec.kind, change=describe(spec.kind, spec.params), params=dict(spec.params))
    t0 = time.perf_counter()
    try:
        runner = runners.get(spec.kind)
        if runner is None:
            raise ValueError(f"no {who} experiment of kind {spec.kind!r}")
        runner(bench, e, float(replays_left or 0.0))
    except Exception as ex:  # never break the run for an experiment
        e.finite, e.error = None, f"{type(ex).__name__}: {str(ex)[:200]}"
    e.seconds = time.perf_counter() - t0
    return e


# A re-diagnosis with categories excluded: returns (cause, fixes), or None.
Rediagnose = Callable[[Sequence[str]], Optional[tuple]]


def investigate(event: Any, bench: Bench, config: ExperimentConfig, *, rediagnose: Optional[Rediagnose] = None,
                history: Sequence[dict] = (), recovering: bool = False, prior: Sequence[Experiment] = ()) -> Dict[str, Any]:
    """Run the experiments for ``event`` (a :class:`nanguard.core.events.Event` with its diagnosis) and
    record them in its cause. ``prior``: experiments the backend already ran on this step (judged
    first, counted in the cost). Returns a summary ``{"experiments": n, "confirmed_by": kind or None,
    "ruled_out": [...], "seconds": s}``."""
    inv = _Investigation(event, bench, config, rediagnose, list(history), recovering)
    for e in prior:
        inv.experiments.append(e)
        inv.spent += e.cost
        inv.seconds += e.seconds
    inv.run()
    return inv.summary()


class _Investigation:
    def __init__(self, event, bench: Bench, config: ExperimentConfig, rediagnose, history, recovering) -> None:
        self.event, self.bench, self.config = event, bench, config
        self.rediagnose, self.history, self.recovering = rediagnose, history, recovering
        self.origin = event.origin or {}
        self.caps = bench.capabilities(event.origin)
        self.step_s = bench.step_seconds()
        self.budget = config.budget_replays()
        self.spent = 0.0    # replays of one step: what the budget counts
        self.seconds = 0.0  # wall time: reported, never decides
        self.experiments: List[Experiment] = []
        self.ruled_out: List[Dict[str, Any]] = []
        self.confirmed: Optional[Experiment] = None
        self.skipped: List[str] = []
        self.original = dict(event.cause or {}).get("category")
        self.implied = False  # the cause was written from the experiment that proves it

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        cat = (self.event.cause or {}).get("category") or "other"
        tried: List[str] = []
        while cat and cat not in tried and len(tried) < MAX_HYPOTHESES:
            tried.append(cat)
            verdict = self._test(cat)
            if verdict is None:
                break
            v, e = verdict
            if v == CONFIRMS:
                self.confirmed = e
                break
            if cat != "other":  # "other" is no cause to rule out: only replaced by what e proves
                self.ruled_out.append(ruled_out_record(cat, e, _why(cat, e)))
            nxt = self._next_candidate(cat, e)
            if nxt is None or self.confirmed is not None:
                break
            cat = nxt
        self._verify_for_recovery()
        unavailable = self._unavailable()
        if unavailable:  # recovery may take these actions unverified (recovery/verify.py)
            ev = self.event.cause.setdefault("evidence", {})
            ev["experiments_unavailable"] = unavailable
            why = self._unavailable_why(unavailable)
            if why:
                ev["experiments_unavailable_why"] = why
        finalize(self.event, self.experiments, self.confirmed, self.ruled_out, self._cost(), self.original,
                 self.implied, framework=getattr(self.bench, "framework", None))

    def _unavailable(self) -> List[str]:
        """The experiment kinds this step cannot run at all (not the ones left out by the config or
        the budget): history replays need a snapshot before the step, an upcast a module path."""
        out = []
        if not self.caps.get("snapshots"):
            out += ["lr_replay", "clip_replay"]
        if not self.caps.get("module_chain"):
            out.append("upcast_module")
        return out + [k for k in self.caps.get("unsupported") or {} if k not in out]

    def _unavailable_why(self, kinds: List[str]) -> Dict[str, str]:
        """Why a kind cannot run, where the step says more than "no snapshot": the backend's own reasons
        (``caps["unsupported"]``: kind -> why), or an update written by hand."""
        out = {k: why for k, why in (self.caps.get("unsupported") or {}).items() if k in kinds}
        if "lr_replay" in kinds and "lr_replay" not in out and "lrs" in self.caps and not self.caps.get("lrs"):
            why = ("the script updates the weights by hand (no optimizer object): nanguard cannot replay the "
                   "update with another step size")
            out.update(lr_replay=why, clip_replay=why)
        return out

    def _situation(self, cat: str) -> Situation:
        ev = (self.event.cause or {}).get("evidence") or {}
        steps = max(self.config.budget_steps, 1.0)
        return Situation(category=cat, origin=self.origin, phase=self.event.phase,
                         reproduced=bool((self.event.localization or {}).get("reproduced")), step=self.event.step,
                         caps=self.caps, history=self.history, evidence=ev, max_replay_steps=steps)

    def _ctx(self) -> Dict[str, Any]:
        o = self.origin or {}
        # a cast of a gradient back into the low-precision region (autocast's ToCopyBackward): it overflows at
        # the boundary of whatever module is upcast, so a module in float32 proves nothing against low precision
        cast_back = o.get("stage") == "backward" and str(o.get("autograd_node") or "").startswith("ToCopyBackward")
        return {"low": self._situation("other").low, "cast_backward": cast_back}

    def _test(self, cat: str) -> Optional[tuple]:
        """The first experiment (already run, or planned cheapest first) that confirms or refutes ``cat``."""
        for e in self.experiments:
            v = judge(cat, e, self._ctx())
            if v is not None:
                return v, e
        for spec in plan(cat, self._situation(cat)):
            e = self._run(spec)
            if e is None:
                break  # out of budget
            v = judge(cat, e, self._ctx())
            if v is not None:
                return v, e
        return None

    def _run(self, spec: Spec) -> Optional[Experiment]:
        if not self.config.allows(spec.kind):
            return _NOT_ALLOWED
        for e in self.experiments:
            if (e.kind, e.params) == (spec.kind, spec.params):
                return e
        if self.spent + spec.cost > self.budget + 1e-9:
            self.skipped.append(spec.kind)
            return None
        t0 = time.perf_counter()
        e = self.bench.run(spec, max(self.budget - self.spent, 0.0))
        e.seconds = e.seconds or (time.perf_counter() - t0)
        self.seconds += e.seconds
        self.spent += e.cost
        self.experiments.append(e)
        return e

    def _next_candidate(self, refuted: str, e: Experiment) -> Optional[str]:
        """Replace the refuted cause by what ``e`` proves, or by the diagnosis without the refuted ones."""
        cause = self.event.cause or {}
        ev = dict(cause.get("evidence") or {})
        method = (self.event.localization or {}).get("method") or ""
        new = implied_cause(refuted, e, self.origin, ev, method)
        fixes = None
        if new is not None:  # the refuting experiment also proves this cause
            fixes = new.pop("fixes", [])
            new.pop("method", None)
            self.confirmed, self.implied = e, True
            judge(new["category"], e, self._ctx())
        elif self.rediagnose is not None:
            out = self.rediagnose([r["category"] for r in self.ruled_out])
            if out is None:
                return None
            new, fixes = out
        if new is None or (self.confirmed is None and new.get("category") in {r["category"] for r in self.ruled_out}):
            return None
        new.setdefault("evidence", {})
        new["evidence"].setdefault("detected", ev.get("detected"))
        new["evidence"]["first_candidate"] = {"category": cause.get("category"), "summary": cause.get("summary")}
        self.event.cause = new
        if fixes is not None:
            self.event.fixes = list(fixes)
        return new.get("category")

    def _verify_for_recovery(self) -> None:
        """With recovery on: run the experiment that proves the recovery action of the final cause (the
        module to upcast, the rows to drop, the lower learning rate), if not already run."""
        if not self.recovering:
            return
        cat = (self.event.cause or {}).get("category") or "other"
        if cat in {r["category"] for r in self.ruled_out}:
            return
        action = NEEDS_PROOF.get(cat)
        if action is None or any(passes(e.finite, e.details) and KINDS[e.kind].verifies == action
                                 for e in self.experiments):
            return
        # The action is applied only if verified: its replay may use a second budget (the alternative
        # is to skip the step and, if it recurs, stop the run).
        self.budget += self.config.budget_replays()
        for spec in plan(cat, self._situation(cat)):
            if KINDS[spec.kind].verifies != action:
                continue
            e = self._run(spec)
            if e is None:
                return
            if e is not _NOT_ALLOWED:
                judge(cat, e, self._ctx())
            if e is not _NOT_ALLOWED and passes(e.finite, e.details):
                if self.confirmed is None and e.verdicts.get(cat) == CONFIRMS:
                    self.confirmed = e
                return

    def _cost(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"replays": round(self.spent, 3), "budget_replays": round(self.budget, 4),
                             "budget_steps": self.config.budget_steps, "seconds": round(self.seconds, 4)}
        if self.step_s:
            d["step_seconds"] = round(self.step_s, 5)
            d["step_multiple"] = round(self.seconds / self.step_s, 2)
        if self.skipped:
            d["not_run_for_budget"] = sorted(set(self.skipped))
        return d

    def summary(self) -> Dict[str, Any]:
        return {"experiments": len(self.experiments), "confirmed_by": self.confirmed.kind if self.confirmed else None,
                "ruled_out": [r["category"] for r in self.ruled_out], "replays": round(self.spent, 3),
                "seconds": round(self.seconds, 4)}


def _why(cat: str, e: Experiment) -> str:
    if e.finite:
        return f"with {e.change} the step is finite, which {cat} does not allow"
    return f"with {e.change} the step is still non-finite, so {cat} is not what makes it fail"


# An experiment the configuration does not allow: planned, not run, judged as nothing.
_NOT_ALLOWED = Experiment(kind="not_allowed", change="not allowed by the configuration")
