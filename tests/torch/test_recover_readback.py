"""A recovered (skipped) step's loss read back after the update (a Lightning callback's outputs["loss"].item(), a
logger's clone) is that failure, not a new evaluation event: the run was reported "nonfinite" with an 'eval'
event at the next step, "could not reproduce", though it recovered and trained to its end."""
from ngtest import run_ng, write

READBACK = """\
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
out = []
for step in range(12):
    x = torch.randn(8, 4)
    w = torch.ones(8) * (0.0 if step == 5 else 1.0)   # step 5: a weighted mean over weights that sum to 0
    loss = ((model(x).squeeze(1) ** 2) * w).sum() / w.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    logged = loss.detach().clone()
    out.append(logged.item())
print("done", len(out))
"""


def test_a_skipped_steps_loss_read_after_the_update_is_not_an_evaluation_failure(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, READBACK), recover="auto")
    assert code == 0 and rep["status"] == "recovered", (rep["status"], rep["events"])
    assert [(e["step"], e["phase"]) for e in rep["events"]] == [(5, "forward")]


def test_a_non_finite_read_of_a_later_value_is_still_reported(tmp_path):
    # a NaN made after the failed step (not its loss read back) is an evaluation of its own
    text = READBACK.replace("    out.append(logged.item())", "    out.append(logged.item())\n"
                            "    if step == 5:\n        torch.tensor([float('inf')]).item()")
    code, rep = run_ng(tmp_path, write(tmp_path, text), recover="auto")
    assert any(e["phase"] == "eval" for e in rep["events"]), rep["events"]


ACCUM = """\
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
out, norms = [], []
for step in range(10):
    for micro in range(2):
        x = torch.randn(8, 4)
        w = torch.ones(8) * (0.0 if (step, micro) == (4, 0) else 1.0)  # the step's first micro-batch: 0/0
        loss = ((model(x).squeeze(1) ** 2) * w).sum() / w.sum() / 2
        loss.backward()
        out.append(loss.detach().item())    # read inside the step, before its update (a Lightning callback)
    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    opt.zero_grad()
    if step % 3 == 0:
        print([n.item() for n in norms])    # a logger reads the clip's norms at later steps (HF Trainer)
        norms = []
print("done", len(out))
"""


def test_a_skipped_steps_numbers_read_in_its_micro_batch_or_from_its_clip_are_not_evaluation_failures(tmp_path):
    """Lightning with accumulate_grad_batches=2: the NaN micro-batch's loss is read before the step's update;
    HF Trainer logs the clip's grad_norm of the skipped step at a later step. Both were reported as eval
    failures ("could not reproduce ... a hardware fault") and the recovered run ended "nonfinite"."""
    code, rep = run_ng(tmp_path, write(tmp_path, ACCUM), recover="auto")
    assert code == 0 and rep["status"] == "recovered", (rep["status"], [(e["step"], e["phase"]) for e in rep["events"]])
    assert [e["phase"] for e in rep["events"]] == ["forward"]


NAN_RATE = """\
import math
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
losses = []
for step in range(12):
    opt.param_groups[0]["lr"] = float("nan") if step in (6, 7) else 0.01   # a schedule's two bad values
    x = torch.randn(8, 4)
    loss = (model(x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("bad", [i for i, v in enumerate(losses) if not math.isfinite(v)])
"""


def test_under_recovery_no_forward_runs_on_weights_an_update_made_non_finite(tmp_path, capsys):
    """The update's parameter check was read at the next step's sync: that step's forward ran on the NaN
    weights first, and the script read a NaN loss in a 'recovered' run (and the last update's NaN stayed)."""
    code, rep = run_ng(tmp_path, write(tmp_path, NAN_RATE), recover="auto")
    assert code == 0 and rep["status"] == "recovered", (rep["status"], rep["events"][-1:])
    assert [(e["step"], e["phase"]) for e in rep["events"]] == [(6, "optimizer"), (7, "optimizer")]
    assert "bad []" in capsys.readouterr().out  # no loss the script read was made by NaN weights


def test_the_guard_under_recovery_reads_the_updates_check_before_the_next_forward():
    import math

    import torch

    import nanguard
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = nanguard.Guard(model, opt, recover="auto", quiet=True, report=None)
    losses = []
    for step in range(12):
        opt.param_groups[0]["lr"] = float("nan") if step in (6, 7) else 0.01
        losses.append(float(g.step((torch.randn(8, 4),), lambda b: (model(b[0]) ** 2).mean())))
    assert all(map(math.isfinite, losses)), losses  # step 7's forward ran on the weights step 6 made NaN
    assert all(bool(p.isfinite().all()) for p in model.parameters())
