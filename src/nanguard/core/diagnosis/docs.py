"""``docs/CATEGORIES.md``, generated from ``CATEGORIES`` and the op-family registry.

Regenerate with ``python -m nanguard.core.diagnosis.docs > docs/CATEGORIES.md``; a test compares the
file with :func:`categories_markdown`.
"""
from __future__ import annotations

from . import families as F
from .categories import CATEGORIES
from .engine import mechanism  # noqa: F401  (imports every rule module: the registry is complete)
from .errors import error_rules

__all__ = ["categories_markdown"]

_INTRO = """# Cause categories

`cause.category` in the JSON report is one of these. Each is selected from the *mechanism* seen
when the failing step is replayed op by op (the origin op, its inputs, a float64/float32 re-run of it,
the constants and reductions that fed it) and from the step history; never from names in your code.
This file is generated from `nanguard.core.diagnosis.CATEGORIES` and the op-family registry
(`nanguard/core/diagnosis/families.py`, which also says how to add an op rule):
`python -m nanguard.core.diagnosis.docs > docs/CATEGORIES.md` (a test keeps them in sync).
"""

_NOT_OPS = {
    "bad_input_data": "(provenance: a batch tensor non-finite before the step)",
    "param_corruption": "(provenance: a parameter or buffer non-finite before the step)",
    "loss_scale_collapse": "(step history)",
    "optimizer_numerics": "(any op of the optimizer stage)",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _ops(names) -> str:
    return ", ".join(f"`{n}`" for n in sorted(names))


def _where(fam: F.Family) -> str:
    if fam.domain is None:
        return fam.note or ""
    parts = [fam.domain.text()]
    if fam.domain.grad_cmp:
        parts[0] += f" (gradient: {fam.domain.text(grad=True)})"
    for op, dom in sorted(fam.op_domains.items()):
        var = "x" if dom.kwarg == "self" else dom.kwarg
        parts.append(f"{op}: {dom.text(var)}")
    return "; ".join(parts)


def _ops_of_category(cat: str) -> str:
    fams, generic = [], False
    for r in F.rules():
        if cat not in r.categories:
            continue
        if r.family is None:
            generic = True
        elif r.family not in fams:
            fams.append(r.family)
    out = []
    for f in sorted(fams, key=lambda f: f.name):
        out.append(f"{f.name}: {_ops(f.ops)}" if f.ops else f"{f.name}: ops containing "
                   + " or ".join(f"'{s}'" for s in f.name_contains))
    if generic:
        labels = [r.fn.__name__.strip("_").replace("_rule", "").replace("_", " ")
                  for r in F.rules() if r.family is None and cat in r.categories]
        out.append(f"any op ({', '.join(labels)})")
    return "; ".join(out) or _NOT_OPS.get(cat, "")


def categories_markdown() -> str:
    lines = [_INTRO, "| category | definition and the evidence that selects it | origin ops (from the registry) |",
             "|---|---|---|"]
    for name, text in CATEGORIES.items():
        lines.append(f"| `{name}` | {_cell(text)} | {_cell(_ops_of_category(name))} |")
    lines += ["", "## Op families", "",
              "Every origin op is looked up in one family (aten names without overload or in-place `_`; "
              "TensorFlow op types). The family says where the op is not finite, which evidence the backend "
              "gathers for it and which rules name the cause.", "",
              "| family | aten ops | TensorFlow ops | not finite where | evidence | categories |",
              "|---|---|---|---|---|---|"]
    for f in sorted(F.families(), key=lambda f: f.name):
        aten_ops = _ops(f.ops) if f.ops else "names containing " + " or ".join(f"'{s}'" for s in f.name_contains)
        lines.append(f"| `{f.name}` | {aten_ops} | {_ops(f.tf_ops)} | {_cell(_where(f))} | {_ops(f.evidence)} | "
                     f"{_ops({c for r in f.rules for c in r.categories})} |")
    lines += ["", "## Script errors", "",
              "A script that raises is reported `\"status\": \"script_error\"` with the exception's type, message, "
              "file, line and step (`script_error` in the JSON report). When the error is a well-known one, a rule "
              "of `nanguard/core/diagnosis/rules/errors.py` adds the reason and the fixes "
              "(`script_error.diagnosis`, with its own category):", "",
              "| rule | exceptions | category | reason |", "|---|---|---|---|"]
    for r in error_rules():
        lines.append(f"| `{r.name}` | {', '.join(f'`{t}`' for t in r.types) or 'any'} | `{r.category}` | "
                     f"{_cell((r.fn.__doc__ or '').strip())} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(categories_markdown(), end="")
