"""Bad input rows: the fix's guess at their source follows what they hold (an Inf made by a division by zero
in preprocessing was guessed to be "a blank field parsed as NaN?")."""
from __future__ import annotations

from nanguard.core.diagnosis.engine import diagnose


def _loc(stats: dict) -> dict:
    return {"reproduced": True, "phase": "data", "sink": {"kind": "loss"}, "n_ops": 12,
            "preexisting": {"kind": "data", "name": "x", "stats": dict(numel=128, **stats), "samples": [13],
                            "source_rows": [2343], "rows_in_tensor": [13]}}


def test_an_inf_row_is_guessed_a_division_by_zero():
    out = diagnose(_loc({"nonfinite": 1, "posinf": 1}), [], phase="data", context={"framework": "pytorch"})
    assert out["category"] == "bad_input_data"
    texts = " ".join(str(f) for f in out["fixes"])
    assert "division by zero in preprocessing" in texts and "blank field" not in texts, texts


def test_a_nan_row_keeps_the_blank_field_guess():
    out = diagnose(_loc({"nonfinite": 4, "nan": 4}), [], phase="data", context={"framework": "pytorch"})
    assert "blank field parsed as NaN" in " ".join(str(f) for f in out["fixes"])
