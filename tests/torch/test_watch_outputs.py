"""``nanguard.watch(report=...)`` never writes over a user's file: the path is refused before the block
runs, and the block's own code is never interrupted by a report that cannot be written."""
from __future__ import annotations

import pytest
import torch

import nanguard
from nanguard.core.outputs import OutputError


def _train(steps: int = 3) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(steps):
        loss = m(torch.randn(4, 3)).pow(2).mean()
        o.zero_grad()
        loss.backward()
        o.step()


def test_a_users_file_as_the_report_is_refused_before_the_block(tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    ran = []
    with pytest.raises(OutputError):
        with nanguard.watch(report=str(mine), quiet=True):
            ran.append(1)
    assert ran == [] and mine.read_text() == '{"mine": true}'


def test_a_report_path_taken_during_the_block_warns_and_the_block_ends_normally(tmp_path):
    out = tmp_path / "r.json"
    with pytest.warns(RuntimeWarning, match="could not write the report"):
        with nanguard.watch(report=str(out), quiet=True) as w:
            _train()
            out.write_text("someone else's file")
    assert out.read_text() == "someone else's file" and w.report.status == "clean"


def test_the_report_is_written_when_the_path_is_free(tmp_path):
    out = tmp_path / "r.json"
    with nanguard.watch(report=str(out), quiet=True):
        _train()
    assert '"schema": "nanguard.report/1"' in out.read_text()
