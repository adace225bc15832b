"""Two models trained one after the other, each with its own optimizer (knowledge distillation, as in the
PyTorch tutorial: the teacher's Adam for some steps, then the student's): the student's optimizer counts
its steps from 0 while the step tape was last numbered by the teacher's. A non-finite loss at the
student's first step must still be replayed in-process and located at its op and line (before: the tape
and the failing step disagreed, the re-run child armed at the teacher's step 0, "could not reproduce",
category ``other``)."""
from __future__ import annotations

from ngtest import run_ng, write

SCRIPT = """
import torch
import torch.nn as nn
torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x[:, 0] > 0).long()
teacher, student = nn.Linear(8, 2), nn.Linear(8, 2)
opt = torch.optim.Adam(teacher.parameters(), lr=0.01)
for step in range(6):
    loss = nn.functional.cross_entropy(teacher(x) * 30, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
T = 0.1  # a sharp temperature: the soft targets underflow to exact zeros
opt2 = torch.optim.Adam(student.parameters(), lr=0.01)
for step in range(4):
    with torch.no_grad():
        t = teacher(x) * 30
    s = student(x)
    soft_targets = nn.functional.softmax(t / T, dim=-1)
    soft_prob = nn.functional.log_softmax(s / T, dim=-1)
    loss = torch.sum(soft_targets * (soft_targets.log() - soft_prob)) / soft_prob.size()[0]
    opt2.zero_grad()
    loss.backward()
    opt2.step()
"""


def test_second_model_failure_is_located_in_process(tmp_path):
    path = write(tmp_path, SCRIPT)
    code, rep = run_ng(tmp_path, path, localize=True)
    assert rep is not None and rep["status"] == "nonfinite"
    ev = rep["events"][0]
    assert ev["phase"] == "forward"
    assert ev["cause"]["category"] == "log_domain"
    line = SCRIPT.splitlines().index(
        "    loss = torch.sum(soft_targets * (soft_targets.log() - soft_prob)) / soft_prob.size()[0]") + 1
    assert ev["origin"]["line"] == line
