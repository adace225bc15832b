"""The backends ``nanguard run`` can hand a script to: one registry entry per framework.

A :class:`Backend` names the framework's top-level modules (read from the script's import statements,
nothing is imported to decide), the runner to call (``module:function``, imported only when chosen,
so ``nanguard --help`` imports no framework and a TensorFlow user needs no torch) and the
``nanguard run`` options the runner takes. A third framework is one more entry here and a runner with
the same signature (see docs/ARCHITECTURE.md, "How to add a backend").
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Optional, Sequence, Tuple

from ..core.exitcodes import EXIT_USAGE

# the options every runner takes
COMMON = frozenset({"report_path", "on_nonfinite", "recover", "localize", "strict", "quiet", "bundle",
                    "tensorboard", "html", "on_spike"})


@dataclass(frozen=True)
class Backend:
    name: str
    framework: str                 # the module whose presence makes the backend available
    imports: FrozenSet[str]        # a script importing one of these (top level) is this framework's
    runner: str                    # "module:function", called as runner(script, args, **options)
    options: FrozenSet[str] = COMMON
    note: str = ""                 # why an option is not taken, printed when one is given

    def available(self) -> bool:
        return importlib.util.find_spec(self.framework) is not None

    def load(self) -> Callable[..., int]:
        mod, _, fn = self.runner.partition(":")
        return getattr(importlib.import_module(mod), fn)


BACKENDS: Tuple[Backend, ...] = (
    Backend("tensorflow", "tensorflow", frozenset({"tensorflow", "keras", "tf_keras"}),
            "nanguard.tensorflow.run:run_tf_script", options=COMMON | {"experiments"}),
    Backend("torch", "torch", frozenset({"torch"}), "nanguard.pytorch.run:run_torch_script",
            options=COMMON | {"experiments"}),
    Backend("jax", "jax", frozenset({"jax", "flax", "optax", "equinox"}), "nanguard.jax.run:run_jax_script",
            options=(COMMON - {"bundle", "tensorboard"}) | {"experiments"},
            note="repro bundles and TensorBoard are not in the JAX backend yet: see docs/PARITY.md"),
)
DEFAULT = "torch"  # a script that imports no known framework (it may import it through its own modules)


def by_name(name: str) -> Backend:
    for b in BACKENDS:
        if b.name == name:
            return b
    raise KeyError(name)


def script_imports(script: str) -> set:
    """The top-level module names ``script`` imports (absolute imports, anywhere in the file)."""
    names: set = set()
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return names


def backend_for(script: str, backends: Sequence[Backend] = BACKENDS) -> Backend:
    """The backend of a script: the one framework it imports; with none or several, the default one
    when installed, else the one installed."""
    names = script_imports(script)
    hits = [b for b in backends if names & b.imports]
    if len(hits) == 1:
        return hits[0]
    default = next((b for b in backends if b.name == DEFAULT), None)
    if len(hits) > 1 and default in hits:
        return default
    if default is not None and default.available():
        return default
    installed = [b for b in backends if b.available()]
    return installed[0] if installed else (default or backends[0])


def split_options(backend: Backend, options: dict) -> Tuple[dict, Optional[str]]:
    """The options ``backend``'s runner takes, and a note naming those it does not (given, not default)."""
    taken = {k: v for k, v in options.items() if k in backend.options}
    left = sorted(k for k, v in options.items() if k not in backend.options and v not in (None, "auto"))
    note = f"{', '.join(left)} not used for a {backend.name} script ({backend.note})" if left else None
    return taken, note


def run(script: str, args: Sequence[str], **options: Any) -> int:
    """Run ``script`` with its backend's runner (exit status 2 when that framework is not installed)."""
    backend = backend_for(script)
    if not backend.available():
        extra = "tensorflow" if backend.name == "tensorflow" else backend.name
        print(f"nanguard: {os.path.basename(script)} needs {backend.framework}, which is not installed "
              f"(pip install 'nanguard[{extra}]')", file=sys.stderr)
        return EXIT_USAGE
    taken, note = split_options(backend, options)
    if note and not options.get("quiet"):
        print(f"nanguard: {note}", file=sys.stderr)
    return backend.load()(script, list(args), **taken)
