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
from typing import Dict, Iterator, List, Optional, Set, Tuple

PKG = pathlib.Path(__file__).resolve().parents[2] / "src" / "nanguard"
JAX_NAMES = ("jax", "jaxlib", "flax", "optax", "equinox")
FRAMEWORKS = ("torch", "tensorflow", "keras", "numpy", "lightning", "pytorch_lightning", "transformers") + JAX_NAMES
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
    forbidden = FRAMEWORKS + ("nanguard.pytorch", "nanguard.tensorflow", "nanguard.keras", "nanguard.jax",
                              "nanguard.integrations", "nanguard.cli")
    assert _violations("nanguard.core", forbidden) == []


def test_pytorch_backend_imports_no_edge_and_no_tensorflow() -> None:
    forbidden = TF_NAMES + JAX_NAMES + ("nanguard.tensorflow", "nanguard.keras", "nanguard.jax",
                                        "nanguard.integrations", "nanguard.cli")
    assert _violations("nanguard.pytorch", forbidden) == []


def test_tensorflow_backend_imports_no_torch_and_no_edge() -> None:
    forbidden = ("torch", "nanguard.pytorch", "nanguard.jax", "nanguard.integrations", "nanguard.cli") + JAX_NAMES
    assert _violations("nanguard.tensorflow", forbidden) == []
    assert _violations("nanguard.keras", ("torch", "nanguard.pytorch", "nanguard.jax") + JAX_NAMES) == []


def test_jax_backend_imports_no_other_framework_and_no_edge() -> None:
    """``nanguard.jax`` may import jax, flax, optax, equinox, numpy and the core; never torch, TensorFlow,
    another backend, an integration or the command line."""
    forbidden = ("torch", "nanguard.pytorch", "nanguard.tensorflow", "nanguard.keras", "nanguard.integrations",
                 "nanguard.cli") + TF_NAMES
    assert "nanguard.jax.driver" in GRAPH
    assert _violations("nanguard.jax", forbidden) == []


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


def _class_table() -> Tuple[Dict[Tuple[str, str], ast.ClassDef], Dict[Tuple[str, str], List[Tuple[str, str]]]]:
    """Every class of the package by (module, name), and its bases that are classes of the package
    (names resolved through each module's imports, re-exports included)."""
    classes: Dict[Tuple[str, str], ast.ClassDef] = {}
    imports: Dict[str, Dict[str, Tuple[str, str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        mod = _module_name(path)
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        names = imports.setdefault(mod, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    names[a.asname or a.name] = (base, a.name)
            elif isinstance(node, ast.ClassDef):
                classes[(mod, node.name)] = node

    def resolve(mod: str, name: str, depth: int = 0) -> Optional[Tuple[str, str]]:
        if (mod, name) in classes:
            return (mod, name)
        target = imports.get(mod, {}).get(name)
        return resolve(target[0], target[1], depth + 1) if target and depth < 10 else None

    bases = {k: [r for r in (resolve(k[0], b.id) for b in node.bases if isinstance(b, ast.Name)) if r]
             for k, node in classes.items()}
    return classes, bases


def _self_names(node: ast.ClassDef) -> Tuple[Set[str], Set[str]]:
    """The names a class defines (methods, class attributes, ``self.x = ...``) and reads on ``self``."""
    defined: Set[str] = set()
    read: Set[str] = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            (defined if isinstance(n.ctx, ast.Store) else read).add(n.attr)
    return defined, read


def _mixins() -> Dict[Tuple[str, str], List[str]]:
    """The package's mixins: a base class of another package class that builds no state of its own
    (no ``__init__``, its bases' included) and reads attributes on ``self`` that neither it nor its
    bases define (they belong to the class it is mixed into). -> the attributes it borrows."""
    classes, bases = _class_table()
    out: Dict[Tuple[str, str], List[str]] = {}
    for key in {b for bs in bases.values() for b in bs}:
        defined: Set[str] = set()
        read: Set[str] = set()
        todo, seen = [key], set()
        while todo:
            k = todo.pop()
            if k not in seen:
                seen.add(k)
                d, r = _self_names(classes[k])
                defined |= d
                read |= r
                todo += bases[k]
        borrowed = sorted(a for a in read - defined if not a.startswith("__"))
        if "__init__" not in defined and borrowed:
            out[key] = borrowed
    return out


def test_the_mixin_finder_sees_a_mixin() -> None:
    """The rule below is not vacuous: a class that works on its host's attributes is found."""
    import textwrap
    src = textwrap.dedent("""
        class Reports:
            def write(self):
                return self.monitor.history
        class Driver(Reports):
            def __init__(self):
                self.monitor = None
    """)
    tree = ast.parse(src)
    host, mixin = [n for n in tree.body if isinstance(n, ast.ClassDef)][::-1]
    d, r = _self_names(mixin)
    assert "__init__" not in d and r - d == {"monitor"}
    d, r = _self_names(host)
    assert "__init__" in d


def test_no_class_is_assembled_from_mixins() -> None:
    """The drivers hold their parts (composition); no class borrows its host's attributes (a mixin)."""
    found = {f"{m}.{n}": attrs[:6] for (m, n), attrs in _mixins().items()}
    assert found == {}, f"mixins (class: attributes it borrows from its host): {found}"


def test_no_class_spans_more_than_400_lines() -> None:
    """Keep each class small: one that grows past the limit is cut along its jobs (a part it holds,
    module-level functions). A class counts with its mixins (there should be none: see above)."""
    classes, bases = _class_table()
    mixins = _mixins()
    too_long = []
    for key, node in classes.items():
        lines = node.end_lineno - node.lineno + 1
        lines += sum(classes[b].end_lineno - classes[b].lineno + 1 for b in bases[key] if b in mixins)
        if lines > MAX_CLASS_LINES:
            too_long.append(f"{key[0]}.{key[1]}: {lines} lines")
    assert too_long == [], f"classes over {MAX_CLASS_LINES} lines: {too_long}"
