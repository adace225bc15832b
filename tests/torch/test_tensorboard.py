"""TensorBoard: nanguard's step history and events, read back with tensorboard's EventAccumulator."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

import nanguard  # noqa: E402
from nanguard.integrations.tensorboard import TensorBoardLogger  # noqa: E402

from ngtest import INJECT, loop_script, run_ng, write  # noqa: E402


def read(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_guard_writes_history_and_events(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[2].parameters(), "lr": 0.01}])
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = nanguard.Guard(model, opt, scaler, recover="auto", quiet=True, bundle=None,
                           tensorboard=str(tmp_path / "tb"))
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if step == 4:
            x[2, 0] = float("nan")
        guard.step((x, y), lambda b: ((model(b[0]) - b[1]) ** 2).mean())
    guard.close()
    hist = {h["step"]: h for h in guard.report.history}

    acc = read(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    for t in ("loss", "grad_norm", "grad_norm/group0", "grad_norm/group1", "param_norm", "update_ratio",
              "lr/group0", "lr/group1", "loss_scale", "skipped", "nonfinite"):
        assert f"nanguard/{t}" in tags, t
    loss = scalars(acc, "nanguard/loss")
    assert sorted(loss) == list(range(6))
    assert loss[0] == pytest.approx(hist[0]["loss"], rel=1e-6)
    assert math.isnan(loss[4])  # the NaN step is written as it is
    gn = scalars(acc, "nanguard/grad_norm")
    assert gn[1] == pytest.approx(hist[1]["grad_norm"], rel=1e-6)
    assert scalars(acc, "nanguard/lr/group1")[2] == pytest.approx(0.01)
    assert scalars(acc, "nanguard/loss_scale")[0] == pytest.approx(1024.0)
    assert scalars(acc, "nanguard/skipped") == {s: (1.0 if s == 4 else 0.0) for s in range(6)}
    assert scalars(acc, "nanguard/nonfinite") == {4: 1.0}
    texts = acc.Tensors("nanguard/events/text_summary")
    assert [t.step for t in texts] == [4]
    line = texts[0].tensor_proto.string_val[0].decode()
    assert "bad_input_data" in line and "Recovered: skip_step" in line


def test_logger_on_a_users_summary_writer_stays_open(tmp_path):
    writer = SummaryWriter(str(tmp_path / "tb"))
    mon = nanguard.pytorch.detect.StepMonitor()
    logger = TensorBoardLogger.attach_to(mon, writer, prefix="ng")
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(4, 3)).pow(2).mean()
        mon.on_backward([loss])
        loss.backward()
        assert mon.check(opt) is None
        opt.step()
        mon.end_step(opt)
    logger.close()  # does not close the user's writer
    writer.add_scalar("user/after", 1.0, 0)
    writer.close()
    acc = read(tmp_path / "tb")
    assert sorted(scalars(acc, "ng/loss")) == [0, 1, 2]
    assert "user/after" in acc.Tags()["scalars"]


def test_nanguard_run_tensorboard_flag(tmp_path):
    script = write(tmp_path, loop_script(steps=5, **INJECT["data_nan"]))
    code, rep = run_ng(tmp_path, script, [3], recover="auto", tensorboard=str(tmp_path / "tb"))
    assert code == 0 and rep["status"] == "recovered"
    acc = read(tmp_path / "tb")
    assert sorted(scalars(acc, "nanguard/loss")) == list(range(5))
    assert scalars(acc, "nanguard/skipped")[3] == 1.0
    assert scalars(acc, "nanguard/nonfinite") == {3: 1.0}


def test_cli_accepts_tensorboard(tmp_path, monkeypatch):
    import nanguard.cli.main as cli
    seen = {}
    monkeypatch.setattr(cli, "run_script", lambda script, args, **kw: seen.update(kw) or 0)
    assert cli.main(["run", "--tensorboard", str(tmp_path / "tb"), "train.py"]) == 0
    assert seen["tensorboard"] == str(tmp_path / "tb")
