"""A non-finite value read (``float``/``item``) while a training step's loss is being built is that
step's failure, not an evaluation event (pytorch/examples reinforcement_learning/actor_critic.py with
an episode of length 1: ``returns.std()`` of one element is NaN, and ``torch.tensor([R])`` reads it as
the critic's target); a read in a step that then passes is still reported as an ``eval`` event."""
from ngtest import run_ng, write
from nanguard.core.exitcodes import EXIT_NONFINITE

AC = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)   # 2 action logits + 1 state value
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(8):
    n = 1 if step == 5 else 6                   # a one-step episode at step 5
    out = model(torch.randn(n, 4))
    logp = F.log_softmax(out[:, :2], dim=1)[:, 0]
    value = out[:, 2]
    returns = torch.arange(n, 0, -1).float()
    returns = (returns - returns.mean()) / (returns.std() + 1e-7)   # line 13: NaN for n == 1
    losses = []
    for lp, v, R in zip(logp, value, returns):
        adv = R - v.item()
        losses.append(-lp * adv + F.smooth_l1_loss(v.view(1), torch.tensor([R]))){metric}
    loss = torch.stack(losses).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={{step}} loss={{loss.item():.4f}}")
"""


def test_nonfinite_target_read_in_the_step_is_the_steps_failure(tmp_path):
    script = write(tmp_path, AC.format(metric=""))
    code, rep = run_ng(tmp_path, script, localize=True)
    assert code == EXIT_NONFINITE
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (5, "forward")  # old code: (5, "eval"), cause "other"
    assert ev["cause"]["category"] in ("variance_zero", "div_by_zero")
    assert ev["origin"]["line"] == 13
    assert all(e["phase"] != "eval" for e in rep["events"])


def test_read_in_a_step_that_passes_is_still_an_eval_event(tmp_path):
    # a NaN metric read during the step (never part of the loss): the step passes, the read is reported
    metric = "\n    _ = float(torch.tensor([]).mean()) if step == 3 else 0.0"
    script = write(tmp_path, AC.replace("1 if step == 5 else 6", "6").format(metric=metric))
    code, rep = run_ng(tmp_path, script)
    assert code == 0
    assert [(e["step"], e["phase"]) for e in rep["events"]] == [(3, "eval")]


def test_a_recovered_step_drops_the_held_read(tmp_path):
    # --recover auto: the step's failure is recovered (its update skipped); the read it held is that
    # failure, not an evaluation event (old code: status 'nonfinite' from a second, 'eval' event)
    script = write(tmp_path, AC.format(metric=""))
    code, rep = run_ng(tmp_path, script, recover="auto")
    assert code == 0
    assert rep["status"] == "recovered"
    assert [(e["step"], e["phase"]) for e in rep["events"]] == [(5, "forward")]
