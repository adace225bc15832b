"""The op-family registry: per-op knowledge (ops, domain, evidence, rules) declared in one place.

Add an op rule
--------------
1. Declare the family once, in its group module under ``core/diagnosis/rules/`` (log, roots, trig,
   exp, division, softmax, stdvar; a new module is imported in ``rules/__init__.py``)::

       ERFINV = register(Family(
           "erfinv", ops={"erfinv"}, tf_ops={"Erfinv"},   # aten names (no overload, no "_"); TF op types
                                                            # ({"RealDiv": "div"} where the snake case differs)
           domain=Domain("ge", 1.0, abs=True),              # plain data: not finite where |x| >= 1
           evidence=("domain",), nodes=("erfinv",),         # facts to gather; 'ErfinvBackward0' -> 'erfinv'
           keep_forward=True, categories=("other",)))       # keep inputs for backward origins

2. Write its rule below it: ``fn(c: Case) -> cause | None`` (None lets later rules decide), e.g.
   ``@ERFINV.rule(DOMAIN)`` returning ``domain_result(c, "other", why=..., fixes=[...])``
   (``rules/domain.py``: a summary with the counts, the condition and the range), or your own
   ``text.result(category, summary, confidence, c.ev, fixes, c.method)``. Add
   ``@ERFINV.rule(BACKWARD + 20, stage="backward", match="op_or_node")`` for backward origins.
   Rules run by ``order`` (the slots below); the acosh family in ``rules/trig.py`` is a complete example.
3. Evidence: the ``"domain"`` gatherer is generic (counts of the inputs inside ``Domain``, for the value
   and the gradient), so a declared domain needs no backend code. For other numbers add a gatherer to
   ``nanguard/pytorch/locate/evidence.py`` (``@gatherer("my_fact")`` returning ``{"my_fact": ...}``)
   and list ``"my_fact"`` in ``evidence=``; it then also shows in ``cause.evidence.facts``.
4. Add a test that drives a real training step to the failure (``tests/torch/test_locate.py``) and
   regenerate ``docs/CATEGORIES.md`` (``python -m nanguard.core.diagnosis.docs > docs/CATEGORIES.md``).
The recorder and the dispatcher (``engine.py``) need no change.
"""
from __future__ import annotations

import importlib
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from . import roles as R

__all__ = ["Domain", "Family", "Rule", "register", "generic_rule", "family_of", "rules", "families",
           "keep_forward_ops", "ops_of", "evidence_names", "tf_canonical", "tf_ops_of", "keep_forward_tf_ops",
           "snake_case", "TRAP", "BACKWARD", "DOMAIN", "LATE"]

# Rule order slots (lower runs first; the first rule that returns a cause wins). The existing rules
# are numbered inside these slots, see rules/*.py.
TRAP = 100       # failures the forward hid from the loss (where-trap) and 0 ** negative powers
BACKWARD = 300   # backward-stage origins, matched by the forward op or the autograd node (310-350)
DOMAIN = 1400    # an op evaluated outside its domain (trig, acosh): after the masks, reductions, precision
LATE = 1500      # overflow families, then the generic low-precision and overflow rules (1600, 1700)

_CMP = {"le": (operator.le, "<="), "lt": (operator.lt, "<"), "ge": (operator.ge, ">="),
        "gt": (operator.gt, ">")}


@dataclass(frozen=True)
class Domain:
    """Where an op's value is non-finite, as plain data: ``x <cmp> limit`` on argument ``arg``
    (``|x|`` when ``abs``). ``grad_cmp``: where the gradient is non-finite, when that set is wider
    (acosh: the value is NaN for x < 1, the gradient 1/sqrt(x^2 - 1) is infinite at x = 1 too)."""
    cmp: str
    limit: float
    arg: int = 0
    kwarg: str = "self"
    abs: bool = False
    grad_cmp: str | None = None

    def __post_init__(self) -> None:
        if self.cmp not in _CMP or (self.grad_cmp is not None and self.grad_cmp not in _CMP):
            raise ValueError(f"Domain comparison must be one of {sorted(_CMP)}")

    def text(self, var: str = "x", grad: bool = False) -> str:
        """'x <= 0', '|x| >= 1' (the gradient's set with ``grad``)."""
        cmp = (self.grad_cmp or self.cmp) if grad else self.cmp
        lim = self.limit
        lim_s = str(int(lim)) if float(lim).is_integer() else repr(lim)
        return f"{'|' + var + '|' if self.abs else var} {_CMP[cmp][1]} {lim_s}"

    def contains(self, value: float, grad: bool = False) -> bool:
        """Is a single value inside the non-finite set?"""
        cmp = (self.grad_cmp or self.cmp) if grad else self.cmp
        v = abs(value) if self.abs else value
        return bool(_CMP[cmp][0](v, self.limit))


