"""``experiments=`` (``Guard(experiments=...)``, ``nanguard run --experiments``): on or off, the
budget (in replays of one step), the allowed kinds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .kinds import KINDS


@dataclass(frozen=True)
class ExperimentConfig:
    """``budget_steps``: the work the experiments may add at a failure, in replays of one training step
    (the investigation stops before an experiment whose planned cost would pass it; counted in work,
    not seconds, so the outcome does not depend on the machine's load); ``max_seconds``: kept for
    backwards compatibility (a replay's own guard; it no longer decides what runs); ``kinds``: the allowed kinds (None: all); ``keep_steps``: how many past steps'
    batches a driver keeps for history replays (``lr_replay``/``clip_replay``, with recovery only)."""

    enabled: bool = True
    budget_steps: float = 3.0
    max_seconds: float = 120.0
    kinds: Optional[Tuple[str, ...]] = None
    keep_steps: int = 3

    def __post_init__(self) -> None:
        if self.budget_steps <= 0:
            raise ValueError(f"the experiments' budget must be > 0 steps, got {self.budget_steps}")
        bad = [k for k in (self.kinds or ()) if k not in KINDS]
        if bad:
            raise ValueError(f"unknown experiment kind(s) {bad}; choose from {', '.join(KINDS)}")

    def allows(self, kind: str) -> bool:
        return self.enabled and (self.kinds is None or kind in self.kinds)

    def budget_replays(self) -> float:
        """The budget at a failure, in replays of one step (the planner's ``Spec.cost`` unit)."""
        return float(self.budget_steps)

    @classmethod
    def from_spec(cls, spec: Any) -> "ExperimentConfig":
        """``None``/``False``/``"off"``: none; ``True``/``"auto"``: the defaults; a number: the budget in
        training steps; ``"drop_samples,upcast_module"``: only those kinds; a dict: the fields; or an
        ExperimentConfig."""
        if isinstance(spec, cls):
            return spec
        if spec is None or spec is False or (isinstance(spec, str) and spec.strip().lower() in ("off", "none", "0")):
            return cls(enabled=False)
        if spec is True or (isinstance(spec, str) and spec.strip().lower() in ("auto", "on", "")):
            return cls()
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            return cls(budget_steps=float(spec))
        if isinstance(spec, str):
            try:
                return cls(budget_steps=float(spec))
            except ValueError:
                return cls(kinds=tuple(s.strip() for s in spec.split(",") if s.strip()))
        if isinstance(spec, (list, tuple)):
            return cls(kinds=tuple(spec))
        if isinstance(spec, dict):
            d = dict(spec)
            if "kinds" in d and d["kinds"] is not None:
                d["kinds"] = tuple(d["kinds"])
            return cls(**d)
        raise ValueError(f"experiments must be 'auto', 'off', a budget in steps, a comma list of kinds or a "
                         f"dict, got {spec!r}")
