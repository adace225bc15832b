"""Local data flow: which values are at risk, and which passed a guard.

A value is summarised by a set of tags (what made it), computed from its expression and from the tags
of the names it reads. Statements are walked in source order, so a name has the tags of its last
assignment. The tags:

* ``softmax``, ``sigmoid``: a probability that rounds to exactly 0 (or 1); ``relu``: exactly 0 on half its
  inputs; ``count``: a sum of a mask, a ``count_nonzero``, the ``len()``/``numel()`` of a filtered
  selection (0 for an empty set) -- together the ``ZERO`` tags: a log or a division of them is at risk;
* ``mask`` (a comparison), ``filtered`` (``x[mask]``, ``nonzero``, a comprehension with ``if``);
* ``norm``, ``std``, ``var``: a norm, standard deviation or variance (0 for a constant/zero input);
* ``square``, ``sumsq`` (a sum/mean of squares, 0 when every term is), ``negdiff`` (a one-pass variance
  ``E[x^2] - E[x]^2``, negative by rounding), ``diff``;
* ``cos``: a dot product or cosine similarity (beyond +-1 by rounding);
* ``logprob``: a log-probability; ``exp`` an exp of an unbounded value, ``bounded`` a clamped or
  max-subtracted one, ``rowmax`` a max;
* ``neginf``: filled with -inf; ``causal``: made from ``tril``/``triu`` (a causal mask keeps one key per row).

A guard removes the risk tags: ``clamp``/``clip``/``maximum``, ``+ eps`` (any addition of a value that
is not itself at risk), ``torch.where``/``tf.where`` on a safe branch, ``F.normalize``, a fused
stable op (``log_softmax``, ``logsigmoid``, ``logsumexp``), ``max(x, 1)``, an in-place ``clamp_`` or an
indexed assignment that patches the value (``den[den == 0] = 1``).
"""
from __future__ import annotations

import ast
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

from .calls import call_tags
from .names import Aliases, Op, dotted
from .tags import CAN_VANISH, NONE, PROB, RISK, ZERO, Tags, arg, is_neg_inf, is_pos_inf, kwarg, names_in

__all__ = ["ModuleInfo", "Flow", "own_exprs", "walk_calls", "probability_params", "aug_binop", "is_no_grad",
           # re-exported for the rules
           "Tags", "ZERO", "RISK", "PROB", "CAN_VANISH", "is_neg_inf", "is_pos_inf", "arg", "kwarg", "names_in"]

_NOGRAD = {"no_grad", "inference_mode", "enable_grad_false"}


def own_exprs(stmt: ast.stmt) -> Iterator[ast.AST]:
    """The expressions a statement evaluates itself (not those of the statements nested in it)."""
    for field, value in ast.iter_fields(stmt):
        if field in ("body", "orelse", "finalbody", "handlers", "decorator_list", "cases"):
            continue
        if isinstance(value, ast.AST):
            yield value
        elif isinstance(value, list):
            yield from (v for v in value if isinstance(v, ast.AST))


