"""``nanguard lint PATH...``: arguments, files, exit status (0 clean, 1 findings or a file that could not be
checked, 2 usage error).

Imports no framework: ``nanguard lint --help`` and a lint run never import torch or TensorFlow.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from . import config as C
from .engine import Finding, lint_source, select_rules
from .report import FORMATS, render

__all__ = ["add_parser", "run", "lint_paths", "iter_files"]

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
_SKIP_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "__pycache__", ".tox", ".nox", ".mypy_cache",
              ".pytest_cache", "site-packages", "node_modules", ".eggs"}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("lint", help="check PyTorch / TensorFlow code for NaN-prone patterns before the run",
                       description="Static check of PyTorch and TensorFlow/Keras code for NaN-prone patterns "
                       "(log of a softmax, a division by a count, sqrt at 0, a fully masked softmax...). Exit "
                       "status: 0 clean, 1 findings, 2 usage error. Suppress one line with "
                       "`# nanguard: ignore[NGL001]`; configure in pyproject.toml [tool.nanguard.lint].")
    p.add_argument("paths", nargs="*", metavar="PATH", help="files or folders (default: the config's paths)")
    p.add_argument("--format", default="text", help="text (default), json or sarif")
    p.add_argument("--select", default=None, metavar="CODES", help="comma list of rule codes or prefixes to run")
    p.add_argument("--ignore", default=None, metavar="CODES", help="comma list of rule codes or prefixes to skip")
    p.add_argument("--fix", action="store_true", help="rewrite the exactly safe patterns in place (NGL001, NGL002)")
    p.add_argument("--config", default=None, metavar="FILE", help="the pyproject.toml to read (default: the "
                   "nearest one from the current folder up)")
    p.add_argument("--no-config", action="store_true", help="ignore pyproject.toml")
    p.add_argument("--output", "-o", default=None, metavar="FILE", help="write the report here (default: stdout)")
    p.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    p.add_argument("--report", default=None, metavar="REPORT.json",
                   help="a nanguard run's JSON report: check the files of its events' origins and list the findings "
                        "on each origin's line (where the NaN was born), with the run's diagnosed category")
    p.set_defaults(run=run)
    return p


def _codes(s: Optional[str]) -> Optional[List[str]]:
    return [c.strip() for c in s.split(",") if c.strip()] if s else None


def iter_files(paths: List[str], cfg: C.LintConfig) -> Iterator[Path]:
    for p in paths:
        path = Path(p)
        if path.is_file():
            yield path
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")
                             and not cfg.excluded(Path(root) / d))
            for f in sorted(files):
                fp = Path(root) / f
                if f.endswith(".py") and not cfg.excluded(fp):
                    yield fp


def lint_paths(paths: List[str], cfg: C.LintConfig, rules) -> Tuple[List[Finding], List[str], dict]:
    """Findings, one-line errors (unreadable or unparsable files) and the sources read."""
    findings, errors, sources = [], [], {}
    for fp in iter_files(paths, cfg):
        name = str(fp)
        try:
            src = fp.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            errors.append(f"{name}: error: cannot read ({e})")
            continue
        try:
            found = lint_source(src, name, rules)
        except SyntaxError as e:
            errors.append(f"{name}:{e.lineno or 0}:{(e.offset or 0)}: error: syntax error: {e.msg}")
            continue
        except (RecursionError, ValueError) as e:  # a pathological file (deep nesting, null bytes): skip it
            errors.append(f"{name}: error: not checked ({type(e).__name__}: {e})")
            continue
        sources[name] = src
        findings.extend(found)
    return findings, errors, sources


def _list_rules() -> str:
    from .registry import rules
    return "".join(f"{r.code}  {r.name:22} {r.category:24} {'fixable ' if r.autofix else ''}{r.what}\n"
                   for r in rules())


def run(a: argparse.Namespace) -> int:
    if a.list_rules:
        sys.stdout.write(_list_rules())
        return EXIT_CLEAN
    if a.format not in FORMATS:
        print(f"nanguard lint: --format must be one of {', '.join(FORMATS)} (got {a.format!r})", file=sys.stderr)
        return EXIT_USAGE
    try:
        cfg = C.LintConfig() if a.no_config else C.load(a.config)
    except C.ConfigError as e:
        print(f"nanguard lint: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        rules = select_rules(_codes(a.select) or cfg.select, (_codes(a.ignore) or []) + cfg.ignore)
    except ValueError as e:
        print(f"nanguard lint: {e}", file=sys.stderr)
        return EXIT_USAGE
    if a.report:
        return _at_origins(a, cfg, rules)
    paths = a.paths or [str(cfg.root / p) if not os.path.isabs(p) else p for p in cfg.paths]
    if not paths:
        print("nanguard lint: no PATH given (and no [tool.nanguard.lint] paths in pyproject.toml)", file=sys.stderr)
        return EXIT_USAGE
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        print(f"nanguard lint: no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return EXIT_USAGE
    findings, errors, sources = lint_paths(paths, cfg, rules)
    if a.fix:
        rc = _fix(findings, sources, rules, errors)
        if rc is not None:
            return rc
        findings, errors, _ = lint_paths(paths, cfg, rules)
    out = render(a.format, findings, errors if a.format == "text" else errors)
    if a.output:
        Path(a.output).write_text(out, encoding="utf-8")
    else:
        sys.stdout.write(out)
    if a.format != "text":
        for e in errors:
            print(e, file=sys.stderr)
    return EXIT_FINDINGS if findings or errors else EXIT_CLEAN  # a file that could not be checked is not clean


def origins(report: dict) -> List[dict]:
    """The events' origins that name a file and a line: {file, line, step, category}."""
    out = []
    for ev in report.get("events") or []:
        o, cause = ev.get("origin") or {}, ev.get("cause") or {}
        if o.get("file") and isinstance(o.get("line"), int):
            out.append({"file": o["file"], "line": o["line"], "step": ev.get("step"),
                        "category": cause.get("category")})
    return out


