"""Missing values as NaN in the batch, imputed inside the model's forward (``where(isnan(x), 0, x)`` plus a
missing flag, the usual tabular recipe): nothing non-finite reaches the loss, the gradients or the weights, so
the run is clean and trains bit for bit as unguarded, with the batch's NaN noted once as information (it read
`bad_input_data`, "filter non-finite samples", and stopped at step 0). A NaN the model does not handle still
fails at the data phase."""
from __future__ import annotations

import pytest
import torch

import nanguard


class Imputing(torch.nn.Module):
    def __init__(self, handle: bool = True):
        super().__init__()
        self.handle = handle
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, x):
        miss = torch.isnan(x)
        filled = torch.where(miss, torch.zeros_like(x), x) if self.handle else x
        return self.body(torch.cat([filled, miss.float()], -1)).squeeze(-1)


def _batches(n=12):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(32, 4, generator=g)
        x[torch.rand(32, 4, generator=g) < 0.15] = float("nan")
        out.append((x, torch.randn(32, generator=g)))
    return out


def _train(guarded: bool, handle: bool = True, tmp_path=None, **kw):
    torch.manual_seed(0)
    model = Imputing(handle)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss_fn(batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    if not guarded:
        for b in _batches():
            opt.zero_grad()
            loss_fn(b).backward()
            opt.step()
        return model, None
    g = nanguard.Guard(model, opt, report=str(tmp_path / "r.json"), on_nonfinite="warn", quiet=True, **kw)
    for b in _batches():
        g.step(b, loss_fn)
    g.close()
    if g._lazy is not None:
        g.report.extra["test_rewinds"] = g._lazy.rewinds
    return model, g.report


@pytest.mark.parametrize("sync_free", [False, True])
def test_nan_imputed_inside_the_model_is_clean_and_bit_for_bit(tmp_path, sync_free):
    ref, _ = _train(False)
    got, rep = _train(True, tmp_path=tmp_path, sync_free=sync_free)
    assert rep.status == "clean" and not rep.events, [(e.step, e.phase) for e in rep.events]
    handled = [i for i in rep.info if i.get("handled_in_model")]
    assert len(handled) == 1 and handled[0]["step"] == 0, rep.info
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), got.state_dict().values()))
    if sync_free:  # the batch's marks did not gate the update: no step was run again
        assert rep.extra["test_rewinds"] == 0, rep.extra


def test_nan_the_model_does_not_handle_is_still_bad_data(tmp_path):
    _, rep = _train(True, handle=False, tmp_path=tmp_path)
    assert rep.events and rep.events[0].phase == "data", rep.events
