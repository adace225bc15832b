"""A model's children called on their own, never the model (a loop over ``model`` in the training code, or
``checkpoint_sequential``): each child was taken for a model of its own and the origin's module was named ''.
The model a variable of the calling code holds is the root: the child is named by its path in it."""
from ngtest import run_ng, write

SCRIPT = """\
import torch
torch.manual_seed(0)


class Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)


model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Softplus(), torch.nn.Linear(8, 8), Log(),
                            torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    h = torch.randn(16, 4)
    for layer in model:          # the model's forward is never called
        h = layer(h)
    loss = h.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_the_origin_module_of_a_child_called_alone_is_its_path_in_the_model(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT), localize=True)
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (0, "forward"), ev
    assert ev["origin"]["module"] == "3" and ev["origin"]["line"] == 7, ev["origin"]
