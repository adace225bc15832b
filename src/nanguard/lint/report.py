"""Output formats: text (``file:line:col: rule category message``), JSON (a list of finding objects) and
SARIF 2.1.0 (for code-scanning tools)."""
from __future__ import annotations

import json
from typing import List

from .._version import __version__
from .engine import Finding
from .registry import rules

__all__ = ["FORMATS", "render", "text", "as_json", "sarif"]

FORMATS = ("text", "json", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def text(findings: List[Finding], errors: List[str]) -> str:
    lines = [f"{f.path}:{f.line}:{f.col}: {f.rule} {f.category} {f.message}"
             + (" [fixable]" if f.fixable else "") for f in findings]
    lines += errors
    if findings:
        lines.append(f"{len(findings)} finding(s)" + (f", {sum(f.fixable for f in findings)} fixable with --fix"
                                                      if any(f.fixable for f in findings) else ""))
    return "\n".join(lines) + ("\n" if lines else "")


def as_json(findings: List[Finding], errors: List[str]) -> str:
    return json.dumps([f.as_dict() for f in findings], indent=2) + "\n"


def sarif(findings: List[Finding], errors: List[str]) -> str:
    descriptors = [{"id": r.code, "name": r.name, "shortDescription": {"text": r.what.split(": ")[0]},
                    "fullDescription": {"text": r.what},
                    "properties": {"category": r.category, "autofix": r.autofix},
                    "defaultConfiguration": {"level": "warning"}} for r in rules()]
    index = {r["id"]: i for i, r in enumerate(descriptors)}
    results = []
    for f in findings:
        results.append({
            "ruleId": f.rule, "ruleIndex": index.get(f.rule, 0), "level": "warning",
            "message": {"text": f"{f.message} ({f.category}). Fix: {f.fixes[0]}" if f.fixes else f.message},
            "locations": [{"physicalLocation": {
                "artifactLocation": {"uri": f.path.replace("\\", "/")},
                "region": {"startLine": f.line, "startColumn": f.col,
                           "endLine": max(f.end_line, f.line), "endColumn": max(f.end_col, 1)}}}],
            "properties": {"category": f.category, "fixable": f.fixable}})
    notes = [{"level": "error", "message": {"text": e}, "descriptor": {"id": "syntax-error"}} for e in errors]
    run = {"tool": {"driver": {"name": "nanguard-lint", "version": __version__,
                               "rules": descriptors}},
           "results": results}
    if notes:
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": notes}]
    return json.dumps({"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}, indent=2) + "\n"


def render(fmt: str, findings: List[Finding], errors: List[str]) -> str:
    return {"text": text, "json": as_json, "sarif": sarif}[fmt](findings, errors)
