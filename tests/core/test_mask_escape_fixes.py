"""A -inf mask summed into a reduction: where the reduction is the library's cross-entropy (label smoothing over
masked classes) its smoothing term comes first, not a hand-written masked sum the call does not have."""
from __future__ import annotations

from nanguard.core.diagnosis.rules.softmax import mask_escape

ME = {"file": "/a/train.py", "line": 39, "mask_api": "Tensor.masked_fill", "constant": float("-inf")}


def _fixes(api: str) -> list:
    origin = {"op": "aten.sum.dim_IntList", "api": api, "file": "/a/train.py", "line": 40}
    return mask_escape(origin, dict(ME), {}, "test")["fixes"]


def test_cross_entropy_puts_its_smoothing_fix_first():
    assert "label_smoothing" in _fixes("torch.nn.functional.cross_entropy")[0]


def test_a_plain_sum_keeps_the_masked_sum_first():
    assert "leave masked entries out of the reduction" in _fixes("Tensor.sum")[0]