@dataclass
class Rule:
    """One step of the diagnosis chain. ``match``: 'op' (the examined op is in ``family``), 'node'
    (the backward node belongs to it), 'op_or_node', or 'any' (generic rules, ``family`` None)."""
    order: int
    fn: Callable[[Any], dict | None]
    family: "Family | None" = None
    stage: str = "any"
    match: str = "op"
    categories: tuple[str, ...] = ()
    seq: int = 0

    def applies(self, case: Any) -> bool:
        if self.stage == "backward" and case.stage != "backward":
            return False
        if self.family is None or self.match == "any":
            return True
        op = self.match in ("op", "op_or_node") and case.family is self.family
        node = self.match in ("node", "op_or_node") and self.family.has_node(case.node_family)
        return bool(op or node)


@dataclass(eq=False)
class Family:
    """Ops that fail the same way. ``ops``: aten names (overload and in-place ``_`` dropped);
    ``tf_ops``: TensorFlow op types, each with the aten name of the op with the same semantics (a
    mapping ``{"RealDiv": "div"}``, or a set where that name is the snake case: ``{"Log1p"}`` ->
    ``log1p``): a TensorFlow origin is diagnosed under that name; ``name_contains``: substrings for open-ended op names
    (fused attention kernels); ``domain`` / ``op_domains``: where the value is non-finite;
    ``evidence``: gatherer names the backend runs for an origin of these ops; ``nodes`` /
    ``node_prefixes``: autograd node families ('SqrtBackward0' -> 'sqrt') of its backward;
    ``keep_forward``: the recorder keeps the forward inputs so a backward origin can re-examine them;
    ``categories``: the causes its rules can return; ``note``: where it fails, in words, when that
    is not a ``Domain`` (both for the documentation)."""
    name: str
    ops: Iterable[str] = ()
    tf_ops: Iterable[str] = ()
    domain: Domain | None = None
    op_domains: Mapping[str, Domain] = field(default_factory=dict)
    evidence: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    node_prefixes: tuple[str, ...] = ()
    name_contains: tuple[str, ...] = ()
    keep_forward: bool = False
    categories: tuple[str, ...] = ()
    note: str = ""
    rules: list[Rule] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ops = frozenset(self.ops)
        self.tf_ops = tf_names(self.tf_ops)

    def domain_for(self, op: str | None) -> Domain | None:
        """The op's own domain (log1p: x <= -1) or the family's."""
        return self.op_domains.get(op or "", self.domain)

    def has_node(self, node_family: str) -> bool:
        return bool(node_family) and (node_family in self.nodes or node_family.startswith(self.node_prefixes))

    def rule(self, order: int, *, stage: str = "any", match: str = "op",
             categories: Iterable[str] | None = None) -> Callable:
        """Decorator: register ``fn(case) -> cause | None`` as a rule of this family."""
        def deco(fn: Callable) -> Callable:
            r = Rule(order, fn, self, stage, match, tuple(categories or self.categories))
            self.rules.append(r)
            _add_rule(r)
            return fn
        return deco


_FAMILIES: dict[str, Family] = {}
_BY_OP: dict[str, Family] = {}
_BY_TF_OP: dict[str, Family] = {}
_CONTAINS: list[Family] = []
_RULES: list[Rule] = []
_SORTED: list[Rule] | None = None
_LOADED = False


def load_rules() -> None:
    """Import the rule modules (they register the families and rules) before the first lookup: the
    package is loaded at the first failure, not by a healthy run that imports this module."""
    global _LOADED
    if not _LOADED:
        _LOADED = True  # (first: a rule module that looks up a family while it loads finds it registered)
        importlib.import_module(".rules", __package__)


