"""Run the rules over a source file: every function body (and the module's top level) is walked in source
order with its own :class:`Flow`; each call and binary operation is shown to every selected rule before
the statement's assignments update the flow. Findings on a line with ``# nanguard: ignore`` (or
``# nanguard: ignore[NGL001,NGL005]``) are dropped."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Set

from ..core.diagnosis import fixes as X
from . import rules as _rules
from .flow import Flow, ModuleInfo, aug_binop, is_no_grad, names_in, own_exprs, probability_params, walk_calls
from .registry import Rule

__all__ = ["Finding", "lint_source", "select_rules", "suppressions"]

_IGNORE = re.compile(r"#\s*nanguard:\s*ignore(?:\[([A-Za-z0-9_,\s]*)\])?", re.I)
ALL = "*"
_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


@dataclass
class Finding:
    path: str
    line: int
    col: int            # 1-based
    rule: str
    category: str
    message: str
    fixes: List[str] = field(default_factory=list)
    fixable: bool = False
    end_line: int = 0
    end_col: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def select_rules(select: Optional[Iterable[str]] = None, ignore: Optional[Iterable[str]] = None) -> List[Rule]:
    """The rules whose code starts with one of ``select`` (all when None) and with none of ``ignore``;
    an unknown prefix is a ValueError."""
    every = _rules.rules()
    for code in list(select or []) + list(ignore or []):
        if not any(r.code.startswith(code.upper()) for r in every):
            raise ValueError(f"unknown rule {code!r} (rules: {', '.join(r.code for r in every)})")
    sel = [c.upper() for c in select] if select else None
    ign = [c.upper() for c in ignore or []]
    return [r for r in every if (sel is None or any(r.code.startswith(s) for s in sel))
            and not any(r.code.startswith(i) for i in ign)]


def suppressions(source: str) -> Dict[int, Set[str]]:
    """line -> the codes ignored on it (``{"*"}`` for a bare ``# nanguard: ignore``)."""
    out: Dict[int, Set[str]] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            m = _IGNORE.search(tok.string)
            if m:
                codes = {c.strip().upper() for c in (m.group(1) or "").split(",") if c.strip()}
                out.setdefault(tok.start[0], set()).update(codes or {ALL})
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def _suppressed(f: Finding, sup: Dict[int, Set[str]]) -> bool:
    for line in range(f.line, max(f.line, f.end_line) + 1):
        codes = sup.get(line)
        if codes and (ALL in codes or f.rule in codes):
            return True
    return False


class _Walker:
    def __init__(self, info: ModuleInfo, path: str, selected: List[Rule]) -> None:
        self.info, self.path, self.rules = info, path, selected
        self.found: List[Finding] = []
        self.seen: Set[tuple] = set()

    def body(self, stmts: List[ast.stmt], flow: Flow) -> None:
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.function(stmt, flow)
                continue
            if isinstance(stmt, ast.ClassDef):
                self.body(stmt.body, Flow(self.info, flow.no_grad, cls=stmt.name))
                continue
            exprs = [stmt] if isinstance(stmt, ast.Expr) else list(own_exprs(stmt))
            if isinstance(stmt, ast.AugAssign):
                exprs.append(aug_binop(stmt))  # `x /= n` is checked as `x / n`
            self.check(exprs, flow)
            flow.statement(stmt)
            inner_no_grad = isinstance(stmt, (ast.With, ast.AsyncWith)) and \
                any(is_no_grad(i.context_expr, self.info.aliases) for i in stmt.items)
            saved, nonempty = flow.no_grad, set(flow.nonempty)
            flow.no_grad = flow.no_grad or inner_no_grad
            if isinstance(stmt, (ast.If, ast.While)):
                flow.nonempty |= names_in(stmt.test)
            for name in ("body", "orelse", "finalbody"):
                self.body(getattr(stmt, name, None) or [], flow)
            for h in getattr(stmt, "handlers", None) or []:
                self.body(h.body, flow)
            for case in getattr(stmt, "cases", None) or []:
                self.body(case.body, flow)
            flow.no_grad, flow.nonempty = saved, nonempty
            if isinstance(stmt, ast.Assert) or (isinstance(stmt, ast.If) and stmt.body and
                                                isinstance(stmt.body[-1], _EXITS)):
                flow.nonempty |= names_in(stmt.test)  # `if not b: return` / `assert len(b)`: b is not empty after

    def function(self, fn: ast.AST, outer: Flow) -> None:
        no_grad = outer.no_grad or any(is_no_grad(d, self.info.aliases) for d in fn.decorator_list)
        flow = Flow(self.info, no_grad, cls=outer.cls)
        a = fn.args
        for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if p is not None:
                flow.env[p.arg] = frozenset()
        for p in probability_params(fn):
            flow.env[p] = frozenset({"prob"})
        flow.inputs = _tensor_params(fn)
        flow.scope = fn
        self.check([*a.defaults, *[d for d in a.kw_defaults if d is not None]], outer)
        self.body(fn.body, flow)

    def check(self, exprs: List[ast.AST], flow: Flow) -> None:
        for node, tested in walk_calls(exprs):
            flow.tested_here = tested
            for r in self.rules:
                for hit in r.check(node, flow):
                    key = (r.code, hit.node.lineno, hit.node.col_offset)
                    if key in self.seen:
                        continue
                    self.seen.add(key)
                    origin = {"file": self.path, "line": hit.node.lineno}
                    with X.speaking(self.info.framework):
                        fixes = r.fixes(origin, hit.facts)
                    self.found.append(Finding(self.path, hit.node.lineno, hit.node.col_offset + 1, r.code, r.category,
                                              hit.message, fixes, hit.fixable and r.autofix,
                                              getattr(hit.node, "end_lineno", 0) or 0,
                                              (getattr(hit.node, "end_col_offset", 0) or 0) + 1))


def _tensor_params(fn: ast.AST) -> frozenset:
    """The parameters that can carry a tensor: not ``self``/``cls``, no numeric default, not annotated
    int/float/bool/str."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = dict(zip([p.arg for p in positional][len(positional) - len(a.defaults):], a.defaults))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    out = set()
    for p in [*positional, *a.kwonlyargs]:
        if p.arg in ("self", "cls") or isinstance(defaults.get(p.arg), ast.Constant):
            continue
        if isinstance(p.annotation, ast.Name) and p.annotation.id in ("int", "float", "bool", "str"):
            continue
        out.add(p.arg)
    return frozenset(out)


def lint_source(source: str, path: str = "<string>", rules: Optional[List[Rule]] = None) -> List[Finding]:
    """The findings in ``source`` (sorted by position). A syntax error raises SyntaxError."""
    tree = ast.parse(source, filename=path)
    info = ModuleInfo(tree)
    w = _Walker(info, path, select_rules() if rules is None else rules)
    top = Flow(info)
    top.scope = tree
    w.body(tree.body, top)
    sup = suppressions(source)
    return sorted((f for f in w.found if not _suppressed(f, sup)), key=lambda f: (f.line, f.col, f.rule))
