"""The per-step check's fast paths give exactly the answers of the plain ones (no timing here)."""
from __future__ import annotations

import pytest
import torch

from nanguard.pytorch.detect.tensors import _MINMAX_NUMEL, all_finite, finite_flag

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


# --------------------------------------------------------------------------- markers, norms, inputs

from nanguard.pytorch.detect.norms import _norm  # noqa: E402
from nanguard.pytorch.detect.tensors import finite_markers  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("n", [1, 7, BIG])
def test_finite_markers_are_exact(dtype, bad, n):
    x = torch.randn(n).to(dtype)
    if dtype == torch.float64:
        x[0] = 1e300  # finite beyond float32
    if bad is not None:
        x[n // 2] = bad
    vals = torch.stack(finite_markers(x)).tolist()
    assert all(v == v and abs(v) != float("inf") for v in vals) == (bad is None)


def _ref_norm(ts):
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in ts)))


def test_cpu_row_norm_matches_a_float64_reference():
    torch.manual_seed(0)
    ts = [torch.randn(1024, 1024), torch.randn(3000), torch.randn(64, 1024).t(),  # big, odd, non-contiguous
          torch.randn(40000, dtype=torch.float16), torch.randn(2, 1024 * 20), torch.randn(5)]
    ref = _ref_norm(ts)
    assert float(_norm(ts)) == pytest.approx(ref, rel=1e-5)
    assert float(_norm(ts[:1])) == pytest.approx(_ref_norm(ts[:1]), rel=1e-5)
    p = torch.nn.Parameter(torch.randn(256, 1024))
    out = _norm([p])
    assert not out.requires_grad and out.dim() == 0 and out.dtype == torch.float32


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_cpu_row_norm_propagates_non_finite(bad):
    big = torch.randn(64, 1024)
    big[7, 9] = bad
    v = float(_norm([torch.randn(10), big]))
    assert v != v if bad != bad else v == float("inf")
    assert float(_norm([torch.full((64 * 1024,), 1e20)])) == float("inf")  # overflow, as before


def test_losses_and_batches_are_read_exactly_in_the_one_sync():
    from nanguard.pytorch.detect import StepMonitor
    torch.manual_seed(0)  # unseeded, the output's mean square fell below 0.1 (loss under 1e299) in some runs
    m = torch.nn.Linear(3, 1).double()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    mon = StepMonitor()
    mon.add_root(m)
    # two micro-batch losses, one huge but finite in float64, and a non-scalar backward tensor
    x = torch.randn(4, 3, dtype=torch.float64)
    mon.on_batch((x, torch.arange(4)))
    for scale in (1.0, 1e300):
        loss = m(x).pow(2).mean() * scale
        mon.on_backward([loss])
    mon.on_backward([m(x).reshape(-1)])
    (m(x).pow(2).mean()).backward()
    assert mon.check(opt) is None  # nothing non-finite: 1e300 is a float64 number, not an overflow
    assert mon._last["loss"] > 1e299
    mon.end_step(opt)
    # a NaN in a non-scalar backward tensor is a forward failure; an inf in the batch is data
    y = x.clone()
    y[1, 1] = float("inf")
    mon.on_batch(y)
    out = m(x).reshape(-1).clone()
    out[2] = float("nan")
    mon.on_backward([out])
    det = mon.check(opt)
    assert det is not None and det.phase == "data"
