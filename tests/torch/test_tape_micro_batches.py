"""Gradient accumulation where a micro-batch computes from its data before its model call
(``lt = torch.log(t)`` after the previous micro-batch's backward). The step tape's region is closed from a
backward to the next module call, so that call is not recorded and its NaN reached the replay as an input:
"bad input data: batch position [1] holds 1 NaN" for a finite target of -1. Such an input is now not
called data: ``nanguard run`` re-runs the script and finds ``log``; a data loader's own batch still is."""
from __future__ import annotations

import pytest

from ngtest import run_ng_cli

import nanguard

LOOP = """
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
enc, reg = nn.Sequential(nn.Linear(12, 16), nn.GELU()), nn.Linear(16, 1)
opt = torch.optim.Adam([*enc.parameters(), *reg.parameters()], lr=1e-3)
data, target = torch.randn(128, 12), torch.rand(128, 1)
target[41] = BAD                    # step 2, second micro-batch, row 1
it = iter(DataLoader(TensorDataset(data, target), batch_size=8)) if LOADER else None
for step in range(8):
    opt.zero_grad()
    for k in range(2):
        i = (step * 2 + k) * 8
        x, t = next(it) if LOADER else (data[i:i + 8], target[i:i + 8])
        lt = torch.log(t) if LOG else t
        ((lt - reg(enc(x))) ** 2).mean().div(2).backward()
    opt.step()
"""


def _watched(bad: str, loader: bool, log: bool):
    ns: dict = {}
    with nanguard.watch(report=None, quiet=True, on_nonfinite="warn") as w:
        exec(LOOP.replace("BAD", bad).replace("LOADER", str(loader)).replace("LOG", str(log)), ns)
    return w.report.events[0]


def test_a_nan_made_between_micro_batches_is_not_called_bad_data():
    ev = _watched("-1.0", loader=False, log=True)
    assert ev.step == 2 and ev.cause["category"] != "bad_input_data", ev.cause["summary"]
    assert not ev.localization.get("reproduced")  # nanguard.watch(): no re-run to fall back on


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_nanguard_run_re_runs_it_and_finds_the_log(tmp_path):
    rep, err = run_ng_cli(tmp_path, LOOP.replace("BAD", "-1.0").replace("LOADER", "False").replace("LOG", "True"))
    ev = rep["events"][0]
    assert ev["step"] == 2 and ev["cause"]["category"] == "log_domain", (ev["cause"]["summary"], err[-2000:])
    assert ev["localization"]["method_kind"] == "rerun" and ev["origin"]["samples"] == [1]


def test_a_data_loader_s_nan_in_the_second_micro_batch_is_still_its_dataset_row():
    ev = _watched("float('nan')", loader=True, log=False)
    assert ev.step == 2 and ev.cause["category"] == "bad_input_data", ev.cause["summary"]
    assert "[41]" in ev.cause["summary"] and ev.localization.get("reproduced")
