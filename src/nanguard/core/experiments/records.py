"""What an experiment is (:class:`Spec`: one change to try) and what it gave (:class:`Experiment`).

Plain records: a backend runs a :class:`Spec` on its replayable step and returns an
:class:`Experiment`; the core judges it (``kinds``) and puts ``Experiment.as_dict()`` into the
report's ``cause.evidence.experiments``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

CONFIRMS = "confirms"
REFUTES = "refutes"


@dataclass
class Spec:
    """One counterfactual to run: ``kind`` (see :data:`nanguard.core.experiments.kinds.KINDS`) with its
    ``params`` (``{"module": "enc.1"}``, ``{"rows": [3]}``, ``{"factor": 0.1, "from_step": 12}``...),
    chosen to test ``hypothesis`` (a category); ``cost``: the planner's estimate in replays of one step."""

    kind: str
    params: Dict[str, Any] = field(default_factory=dict)
    hypothesis: Optional[str] = None
    cost: float = 1.0

    def key(self) -> tuple:
        """Two specs with the same key are the same experiment (run once, judged for every hypothesis)."""
        return (self.kind, tuple(sorted((k, repr(v)) for k, v in self.params.items())))


@dataclass
class Experiment:
    """The outcome of one :class:`Spec`.

    ``finite``: the replayed step (loss and gradients; for history replays every replayed step and
    update) was finite with the change; None when it could not run (``error``). ``change``: what was
    changed, in words. ``seconds``: its wall time; ``replays``: how many step replays it took;
    ``work``: the same in full-step replays (a replay on half of the batch's rows counts one half;
    0: as ``replays``), what the investigation's budget counts.
    ``details``: kind-specific findings (the rows bisection found, the snapshot a history replay
    started from, whether two replays were identical...). ``verdicts``: category -> confirms/refutes,
    filled by the core when judged."""

    kind: str
    change: str
    params: Dict[str, Any] = field(default_factory=dict)
    finite: Optional[bool] = None
    seconds: float = 0.0
    replays: int = 0
    work: float = 0.0
    error: Optional[str] = None
    details: Dict[str, Any] = field(default_factory=dict)
    verdicts: Dict[str, str] = field(default_factory=dict)

    @property
    def cost(self) -> float:
        """The work it took, in replays of one full step."""
        return float(self.work) if self.work else float(self.replays)

    @property
    def ran(self) -> bool:
        return self.error is None and self.finite is not None

    def as_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"kind": self.kind, "change": self.change, "finite": self.finite,
                             "seconds": round(float(self.seconds), 4), "replays": self.replays}
        if self.work and abs(self.work - self.replays) > 1e-9:
            d["work"] = round(float(self.work), 3)
        if self.params:
            d["params"] = dict(self.params)
        if self.error:
            d["error"] = self.error
        if self.details:
            d["details"] = dict(self.details)
        if self.verdicts:
            d["verdicts"] = dict(self.verdicts)
        return d


def confirmed_record(e: Experiment) -> Dict[str, Any]:
    """``cause.confirmed_by``: the experiment whose change made the step finite."""
    return {"kind": e.kind, "change": e.change, "finite": True, "seconds": round(float(e.seconds), 4),
            **({"params": dict(e.params)} if e.params else {})}


def ruled_out_record(category: str, e: Experiment, why: str) -> Dict[str, Any]:
    """One entry of ``cause.ruled_out``: a category the experiment ``e`` refuted, and how."""
    return {"category": category, "by": e.kind, "change": e.change, "finite": e.finite, "why": why}


def find(experiments: List[Experiment], kind: str, **params: Any) -> Optional[Experiment]:
    """The experiment of ``kind`` already run with these params (a subset match), if any."""
    for e in experiments:
        if e.kind == kind and all(e.params.get(k) == v for k, v in params.items()):
            return e
    return None
