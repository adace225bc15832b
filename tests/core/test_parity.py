"""docs/PARITY.md against the code: the capability rows are the names declared in
nanguard.core.capabilities, the columns are the drivers the backends declare, a "yes" cell is in the
driver's declared set and a "no" cell is not and says why; the backend registry's options agree.
No framework is imported (the backends' capability modules import none)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from nanguard.cli.backends import BACKENDS
from nanguard.core.capabilities import CAPABILITIES, ON_SPIKE_CAPS, RECOVERY_CAPS, recovery_cap
from nanguard.core.recovery.table import ACTIONS
from nanguard.pytorch import capabilities as torch_caps
from nanguard.tensorflow import capabilities as tf_caps
from nanguard.jax import capabilities as jax_caps

DOC = Path(__file__).resolve().parents[2] / "docs" / "PARITY.md"
BY_BACKEND = {"torch": torch_caps.DRIVERS, "tensorflow": tf_caps.DRIVERS, "jax": jax_caps.DRIVERS}
DRIVERS = {**torch_caps.DRIVERS, **tf_caps.DRIVERS, **jax_caps.DRIVERS}
YES = re.compile(r"^yes( — \S.*)?$")
NO = re.compile(r"^no — \S.{10,}$")  # a reason, not a shrug


def table(text: str):
    """(header cells, {row label: cells}) of the first Markdown table in ``text``."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    header, body = rows[0], [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]
    return header, {r[0]: r[1:] for r in body}


@pytest.fixture(scope="module")
def parity():
    return table(DOC.read_text(encoding="utf-8"))


def test_the_rows_are_the_declared_capabilities_in_order(parity):
    header, rows = parity
    assert list(rows) == list(CAPABILITIES.values())


def test_the_columns_are_the_drivers_the_backends_declare(parity):
    header, rows = parity
    assert header[1:] == list(DRIVERS)
    assert all(len(cells) == len(DRIVERS) for cells in rows.values())


def test_every_cell_is_yes_or_no_with_a_reason(parity):
    header, rows = parity
    bad = [(r, h, c) for r, cells in rows.items() for h, c in zip(header[1:], cells)
           if not (YES.match(c) or NO.match(c))]
    assert not bad


def test_each_cell_matches_the_drivers_declared_set(parity):
    header, rows = parity
    names = {label: name for name, label in CAPABILITIES.items()}
    wrong = []
    for label, cells in rows.items():
        for driver, cell in zip(header[1:], cells):
            if cell.startswith("yes") != (names[label] in DRIVERS[driver]):
                wrong.append(f"{driver} / {names[label]}: table says {cell.split(' ')[0]!r}")
    assert not wrong


def test_the_declared_sets_use_declared_names_only():
    for driver, caps in DRIVERS.items():
        assert isinstance(caps, frozenset) and caps <= set(CAPABILITIES), driver


def test_every_recovery_action_and_on_spike_action_has_a_row():
    from nanguard.core.spike import ON_SPIKE
    assert RECOVERY_CAPS == tuple(recovery_cap(a) for a in ACTIONS)
    assert set(RECOVERY_CAPS) <= set(CAPABILITIES)
    assert ON_SPIKE_CAPS == tuple(f"on_spike_{a}" for a in ON_SPIKE)


def test_the_backend_registry_agrees_with_the_declared_sets():
    # a runner that takes --experiments runs the counterfactual experiments (replay proof), one that
    # takes --on-spike acts on early warnings: the registry and the declared sets must say the same
    for b in BACKENDS:
        drivers = BY_BACKEND[b.name]
        assert ("experiments" in b.options) == any("replay_proof" in c for c in drivers.values()), b.name
        assert ("on_spike" in b.options) == all(set(ON_SPIKE_CAPS) <= c for c in drivers.values()), b.name


def test_the_parity_check_needs_no_framework():
    import subprocess
    code = ("import sys, nanguard.pytorch.capabilities, nanguard.tensorflow.capabilities, nanguard.core.capabilities,"
            " nanguard.jax.capabilities;"
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'jax', 'flax', 'optax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
