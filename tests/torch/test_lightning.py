"""PyTorch Lightning: ``nanguard.integrations.lightning.NanGuardCallback`` with the real library, on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

L = pytest.importorskip("lightning")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from nanguard.integrations.lightning import NanGuardCallback  # noqa: E402

from ngtest import load_report  # noqa: E402

BS, N = 8, 48


class Net(L.LightningModule):
    """A tiny regression model; ``log_zero_at`` makes training_step take log(0) at that global step."""

    def __init__(self, log_zero_at: int = -1):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 1)
        self.log_zero_at = log_zero_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.fc1(x))
        if self.global_step == self.log_zero_at:
            h = torch.log(h * 0.0)  # the bug: log(0) = -inf
        loss = torch.nn.functional.mse_loss(self.fc2(h), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader(nan_at=None):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    if nan_at is not None:
        step, row = nan_at
        x[step * BS + row, 2] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=False)


def fit(model, dl, cb, **kw):
    torch.manual_seed(0)
    tr = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[cb], logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    tr.fit(model, dl)
    return tr


def test_recover_drops_a_nan_sample_and_fit_finishes(tmp_path):
    torch.manual_seed(0)
    model = Net()
    cb = NanGuardCallback(recover="auto", report=str(tmp_path / "r.json"), quiet=True)
    tr = fit(model, loader(nan_at=(3, 5)), cb)
    assert tr.global_step == N // BS  # every step ran: training finished
    rep = load_report(tmp_path / "r.json")
    assert rep["status"] == "recovered"
    assert len(rep["events"]) == 1
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (3, "data")
    assert ev["cause"]["category"] == "bad_input_data"
    # the replay without row 5 was finite: the step trains on the other rows (verified before applying)
    assert ev["recovery"]["action"] == "drop_samples" and ev["recovery"]["actions"]["drop_samples"]["rows"] == [5]
    assert ev["recovery"]["verified"] == "verified by replay before applying"
    assert ev["localization"]["reproduced"] is True  # training_step was replayed under the recorder
    assert ev["origin"]["samples"] == [5]
    assert [h["skipped"] for h in rep["history"]] == [False] * (N // BS)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_stop_names_log_of_zero_and_keeps_the_weights(tmp_path):
    K = 2
    torch.manual_seed(0)
    model = Net(log_zero_at=K)
    weights = {}

    class Snap(L.Callback):  # the weights before step K's update
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == K:
                weights.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    cb = NanGuardCallback(on_nonfinite="stop", report=str(tmp_path / "r.json"), quiet=True)
    torch.manual_seed(0)
    tr = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[Snap(), cb], logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    tr.fit(model, loader())
    assert tr.global_step == K + 1  # stopped right after the failing step
    assert cb.stopped is not None and cb.stopped.step == K
    rep = load_report(tmp_path / "r.json")
    assert rep["status"] == "nonfinite"
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (K, "forward")
    assert ev["cause"]["category"] == "log_domain"
    assert ev["origin"]["op"] == "aten.log.default"
    assert ev["origin"]["function"] == "training_step"
    assert rep["steps_watched"] == K
    # the bad update never reached the weights
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_warn_reports_and_goes_on(tmp_path):
    torch.manual_seed(0)
    model = Net()
    cb = NanGuardCallback(on_nonfinite="warn", report=str(tmp_path / "r.json"), quiet=True, localize=False)
    tr = fit(model, loader(nan_at=(1, 0)), cb)
    assert tr.global_step == N // BS
    rep = load_report(tmp_path / "r.json")
    assert rep["status"] == "nonfinite"
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (1, "data")


# Lightning's own DDP strategy (2 CPU processes, gloo): rank 1 gets a NaN sample at step K.
DDP_SCRIPT = '''\
import json, os, sys
import torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from nanguard.integrations.lightning import NanGuardCallback

OUT, K = sys.argv[1], 2


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):   # each rank its own data; rank 1 has a NaN at step K, row 3
        g = torch.Generator().manual_seed(10 + self.global_rank)
        x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
        if self.global_rank == 1:
            x[K * 8 + 3, 0] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=8)


torch.manual_seed(0)
cb = NanGuardCallback(recover="auto", report=os.path.join(OUT, "report.json"))
model = Net()
tr = L.Trainer(max_epochs=1, accelerator="cpu", devices=2, strategy="ddp", callbacks=[cb], logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               use_distributed_sampler=False)
tr.fit(model)
torch.save(model.state_dict(), os.path.join(OUT, f"state{tr.global_rank}.pt"))
with open(os.path.join(OUT, f"rank{tr.global_rank}.json"), "w") as f:
    json.dump({"skipped": [h["step"] for h in cb.report.history if h["skipped"]], "global_step": tr.global_step}, f)
'''


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_ddp_strategy_skips_the_same_step_on_both_ranks(tmp_path):
    script = tmp_path / "train_lightning_ddp.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] == {"skipped": [2], "global_step": 4}
    a = torch.load(out / "state0.pt", weights_only=True)
    b = torch.load(out / "state1.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) and torch.isfinite(a[k]).all() for k in a)
    rep = load_report(out / "report.json")
    assert rep["status"] == "recovered"
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"], ev["rank"]) == (2, "data", 1)
    assert ev["cause"]["category"] == "bad_input_data"
    assert ev["origin"]["samples"] == [3]
