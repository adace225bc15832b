"""The per-step check's fast paths give exactly the answers of the plain ones (no timing here)."""
from __future__ import annotations

import pytest
import torch

from nanguard.detect import _MINMAX_NUMEL, all_finite, finite_flag

BIG = _MINMAX_NUMEL * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_large_tensor_flag_is_exact(dtype, bad):
    x = torch.randn(BIG).to(dtype)
    if dtype == torch.float64:
        x[3] = 1e300  # finite, beyond float32: must not read as non-finite
    if bad is not None:
        x[BIG // 2 + 1] = bad
    assert bool(finite_flag(x)) == bool(torch.isfinite(x).all()) == (bad is None)


def test_large_tensor_flag_non_contiguous_and_mixed_list():
    x = torch.randn(512, BIG // 512).t()
    assert bool(finite_flag(x))
    x[7, 3] = float("nan")
    assert not bool(finite_flag(x))
    ok = torch.randn(BIG)
    assert bool(all_finite([ok, torch.ones(3)]))
    assert not bool(all_finite([ok, torch.ones(3), x]))
    assert finite_flag(ok).dim() == 0 and finite_flag(ok).dtype == torch.bool
