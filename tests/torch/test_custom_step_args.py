"""A custom optimizer whose ``step`` takes a callable with arguments (a natural-gradient step given a
Fisher-vector product): nanguard took it for a closure and replaced it with a checked one that takes none,
and the script, fine on its own, raised TypeError at step 0 under ``nanguard run``."""
from ngtest import run_ng, write

from nanguard.pytorch.detect.closure import closure_of

SCRIPT = """\
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)


class Preconditioned(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, dict(lr=0.1))

    @torch.no_grad()
    def step(self, precondition):
        for p in self.param_groups[0]["params"]:
            with torch.enable_grad():
                d = precondition(p.grad)
            scale = (p.grad * p.grad).sum() / (p.grad * d).sum()   # 0/0 on a zero gradient
            p.add_(d * scale, alpha=-0.05)
            float(scale)  # a read inside the update


BAD = int(__import__("sys").argv[1])
opt = Preconditioned(model.parameters())
for step in range(6):
    x = torch.randn(8, 4)
    y = torch.zeros(8, 1) if step != BAD else model(x).detach()   # the model's own output: a zero gradient
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step(lambda v: 2.0 * v + 0.0 * model(torch.ones(1, 4)).sum())  # calls the model inside the update
    print(float(model(x).sum()))
"""


def test_a_callable_that_takes_arguments_is_not_a_closure():
    assert closure_of((None, lambda v: v), {}) is None
    assert closure_of((None,), {"closure": lambda v, w=1: v}) is None
    c = lambda: 1.0  # noqa: E731
    assert closure_of((None, c), {}) is c and closure_of((None,), {"closure": c}) is c


def test_a_step_given_a_product_function_runs_and_its_zero_division_is_the_update(tmp_path):
    script = write(tmp_path, SCRIPT)
    code, rep = run_ng(tmp_path, script, [-1])
    assert (code, rep["status"], rep["steps_watched"]) == (0, "clean", 6), rep["events"][:1]
    code, rep = run_ng(tmp_path, script, [3])
    ev = rep["events"][0]
    # the NaN the update made is read inside it and, through the weights, by the script's read after it: the
    # update's failure at its step, not an evaluation's
    assert (ev["step"], ev["phase"]) == (3, "optimizer"), ev