def _at_origins(a: argparse.Namespace, cfg: C.LintConfig, rules) -> int:
    """``--report``: the findings on the lines where a run's non-finite values were born."""
    try:
        report = json.loads(Path(a.report).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        print(f"nanguard lint: --report {a.report}: {e}", file=sys.stderr)
        return EXIT_USAGE
    found, notes = [], []
    for o in origins(report if isinstance(report, dict) else {}):
        if not os.path.isfile(o["file"]):
            notes.append(f"{o['file']}:{o['line']}: the origin's file is not here")
            continue
        at_line = [f for f in lint_paths([o["file"]], cfg, rules)[0] if f.line <= o["line"] <= max(f.line, f.end_line)]
        for f in at_line:
            same = " (the run's category too)" if f.category == o["category"] else \
                f" (the run diagnosed {o['category']})" if o["category"] else ""
            f.message += f"; at the origin of step {o['step']}{same}"
        found += at_line
        if not at_line:
            notes.append(f"{o['file']}:{o['line']}: no lint finding on the origin's line (step {o['step']}, "
                         f"{o['category']})")
    out = render(a.format, found, notes if a.format == "text" else [])
    sys.stdout.write(out)
    return EXIT_FINDINGS if found else EXIT_CLEAN


def _fix(findings: List[Finding], sources: dict, rules, errors: List[str]) -> Optional[int]:
    from .fix import FixUnavailable, apply_fixes  # lazy: LibCST only for --fix
    by_file: dict = {}
    for f in findings:
        if f.fixable:
            by_file.setdefault(f.path, []).append(f)
    total = 0
    for path, fs in by_file.items():
        try:
            new, n = apply_fixes(sources[path], fs)
        except FixUnavailable as e:
            print(f"nanguard lint: {e}", file=sys.stderr)
            return EXIT_USAGE
        if n:
            tmp = Path(path + ".nanguard-fix.tmp")
            tmp.write_text(new, encoding="utf-8")
            os.replace(tmp, path)  # atomic
            total += n
    if total:
        print(f"nanguard lint: fixed {total} finding(s)", file=sys.stderr)
    return None
