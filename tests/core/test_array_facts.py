"""``nanguard.array_facts``: the numpy evidence facts the TensorFlow and JAX gatherers share (one home for what
were near-copies), its layer (numpy and the core only; the core never imports it), and its facts on arrays."""
from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

import numpy as np

from nanguard import array_facts as F

PKG = pathlib.Path(__file__).resolve().parents[2] / "src" / "nanguard"


def _imports(path: pathlib.Path) -> set:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add(("." * node.level) + (node.module or ""))
    return out


def test_it_imports_numpy_and_the_core_only_and_the_core_does_not_import_it():
    mods = _imports(PKG / "array_facts.py")
    assert mods <= {"__future__", "math", "typing", "numpy"} | {m for m in mods if m.startswith(".core")}, mods
    for p in (PKG / "core").rglob("*.py"):
        text = p.read_text()
        assert "array_facts" not in text, p
    users = {p.relative_to(PKG).parts[0] for p in PKG.rglob("*.py") if "array_facts as F" in p.read_text()}
    assert users == {"jax", "tensorflow"}, users


def test_domain_facts_count_what_is_inside_the_domain():
    x = np.array([[-1.0, 0.0, 2.0], [np.inf, 0.5, 3.0]], np.float32)
    assert F.log_domain(x, 0.0)["log_domain"] == {"le_limit": 2, "limit": 0.0, "zeros": 1, "negatives": 1,
                                                  "min": -1.0, "numel": 6}
    assert F.trig_domain(x)["trig_domain"]["abs_ge_1"] == 4 and F.trig_domain(x)["trig_domain"]["max_abs"] == 3.0
    dom = SimpleNamespace(abs=False, cmp="le", grad_cmp="lt", limit=0.0, kwarg="x",
                          text=lambda grad=False: "x < 0" if grad else "x <= 0")
    assert F.domain(dom, x)["domain"] == {"condition": "x <= 0", "grad_condition": "x < 0", "arg": "x",
                                          "inside": 2, "grad_inside": 1, "numel": 6, "min": -1.0, "max": 3.0}


def test_pow_exponent_scalar_and_elementwise():
    base = np.array([-2.0, 0.0, 4.0])
    assert F.pow_exponent(base, np.asarray(0.5)) == {"exponent": 0.5, "fractional": True}
    assert F.pow_exponent(base, np.asarray(2.0))["fractional"] is False
    got = F.pow_exponent(base, np.array([0.5, -1.0, 0.5]))
    assert got["neg_base_fractional_exp"] == 1 and got["zero_base_negative_exp"] == 1 and got["fractional"]
    assert got["exponent_range"] == [-1.0, 0.5]


def test_masked_rows_denominators_and_overflow():
    s = np.full((3, 2, 4), 1.0)
    s[1, 0, :] = -np.inf
    s[2, 1, 0] = -np.inf
    rows = F.masked_softmax_rows(s)["softmax_all_masked_rows"]
    assert rows == {"count": 1, "batch_rows": [1], "rows_total": 6, "rows_with_neginf": 2}
    d = F.denominator_counts(np.array([0.0, 1.0, 2.0]), np.array([0.0, 0.0, 3.0]))
    assert (d["zeros"], d["zero_over_zero"], d["nonzero_over_zero"], d["min"]) == (2, 1, 1, 0.0)
    assert F.denominator_counts(None, np.array(0.0))["scalar_denominator"] == 0.0
    hit = F.overflow({"posinf": 2, "neginf": 0, "nan": 0}, True, iter([3e38, None, 1.0]), 3.4e38)
    assert hit == {"overflow": {"dtype_max": 3.4e38, "input_max_abs": 3e38}}
    assert F.overflow({"posinf": 2, "neginf": 0, "nan": 1}, True, [], 1.0) is None
    assert F.overflow({"posinf": 2, "neginf": 0, "nan": 0}, False, [], 1.0) is None


def test_one_row_far_outside_the_others_is_isolated():
    y = np.random.default_rng(0).normal(size=(32, 1))
    y[12] = 1e20
    iso = F.isolated_rows([(1, F.row_max_abs(y))])["isolated_input"]
    assert iso["rows"] == [12] and iso["arg"] == 1 and iso["value"] == 1e20 and iso["rows_total"] == 32


def test_every_row_large_is_weights_not_a_sample():
    """Weights that grew make every row of an activation large: nothing is isolated."""
    h = np.random.default_rng(0).normal(size=(32, 8)) * 1e30
    assert F.isolated_rows([(0, F.row_max_abs(h))]) is None


def test_many_large_rows_or_too_few_rows_are_not_isolated():
    x = np.ones((32, 4))
    x[:8] = 1e20  # a quarter of the batch: not one sample
    assert F.isolated_rows([(0, F.row_max_abs(x))]) is None
    assert F.row_max_abs(np.ones(3)) is None and F.row_max_abs(np.float32(2.0)) is None