class ModuleInfo:
    """File-wide facts: the imports, what names and ``self.`` attributes are bound to (``criterion =
    nn.BCELoss()``, ``self.register_buffer('bias', torch.tril(...))``), whether the file trains in
    float16."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.aliases = Aliases(tree)
        self.bindings: Dict[str, Optional[ast.expr]] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self._bind_key(node.targets[0].id, node.value)
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                self._bind_attrs(cls)
        self.torch = self.aliases.uses("torch")
        self.tf = self.aliases.uses("tf") or self.aliases.uses("keras")
        self.framework = "tensorflow" if self.tf and not self.torch else "pytorch"
        self.functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self._returns: Dict[str, Optional[Tags]] = {}

    def returns(self, key: str) -> Tags:
        """What a function of this file (``name``) or a model class's forward/call (``Class``) returns: its
        tags, and ``@i:tag`` for the i-th element of a returned tuple. Computed once, recursion-safe."""
        if key in self._returns:
            return self._returns[key] or NONE
        self._returns[key] = None  # in progress: a recursive call sees nothing
        fn, cls = self.functions.get(key), ""
        if fn is None and key in self.classes:
            cls = key
            fn = next((m for m in self.classes[key].body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and m.name in ("forward", "call", "__call__")), None)
        out = NONE
        if fn is not None:
            flow = Flow(self, cls=cls)
            for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
                flow.env[a.arg] = NONE
            out = flow.returned(fn.body)
        self._returns[key] = out
        return out

    def _bind_attrs(self, cls: ast.ClassDef) -> None:
        """``self.x = ...`` and ``self.register_buffer('x', ...)`` in the class's methods, as ``Class:self.x``."""
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and getattr(node, "value", None) is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                key = dotted(targets[0]) if len(targets) == 1 else None
                if key and key.startswith("self.") and key.count(".") == 1:
                    self._bind_key(f"{cls.name}:{key}", node.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "register_buffer" and len(node.args) >= 2 and \
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                self._bind_key(f"{cls.name}:self.{node.args[0].value}", node.args[1])

    def _bind_key(self, key: str, value: ast.expr) -> None:
        if key in self.bindings and (self.bindings[key] is None or ast.dump(self.bindings[key]) != ast.dump(value)):
            self.bindings[key] = None  # bound to different things: unknown
        else:
            self.bindings[key] = value

    def module_ctor(self, ctor: ast.AST) -> Optional[Op]:
        """The op of a module constructor call (``nn.BCELoss()``, ``nn.Softmax(dim=1)``), else None."""
        if isinstance(ctor, ast.Call):
            op = self.aliases.op(ctor)
            if op is not None and op.module:
                return op
        return None


class Flow:
    """The tags of the values of one function body (or of the module's top level)."""

    def __init__(self, info: ModuleInfo, no_grad: bool = False, cls: str = "") -> None:
        self.info = info
        self.env: Dict[str, Tags] = {}
        self.defs: Dict[str, ast.expr] = {}
        self.no_grad = no_grad
        self.cls = cls
        self._memo: Dict[int, Tags] = {}
        self.nonempty: set = set()          # names a condition tested (if b: ..., if not b: return)
        self.inputs: FrozenSet[str] = frozenset()  # the function's tensor parameters
        self.tested_here: FrozenSet[str] = frozenset()
        self.scope: Optional[ast.AST] = None  # the function (or module) whose body this is
        self._calls: Optional[Dict[str, List[int]]] = None

    def call_lines(self, name: str) -> List[int]:
        """The lines of this body's calls of a function or method named ``name`` (``loss.backward()``,
        ``clip_grad_norm_(...)``), nested functions and classes excluded."""
        if self._calls is None:
            self._calls = {}
            stack = list(getattr(self.scope, "body", None) or [])
            while stack:
                n = stack.pop()
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    continue
                if isinstance(n, ast.Call):
                    f = n.func
                    key = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                    if key:
                        self._calls.setdefault(key, []).append(n.lineno)
                stack.extend(ast.iter_child_nodes(n))
        return sorted(self._calls.get(name, ()))

    def tested(self, node: Optional[ast.AST]) -> bool:
        """A name in ``node`` was tested by a surrounding condition (``if n > 0``, ``... if b else``)."""
        names = names_in(node)
        return bool(names & self.nonempty or names & self.tested_here)

    def bound(self, key: Optional[str]) -> Optional[ast.expr]:
        """What a module-level name or a ``self.`` attribute of this class is bound to."""
        if not key:
            return None
        if key.startswith("self."):
            return self.info.bindings.get(f"{self.cls}:{key}") if self.cls else None
        return self.info.bindings.get(key)

    # ------------------------------------------------------------------ values
    def module_op(self, func: ast.AST) -> Optional[Op]:
        """The op of a module object being called: ``criterion(...)`` after ``criterion = nn.BCELoss()``
        (in this body or at module level), ``self.softmax(x)``, ``nn.Softmax(dim=-1)(x)``."""
        if isinstance(func, ast.Call):
            return self.info.module_ctor(func)
        key = dotted(func)
        if key is None:
            return None
        if key in self.defs:
            return self.info.module_ctor(self.defs[key])
        if key in self.env:
            return None
        return self.info.module_ctor(self.bound(key))

    def op(self, call: ast.Call) -> Optional[Op]:
        return self.module_op(call.func) or self.info.aliases.op(call)

    def call_of(self, node: ast.AST, names: Tuple[str, ...], fw: Optional[str] = None,
                modules: bool = False) -> Optional[Op]:
        """The op of ``node`` when it is a call of one of ``names`` (in framework ``fw``). Constructing a
        module is not a call of its op; calling the module object is, where ``modules`` allows it."""
        if not isinstance(node, ast.Call):
            return None
        op = self.op(node)
        if op is None or op.name not in names or (fw is not None and op.fw != fw):
            return None
        if op.module and (not modules or self.module_op(node.func) is None):
            return None
        return op

    def value(self, node: Optional[ast.AST], depth: int = 0) -> Tags:
        if node is None or depth > 12:
            return NONE
        memo = self._memo.get(id(node))
        if memo is None:
            memo = self._memo[id(node)] = self._value(node, depth + 1)
        return memo

    def _value(self, node: ast.AST, d: int) -> Tags:
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            bound = self.bound(node.id)
            if bound is None or (isinstance(bound, ast.Call) and self.info.module_ctor(bound) is not None):
                return NONE
            return self.value(bound, d)
        if isinstance(node, ast.Attribute):
            key = dotted(node)
            if key and key.startswith("self.") and key.count(".") == 1:
                bound = self.bound(key)
                return self.value(bound, d) if bound is not None else NONE
            if node.attr in ("T", "mT", "data", "values", "real"):
                return self.value(node.value, d)
            return NONE
        if isinstance(node, ast.Subscript):
            base = self.value(node.value, d)
            if any(t.startswith("@") for t in base) and isinstance(node.slice, ast.Constant):
                i = node.slice.value
                return frozenset(x.split(":", 1)[1] for x in base if x.startswith(f"@{i}:"))
            if isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
                return frozenset({"count"}) if "filtered" in self.value(node.value.value, d) else NONE
            if "mask" in self.value(node.slice, d) and not isinstance(node.slice, ast.Slice):
                return (base - {"mask"}) | {"filtered"}
            return base
        if isinstance(node, ast.Compare):
            tags = frozenset({"mask"})
            return tags | (frozenset({"causal"}) if any("causal" in self.value(x, d)
                                                        for x in [node.left, *node.comparators]) else NONE)
        if isinstance(node, ast.UnaryOp):
            v = self.value(node.operand, d)
            return v | {"neg"} if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.IfExp):
            return self.value(node.body, d) | self.value(node.orelse, d)
        if isinstance(node, ast.BinOp):
            return self._binop(node, d)
        if isinstance(node, ast.Call):
            return call_tags(self, node, d)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            return frozenset({"filtered"}) if any(g.ifs for g in node.generators) else NONE
        return NONE

    def is_zero(self, node: ast.AST) -> bool:
        """A literal 0, or a name / ``self.`` attribute bound to one (``self.eps = 0``)."""
        if isinstance(node, (ast.Name, ast.Attribute)) and not (isinstance(node, ast.Name) and node.id in self.env):
            node = self.bound(dotted(node))
        return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0

    def _binop(self, node: ast.BinOp, d: int) -> Tags:
        lt, rt = self.value(node.left, d), self.value(node.right, d)
        op = node.op
        if isinstance(op, ast.Add):
            if (lt & RISK) and (rt & RISK):
                return lt | rt
            if self.is_zero(node.left) or self.is_zero(node.right):
                return lt | rt  # x + eps with eps bound to 0 guards nothing
            return ((lt | rt) - RISK - {"mask"}) | ((lt | rt) & {"exp"}) | {"guarded"}
        if isinstance(op, ast.Sub):
            if "rowmax" in rt:
                return (lt - {"exp"}) | {"bounded"}
            if ("sumsq" in lt or "square" in lt) and rt & {"square", "sumsq", "cos"}:
                return frozenset({"negdiff"})  # E[x^2] - E[x]^2, |x|^2 + |y|^2 - 2 x.y: negative by rounding
            if isinstance(node.left, ast.Constant) and rt & PROB:
                return rt & PROB
            if isinstance(node.left, ast.Constant) and node.left.value == 1 and rt & {"sumsq", "square"}:
                return frozenset({"cos"})  # 1 - |a - b|^2 / 2 of unit vectors: exactly 1 for a == b
            return frozenset({"diff"}) | (lt & {"neginf", "causal"})
        if isinstance(op, ast.Mult):
            if ast.dump(node.left) == ast.dump(node.right):
                return frozenset({"square"}) | (lt & CAN_VANISH)
            if "mask" in lt and "mask" in rt:
                return lt | rt
            return ((lt | rt) - {"mask"}) | {"product"} if not (isinstance(node.left, ast.Constant)
                                                                 or isinstance(node.right, ast.Constant)) else lt | rt
        if isinstance(op, (ast.Div, ast.FloorDiv)):
            if ("product" in lt or "cos" in lt) and "norm" in rt:
                return frozenset({"cos"})
            return lt - {"mask"}
        if isinstance(op, ast.Pow):
            if isinstance(node.right, ast.Constant) and node.right.value == 2:
                return frozenset({"square"}) | (lt & CAN_VANISH)
            return lt
        if isinstance(op, ast.MatMult):
            return frozenset({"cos", "product"})
        return lt | rt

    def returned(self, body: List[ast.stmt]) -> Tags:
        """The tags of what ``body`` returns (statements run in order, nested blocks included)."""
        out: set = set()
        for stmt in body:
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                if isinstance(stmt.value, (ast.Tuple, ast.List)):
                    for i, e in enumerate(stmt.value.elts):
                        out |= {f"@{i}:{t}" for t in self.value(e) if not t.startswith("@")}
                else:
                    out |= self.value(stmt.value)
                continue
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            self.statement(stmt)
            for name in ("body", "orelse", "finalbody"):
                out |= self.returned(getattr(stmt, name, None) or [])
        return frozenset(out)

    def input(self, call: ast.Call, op: Op) -> Optional[ast.AST]:
        """The tensor an op reads: the receiver of a method, else the first argument (``input=``/``x=``)."""
        if op.fw == "tensor" and isinstance(call.func, ast.Attribute) and self.module_op(call.func) is None:
            return call.func.value
        return arg(call, 0, "input", "x", "inputs", "y_pred")

    # ------------------------------------------------------------------ statements
    def assign(self, target: ast.AST, tags: Tags, value: Optional[ast.expr] = None) -> None:
        self._memo.clear()
        if isinstance(target, ast.Name):
            self.env[target.id] = tags
            if value is not None:
                self.defs[target.id] = value
            else:
                self.defs.pop(target.id, None)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if any(t.startswith("@") for t in tags):  # mu, sigma = model(x): each its element's tags
                for i, t in enumerate(target.elts):
                    self.assign(t, frozenset(x.split(":", 1)[1] for x in tags if x.startswith(f"@{i}:")))
                return
            for t in target.elts:
                self.assign(t, tags - {"rowmax"} if len(target.elts) > 1 and "rowmax" not in tags else tags)
        elif isinstance(target, ast.Starred):
            self.assign(target.value, tags)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            # den[den == 0] = 1 patches the value: no longer at risk; x[mask] = -inf masks it
            name = target.value.id
            if value is not None and is_neg_inf(value):
                self.env[name] = self.env.get(name, NONE) | {"neginf"}
            else:
                self.env[name] = self.env.get(name, NONE) - RISK

    def statement(self, stmt: ast.stmt) -> None:
        """Update the tags after ``stmt`` ran (its own expressions were checked before)."""
        self._memo.clear()
        if isinstance(stmt, ast.Assign):
            tags = self.value(stmt.value)
            for t in stmt.targets:
                if isinstance(t, (ast.Tuple, ast.List)) and isinstance(stmt.value, (ast.Tuple, ast.List)) and \
                        len(t.elts) == len(stmt.value.elts):
                    for te, ve in zip(t.elts, stmt.value.elts):  # a, b = f(x), g(y): element by element
                        self.assign(te, self.value(ve), ve if isinstance(te, ast.Name) else None)
                    continue
                self.assign(t, tags, stmt.value if isinstance(t, (ast.Name, ast.Subscript)) else None)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            self.assign(stmt.target, self.value(stmt.value), stmt.value)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            expr = aug_binop(stmt)
            prior = self.defs.get(stmt.target.id)
            self.assign(stmt.target, self.value(expr), _substitute(expr, stmt.target.id, prior))
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            self.assign(stmt.target, NONE)
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            f = stmt.value.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.attr.endswith("_"):
                name = f.value.id
                if f.attr in ("clamp_", "clamp_min_", "clip_", "add_", "nan_to_num_"):
                    self.env[name] = self.env.get(name, NONE) - RISK
                elif f.attr == "masked_fill_" and len(stmt.value.args) > 1 and is_neg_inf(stmt.value.args[1]):
                    self.env[name] = self.env.get(name, NONE) | {"neginf"} | \
                        (self.value(stmt.value.args[0]) & {"causal"})
                elif f.attr == "masked_fill_" and len(stmt.value.args) > 1 and is_pos_inf(stmt.value.args[1]):
                    self.env[name] = self.env.get(name, NONE) | {"posinf"}

    def definition(self, node: ast.AST) -> Optional[ast.expr]:
        """The expression a name was last assigned in this body (for messages)."""
        return self.defs.get(node.id) if isinstance(node, ast.Name) else None


