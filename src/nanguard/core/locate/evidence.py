"""Evidence gatherers: how the facts about an origin op are collected, for every backend.

A gatherer is a function of a probe (the backend's view of the examined op's call, a
:class:`ProbeBase`) returning facts to merge into ``localization["facts"]``, or None. A backend keeps
one :class:`Gatherers` registry; ``@registry.register("name")`` adds one. Gatherers registered with
``always=True`` run for every origin, the others only for ops whose diagnosis family
(``nanguard.core.diagnosis.families``) lists the name in its ``evidence``. They run in registration
order, which is the key order of the facts. The diagnosis rules read the facts by the same names,
so rules work for every backend.

The *examined* op is the origin op itself, or for a backward origin the forward op it
differentiates when the op log kept its inputs (``facts["examined"]``: ``forward_op`` /
``backward_op``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["Gatherers", "ProbeBase"]


class Gatherers(Dict[str, Tuple[Callable[[Any], Optional[dict]], bool]]):
    """name -> (gatherer, always), in registration order."""

    def register(self, name: str, *, always: bool = False) -> Callable:
        """Register ``fn(probe) -> dict | None`` as the gatherer ``name`` (a family lists it in ``evidence``)."""
        def deco(fn: Callable) -> Callable:
            if name in self:
                raise ValueError(f"evidence gatherer {name!r} is already registered")
            self[name] = (fn, always)
            return fn
        return deco

    def run(self, probe: "ProbeBase", catch: bool = False) -> Dict[str, Any]:
        """Run the gatherers that apply to ``probe`` (the always-on ones, and those its family asks
        for), merging their facts into ``probe.facts``. ``catch``: a gatherer that raises leaves
        ``<name>_error`` and the others still run (else the exception propagates)."""
        wanted = set(probe.family.evidence) if probe.family is not None else set()
        for name, (fn, always) in self.items():
            if always or name in wanted:
                if catch:
                    try:
                        out = fn(probe)
                    except Exception as e:
                        out = {f"{name}_error": f"{type(e).__name__}: {str(e)[:120]}"}
                else:
                    out = fn(probe)
                if out:
                    probe.facts.update(out)
        return probe.facts


class ProbeBase:
    """What every backend's probe has: the facts gathered so far, the examined op's diagnosis family."""

    facts: Dict[str, Any]
    family: Any

    def examine(self, stage: str, fwd: Optional[int], keep: Dict[int, tuple]) -> Optional[tuple]:
        """Start the facts; the kept forward call (the op log's ``keep`` entry) to examine instead of a
        backward origin op, or None (the origin op itself is examined)."""
        self.facts = {}
        if stage == "backward" and fwd is not None and fwd in keep:
            self.facts["examined"] = "forward_op"
            return keep[fwd]
        if stage == "backward":
            self.facts["examined"] = "backward_op"
        return None

    def in_family(self, name: str) -> bool:
        return self.family is not None and self.family.name == name
