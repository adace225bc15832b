"""What a rule sees: one origin with its evidence, read once into plain attributes."""
from __future__ import annotations

from . import families as F
from .text import LOW_DTYPES, api_or_op, node_family, opshort, where


class Case:
    """The origin op (``origin``), the evidence facts (``facts``), the history signals (``sig``) and
    what the rules derive from them. ``examined`` is the op whose semantics matter: the forward op
    of a backward origin, else the origin op; ``family`` is its family, ``node_family`` the
    autograd node's ('SqrtBackward0' -> 'sqrt'). ``ev`` is the evidence dict of the cause (rules
    may add to it) and ``method`` says how the origin was found."""

    def __init__(self, origin: dict, facts: dict, sig: dict, phase: str, ev: dict, method: str,
                 ctx: dict) -> None:
        self.origin, self.facts, self.sig, self.phase = origin, facts, sig, phase
        self.ev, self.method, self.ctx = ev, method, ctx
        self.op = opshort(origin.get("op"))
        # an op of a backward the user wrote (a torch.autograd.Function) is code like a forward op: judged
        # by the op itself and its own inputs, not as the derivative of the forward op that made the node
        self.stage = "forward" if origin.get("custom_backward") else origin.get("stage")
        self.node = origin.get("autograd_node")
        self.fwd = opshort(origin.get("forward_op")) if origin.get("forward_op") else None
        self.dtype = origin.get("dtype") or ""
        self.low = self.dtype in LOW_DTYPES
        self.where = where(origin)
        self.out = origin.get("output") or {}
        self.api = api_or_op(origin)
        self.f64 = facts.get("float64_check") or {}
        self.f32 = facts.get("float32_check") or {}
        self.inf_only = (self.out.get("posinf") or self.out.get("neginf")) and not self.out.get("nan")
        self.overflow_range = bool(self.inf_only and (self.f64.get("finite") or self.f32.get("direct_finite")))
        self.examined = self.fwd if (self.stage == "backward" and self.fwd) else self.op
        self.backward_failure = self.stage == "backward" or phase == "backward"
        self.family = F.family_of(self.examined)
        self.node_family = node_family(self.node)

    def excludes(self, category: str) -> bool:
        """An experiment ruled ``category`` out (``ctx["exclude_categories"]``): a rule that could name it
        or another cause names the other one."""
        return category in (self.ctx.get("exclude_categories") or ())

    def domain(self) -> F.Domain | None:
        """The declared domain of the examined op."""
        return self.family.domain_for(self.examined) if self.family is not None else None

    def __repr__(self) -> str:
        return f"Case({self.examined!r}, stage={self.stage!r}, family={getattr(self.family, 'name', None)!r})"