def _add_rule(r: Rule) -> None:
    global _SORTED
    r.seq = len(_RULES)
    _RULES.append(r)
    _SORTED = None


def register(fam: Family) -> Family:
    """Add a family; an op name may belong to one family only."""
    if fam.name in _FAMILIES:
        raise ValueError(f"op family {fam.name!r} is already registered")
    for index, names in ((_BY_OP, fam.ops), (_BY_TF_OP, fam.tf_ops)):
        dup = sorted(n for n in names if n in index)
        if dup:
            raise ValueError(f"ops {dup} of family {fam.name!r} already belong to {index[dup[0]].name!r}")
    _FAMILIES[fam.name] = fam
    _BY_OP.update({n: fam for n in fam.ops})
    _BY_TF_OP.update({n: fam for n in fam.tf_ops})
    if fam.name_contains:
        _CONTAINS.append(fam)
    return fam


def generic_rule(order: int, *, stage: str = "any", categories: Iterable[str] = ()) -> Callable:
    """Decorator: a rule for every origin (it reads facts, not the op), e.g. the where-trap."""
    def deco(fn: Callable) -> Callable:
        _add_rule(Rule(order, fn, None, stage, "any", tuple(categories)))
        return fn
    return deco


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def snake_case(op_type: str) -> str:
    """'BiasAddGrad' -> 'bias_add_grad', 'Log1p' -> 'log1p' (leading underscores dropped)."""
    return _CAMEL.sub("_", op_type.lstrip("_")).lower()


def tf_names(tf_ops: Iterable[str] | Mapping[str, str]) -> dict[str, str]:
    """``{TF op type: aten name}`` from a mapping or a set of names (aten name = snake case)."""
    if isinstance(tf_ops, Mapping):
        return dict(tf_ops)
    return {n: snake_case(n) for n in tf_ops}


def tf_canonical(op_type: str) -> str:
    """The aten name a TensorFlow op is diagnosed under: its family's or role's (``RealDiv`` -> ``div``,
    ``SelectV2`` -> ``where``), else the snake case of the type (``Tanh`` -> ``tanh``)."""
    fam = _BY_TF_OP.get(op_type)
    if fam is not None:
        return fam.tf_ops[op_type]
    for role in R.ROLES:
        name = role.tf_ops.get(op_type)
        if name is not None:
            return name
    return snake_case(op_type)


def tf_ops_of(*names: str) -> frozenset[str]:
    """The TensorFlow op types of the named families."""
    load_rules()
    return frozenset(n for name in names for n in _FAMILIES[name].tf_ops)


def keep_forward_tf_ops() -> frozenset[str]:
    """TensorFlow forward ops whose inputs the recorder keeps (families with ``keep_forward``)."""
    load_rules()
    return frozenset(n for f in _FAMILIES.values() if f.keep_forward for n in f.tf_ops)


def family_of(op: str | None) -> Family | None:
    """The family of an op name: an aten name ('log', '_foreach_log') or a TensorFlow op type ('Log')."""
    load_rules()
    if not op:
        return None
    fam = _BY_OP.get(op) or _BY_TF_OP.get(op)
    if fam is None:
        for f in _CONTAINS:
            if any(s in op for s in f.name_contains):
                return f
    return fam


def rules() -> list[Rule]:
    """Every registered rule in the order the diagnosis tries them (ties: registration order)."""
    global _SORTED
    load_rules()
    if _SORTED is None:
        _SORTED = sorted(_RULES, key=lambda r: (r.order, r.seq))
    return _SORTED


def families() -> list[Family]:
    load_rules()
    return list(_FAMILIES.values())


def ops_of(*names: str) -> frozenset[str]:
    """The aten op names of the named families."""
    load_rules()
    return frozenset(n for name in names for n in _FAMILIES[name].ops)


def keep_forward_ops() -> frozenset[str]:
    """Forward ops whose inputs the recorder keeps for the re-examination of a backward origin."""
    load_rules()
    return frozenset(n for f in _FAMILIES.values() if f.keep_forward for n in f.ops)


def evidence_names() -> list[str]:
    """Every gatherer name some family asks for, in registration order."""
    load_rules()
    out: list[str] = []
    for f in _FAMILIES.values():
        out += [e for e in f.evidence if e not in out]
    return out
