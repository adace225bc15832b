"""An evaluation call whose output holds -inf the program wrote on purpose (an actor's invalid actions masked
with ``masked_fill(~valid, -inf)``, its bootstrap value computed under ``no_grad``) is no failure: the replay
shows the -inf is a constant the program wrote, so the call is an information row and the same module's
later calls are not replayed again. A NaN in an evaluation output is still an event."""
from __future__ import annotations

import torch
import torch.nn as nn

import nanguard


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.pi = nn.Linear(16, 4)
        self.v = nn.Linear(16, 1)

    def forward(self, obs, valid):
        h = torch.tanh(self.body(obs))
        logits = self.pi(h).masked_fill(~valid, float("-inf"))
        return torch.distributions.Categorical(logits=logits, validate_args=False), self.v(h).squeeze(-1)


def _run(nan_at=None):
    torch.manual_seed(0)
    net = Actor()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with nanguard.watch(report=None, quiet=True, on_nonfinite="warn") as w:
        for step in range(6):
            obs, valid = torch.randn(8, 6), torch.rand(8, 4) > 0.3
            valid[:, 0] = True
            dist, value = net(obs, valid)
            a = dist.sample()
            with torch.no_grad():
                nxt = obs.clone()
                if step == nan_at:
                    nxt[2, 1] = float("nan")
                _, next_value = net(nxt, valid)
            ret = 0.1 + 0.9 * torch.nan_to_num(next_value)
            loss = -(dist.log_prob(a) * (ret - value).detach()).mean() + (ret - value).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w.report


def test_an_intentional_minus_inf_mask_in_an_evaluation_output_is_information_not_a_failure():
    rep = _run()
    assert rep.status == "clean" and not rep.events, [(e.phase, e.cause) for e in rep.events]
    masked = [i for i in rep.info if i.get("intentional_mask")]
    assert masked and masked[0]["phase"] == "eval" and ":" in masked[0]["intentional_mask"], rep.info


def test_a_nan_in_an_evaluation_output_is_still_an_event():
    rep = _run(nan_at=3)
    ev = [e for e in rep.events if e.phase == "eval"]
    assert ev and ev[0].step == 3, [(e.step, e.phase) for e in rep.events]
