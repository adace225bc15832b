"""The package's floors, checked from its own import statements (see docs/ARCHITECTURE.md).

* ``nanguard.core`` imports no framework (torch, tensorflow, keras) and no backend;
* a backend (``nanguard.pytorch``, ``nanguard.tensorflow``) imports the core, never the other
  backend, an integration or the command line;
* integrations and the command line are edges: nothing inside the package imports them
  (integrations may share a helper module among themselves);
* no import cycle between nanguard's modules, counting imports inside functions too.

The walk reads every ``import`` statement (top level and inside functions), so a lazy import
cannot hide a layer violation or a cycle.
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, Iterator, Set, Tuple

PKG = pathlib.Path(__file__).resolve().parents[2] / "src" / "nanguard"
FRAMEWORKS = ("torch", "tensorflow", "keras", "numpy", "lightning", "pytorch_lightning", "transformers")
TF_NAMES = ("tensorflow", "keras")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> Iterator[Tuple[str, int]]:
    """Absolute names of every module this file imports (relative imports resolved), with lines."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import numerics` imports the submodule, `from .events import Event` the module
            for a in node.names:
                yield f"{target}.{a.name}|{target}", node.lineno


def _graph() -> Dict[str, Set[Tuple[str, int]]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: Dict[str, Set[Tuple[str, int]]] = {}
    for mod, path in files.items():
        edges = set()
        for target, line in _imports(path):
            if "|" in target:
                sub, _, target = target.partition("|")
                if sub in files:
                    target = sub
            if target.split(".")[0] != "nanguard":
                edges.add((target, line))
                continue
            # the longest existing module name that the import refers to
            parts = target.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            if parts and ".".join(parts) != mod:
                edges.add((".".join(parts), line))
        graph[mod] = edges
    return graph


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


GRAPH = _graph()


def _violations(src_prefix: str, forbidden) -> list:
    out = []
    for mod, edges in GRAPH.items():
        if not _under(mod, src_prefix):
            continue
        for target, line in edges:
            if any(_under(target, f) for f in forbidden):
                out.append(f"{mod}:{line} imports {target}")
    return sorted(out)


def test_the_walk_sees_the_package() -> None:
    assert "nanguard.core.events" in GRAPH and "nanguard.pytorch.detect" in GRAPH
    assert any(t == "torch" for t, _ in GRAPH["nanguard.pytorch.detect.monitor"])
    assert any(t == "nanguard.core.events" for t, _ in GRAPH["nanguard.pytorch.detect.monitor"])


def test_core_imports_no_framework_and_no_backend() -> None:
    forbidden = FRAMEWORKS + ("nanguard.pytorch", "nanguard.tensorflow", "nanguard.keras",
                              "nanguard.integrations", "nanguard.cli")
    assert _violations("nanguard.core", forbidden) == []


def test_pytorch_backend_imports_no_edge_and_no_tensorflow() -> None:
    forbidden = TF_NAMES + ("nanguard.tensorflow", "nanguard.keras", "nanguard.integrations", "nanguard.cli")
    assert _violations("nanguard.pytorch", forbidden) == []


def test_tensorflow_backend_imports_no_torch_and_no_edge() -> None:
    forbidden = ("torch", "nanguard.pytorch", "nanguard.integrations", "nanguard.cli")
    assert _violations("nanguard.tensorflow", forbidden) == []
    assert _violations("nanguard.keras", ("torch", "nanguard.pytorch")) == []


def test_edges_are_imported_by_nothing_inside() -> None:
    bad = []
    for mod, edges in GRAPH.items():
        for target, line in edges:
            if _under(target, "nanguard.integrations") and not _under(mod, "nanguard.integrations"):
                bad.append(f"{mod}:{line} imports {target}")
            if _under(target, "nanguard.cli") and not _under(mod, "nanguard.cli") \
                    and mod != "nanguard.__main__":
                bad.append(f"{mod}:{line} imports {target}")
    assert sorted(bad) == []


def test_lint_reads_code_only_and_only_the_command_line_imports_it() -> None:
    """``nanguard.lint`` (the static checker) is an edge beside the command line: it may import the core (the
    categories and the fix texts), the standard library and LibCST, never a framework, a backend, an
    integration or the command line; inside the package only ``nanguard.cli`` imports it."""
    forbidden = FRAMEWORKS + ("nanguard.pytorch", "nanguard.tensorflow", "nanguard.keras", "nanguard.integrations",
                              "nanguard.cli")
    assert _violations("nanguard.lint", forbidden) == []
    assert "nanguard.lint.engine" in GRAPH
    bad = [f"{mod}:{line} imports {target}" for mod, edges in GRAPH.items() for target, line in edges
           if _under(target, "nanguard.lint") and not _under(mod, "nanguard.lint") and not _under(mod, "nanguard.cli")]
    assert sorted(bad) == []


def test_no_import_cycles() -> None:
    internal = {m: {t for t, _ in edges if t in GRAPH} for m, edges in GRAPH.items()}
    cycles = []
    state: Dict[str, int] = {}
    stack: list = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(internal[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif state.get(t) is None:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(internal):
        if state.get(m) is None:
            visit(m)
    assert cycles == []


MAX_CLASS_LINES = 400


def test_no_class_spans_more_than_400_lines() -> None:
    """Keep each class small: one that grows past the limit is cut along its jobs (a helper class, a
    mixin in its own module, module-level functions)."""
    too_long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    too_long.append(f"{_module_name(path)}.{node.name}: {lines} lines")
    assert too_long == [], f"classes over {MAX_CLASS_LINES} lines: {too_long}"