def aug_binop(stmt: ast.AugAssign) -> ast.BinOp:
    """``x /= y`` as the expression ``x / y`` (at the statement's position)."""
    left = ast.Name(id=stmt.target.id, ctx=ast.Load()) if isinstance(stmt.target, ast.Name) else stmt.target
    node = ast.BinOp(left=left, op=stmt.op, right=stmt.value)
    return ast.copy_location(node, stmt)


def _substitute(expr: ast.BinOp, name: str, prior: Optional[ast.expr]) -> ast.expr:
    """``x * m`` with x's previous definition put in (``x = a * b; x *= m`` -> ``(a * b) * m``)."""
    if prior is None or not isinstance(expr.left, ast.Name) or expr.left.id != name:
        return expr
    return ast.copy_location(ast.BinOp(left=prior, op=expr.op, right=expr.right), expr)


def _log_of(node: ast.AST) -> Optional[str]:
    """p for ``log(p)`` / ``K.log(p)`` / ``p.log()`` with p a bare name, else None."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr == "log" and not node.args and isinstance(f.value, ast.Name):
        return f.value.id if f.value.id not in ("torch", "tf", "K", "np", "math", "ops") else None
    if (dotted(f) or "").split(".")[-1] == "log" and len(node.args) == 1 and isinstance(node.args[0], ast.Name):
        return node.args[0].id
    return None


def probability_params(fn: ast.AST) -> FrozenSet[str]:
    """Parameters the function's own arithmetic uses as probabilities: ``log(p)`` or ``log(1 - p)`` beside
    ``1 - p`` (a hand-written binary cross-entropy or focal loss), or ``y * log(p)`` / ``dot(log(p), y)`` with
    y another parameter (a hand-written cross-entropy against a target)."""
    params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
    complement, logged, crossed = set(), set(), set()
    for n in ast.walk(fn):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and isinstance(n.left, ast.Constant) and \
                n.left.value == 1 and isinstance(n.right, ast.Name) and n.right.id in params:
            complement.add(n.right.id)
        if isinstance(n, ast.Call) and (dotted(n.func) or "").split(".")[-1] == "log" and n.args:
            logged |= {x.id for x in ast.walk(n.args[0]) if isinstance(x, ast.Name)}
        pairs = []
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
            pairs = [(n.left, n.right), (n.right, n.left)]
        elif isinstance(n, ast.Call) and (dotted(n.func) or "").split(".")[-1] in ("dot", "matmul", "tensordot") \
                and len(n.args) >= 2:
            pairs = [(n.args[0], n.args[1]), (n.args[1], n.args[0])]
        for a, b in pairs:
            p = _log_of(a)
            if p in params and (names_in(b) & (params - {p})) and not isinstance(b, ast.Constant):
                crossed.add(p)
    return frozenset((complement & logged) | crossed)


def walk_calls(nodes: List[ast.AST]) -> Iterator[Tuple[ast.AST, FrozenSet[str]]]:
    """Every call and binary operation, with the names a surrounding condition tested (``a / len(b) if b
    else 0``, ``b and a / len(b)``): there the tested value is known not to be empty or 0."""
    stack = [(n, frozenset()) for n in reversed(nodes)]
    while stack:
        node, tested = stack.pop()
        if isinstance(node, (ast.Call, ast.BinOp, ast.Expr)):  # an Expr: a statement that discards its value
            yield node, tested
        if isinstance(node, ast.IfExp):
            stack += [(node.orelse, tested), (node.body, tested | names_in(node.test)), (node.test, tested)]
            continue
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            seen = tested
            for v in node.values:
                stack.append((v, seen))
                seen = seen | names_in(v)
            continue
        stack += [(c, tested) for c in reversed(list(ast.iter_child_nodes(node)))]


def is_no_grad(item: ast.AST, aliases: Aliases) -> bool:
    """``torch.no_grad()`` / ``torch.inference_mode()`` (a with item or a decorator)."""
    node = item.func if isinstance(item, ast.Call) else item
    path = aliases.resolve(node) or ""
    return path.split(".")[-1] in _NOGRAD and path.startswith("torch")
