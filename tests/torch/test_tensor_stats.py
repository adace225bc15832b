"""``nanguard.pytorch.numerics.tensor_stats``: the statistics of an op's inputs in a report (a 0-dim input with a
non-finite value read "IndexError: too many indices for tensor of dimension 0" in place of its numbers)."""
from __future__ import annotations

import torch

from nanguard.pytorch.numerics import tensor_stats


def test_a_scalar_tensor_has_its_statistics():
    nan = tensor_stats(torch.tensor(float("nan")))
    assert "error" not in nan and nan["nonfinite"] == 1 and nan["nan"] == 1 and nan["shape"] == []
    zero = tensor_stats(torch.tensor(0.0))
    assert "error" not in zero and zero["zeros"] == 1 and zero["max_abs"] == 0.0


def test_finite_values_of_a_matrix_with_an_inf():
    st = tensor_stats(torch.tensor([[1.0, float("inf")], [-3.0, 0.0]]))
    assert st["shape"] == [2, 2] and st["posinf"] == 1 and st["min"] == -3.0 and st["max"] == 1.0
    assert st["zeros"] == 1 and st["negatives"] == 1
