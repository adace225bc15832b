"""Repro bundles: saved at the first failure (Guard and ``nanguard run``), loaded safely, and enough
to reproduce the failing step with the user's own model code."""
from __future__ import annotations

import os
import pickle
import zipfile

import pytest
import torch
from torch import nn

import nanguard
from nanguard import BundleError, Guard, NonFiniteError, load_bundle
from nanguard.pytorch.bundle import FORMAT, save_bundle

from ngtest import run_ng, write


class Net(nn.Module):
    """The user's model code (a dropout layer: reproducing needs the RNG state too)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def loss_fn_for(model):
    def loss_fn(b):
        x, y = b
        return ((model(x) - y) ** 2).mean()  # (out - 1e20) ** 2 = inf in float32
    return loss_fn


def train_until_failure(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    bundle = str(tmp_path / "b.pt")
    g = Guard(model, opt, localize=False, bundle=bundle, quiet=True, report=str(tmp_path / "r.json"))
    loss_fn = loss_fn_for(model)
    gen = torch.Generator().manual_seed(1)
    seen = {}
    with pytest.raises(NonFiniteError) as ei:
        for step in range(20):
            x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
            if step == 4:
                y[3] = 1e20  # a target in the wrong unit
            seen = {"batch": (x, y)}
            g.step((x, y), lambda b: _keep(seen, loss_fn(b)))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return g, model, opt, bundle, ei.value, seen, grads


def _keep(seen, loss):
    seen["loss"] = loss.detach()
    return loss


def test_guard_bundle_round_trip_reproduces_the_failing_step(tmp_path):
    g, model, opt, path, err, seen, grads = train_until_failure(tmp_path)
    assert err.event.step == 4 and g.bundle_saved == os.path.abspath(path)
    b = load_bundle(path)
    assert isinstance(b, nanguard.Bundle) and b.step == 4 and b.phase == err.event.phase
    assert b.versions["torch"] == str(torch.__version__) and b.versions["nanguard"] == nanguard.__version__
    # the user's code, fresh objects, the bundle's state: the same non-finite loss and gradients
    torch.manual_seed(123)  # anything: the bundle's RNG state replaces it
    model2 = Net()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    b.load_into(model2, opt2)
    for k, v in model.state_dict().items():  # the state at the start of the failing step (no update applied)
        assert torch.equal(model2.state_dict()[k], v), k
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    x, y = b.batch
    assert torch.equal(x, seen["batch"][0]) and torch.equal(y, seen["batch"][1])
    loss = loss_fn_for(model2)(b.batch)
    assert not torch.isfinite(loss)
    torch.testing.assert_close(loss.detach(), seen["loss"], equal_nan=True, rtol=0, atol=0)
    loss.backward()
    for n, p in model2.named_parameters():  # the same dropout mask: the same gradients, bit for bit
        torch.testing.assert_close(p.grad, grads[n], equal_nan=True, rtol=0, atol=0)


RUN_SCRIPT = '''
import torch
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(12):
    x = torch.randn(8, 4)
    if step == 6:
        x = x * 1e-30                                   # a degenerate batch
    out = model(x)
    loss = torch.log(out.abs().mean() - out.abs().mean().detach() * (step == 6)).mean()  # log(0) at step 6
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_run_bundle_round_trip_reproduces_the_failing_step(tmp_path):
    script = write(tmp_path, RUN_SCRIPT)
    path = str(tmp_path / "run_bundle.pt")
    code, rep = run_ng(tmp_path, script, localize=True, bundle=path)
    assert code == 3 and rep["events"][0]["step"] == 6
    b = load_bundle(path)
    assert b.step == 6
    ns: dict = {}
    exec(RUN_SCRIPT.split("model = Net()")[0], ns)  # the user's model code only
    model = ns["Net"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    b.load_into(model, opt)
    assert opt.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0  # 6 steps of momentum
    (x,) = b.batch
    out = model(x)
    loss = torch.log(out.abs().mean() - out.abs().mean().detach()).mean()
    assert torch.isinf(loss)
    loss.backward()
    assert not torch.isfinite(model.fc2.bias.grad).all()


def test_bundle_with_several_roots_loads_into_each(tmp_path):
    a, c = nn.Linear(2, 2), nn.Linear(2, 1)
    st = {**{"Linear:" + k: v for k, v in a.state_dict().items()}}
    p = save_bundle(str(tmp_path / "m.pt"), step=0, phase="forward", batch=[torch.ones(1)], model_state=st,
                    optimizer_states=[], scaler_state=None, rng={"torch": torch.get_rng_state()})
    b = load_bundle(p)
    m = nn.Linear(2, 2)
    b.load_into(m, rng=False)
    assert torch.equal(m.weight, a.weight)
    with pytest.raises(BundleError):
        b.load_into(nn.Linear(2, 2), [torch.optim.SGD(c.parameters(), lr=1)])  # no optimizer state in it


# --------------------------------------------------------------------------- bad bundles

def good_bundle(tmp_path) -> str:
    m = nn.Linear(3, 2)
    return save_bundle(str(tmp_path / "good.pt"), step=3, phase="forward", batch=[torch.randn(2, 3)],
                       model_state=m.state_dict(),
                       optimizer_states=[torch.optim.Adam(m.parameters()).state_dict()], scaler_state=None,
                       rng={"torch": torch.get_rng_state()}, config={"a": 1})


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_good_bundle_loads(tmp_path):
    b = load_bundle(good_bundle(tmp_path))
    assert b.step == 3 and b.config == {"a": 1} and len(b.optimizer_states) == 1


def test_missing_empty_truncated_and_random_files_are_refused(tmp_path):
    with pytest.raises(BundleError, match="no bundle"):
        load_bundle(str(tmp_path / "nope.pt"))
    with pytest.raises(BundleError):
        load_bundle(str(tmp_path))  # a directory
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(BundleError):
        load_bundle(str(tmp_path / "empty.pt"))
    data = open(good_bundle(tmp_path), "rb").read()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleError, match="not a readable nanguard bundle"):
        load_bundle(str(tmp_path / "trunc.pt"))
    (tmp_path / "rand.pt").write_bytes(os.urandom(4096))
    with pytest.raises(BundleError):
        load_bundle(str(tmp_path / "rand.pt"))


@pytest.mark.parametrize("how", ["raw_pickle", "torch_save", "inside_a_bundle"])
def test_a_crafted_pickle_cannot_run_code(tmp_path, how):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    if how == "raw_pickle":
        path.write_bytes(pickle.dumps({"format": FORMAT, "x": Evil(marker)}))
    elif how == "torch_save":
        torch.save(Evil(marker), path)
    else:  # a valid-looking bundle whose data.pkl also carries the payload
        torch.save({"format": FORMAT, "step": 0, "phase": "forward", "model_state": {}, "optimizer_states": [],
                    "rng": {"torch": torch.get_rng_state()}, "config": {"hook": Evil(marker)}, "versions": {}},
                   path)
        assert zipfile.is_zipfile(path)
    with pytest.raises(BundleError):
        load_bundle(str(path))
    assert not marker.exists()


@pytest.mark.parametrize("change", ["format", "no_format", "step_type", "tensor_map", "no_rng", "top_list",
                                    "opt_states"])
def test_wrong_or_missing_fields_are_refused(tmp_path, change):
    d = {"format": FORMAT, "step": 1, "phase": "forward", "batch": None, "model_state": {"w": torch.ones(2)},
         "optimizer_states": [], "scaler_state": None, "rng": {"torch": torch.get_rng_state()}, "config": {},
         "versions": {}, "event": {}}
    if change == "format":
        d["format"] = "nanguard.bundle/999"
    elif change == "no_format":
        del d["format"]
    elif change == "step_type":
        d["step"] = "one"
    elif change == "tensor_map":
        d["model_state"] = {"w": [1.0, 2.0]}
    elif change == "no_rng":
        d["rng"] = {}
    elif change == "opt_states":
        d["optimizer_states"] = [1, 2]
    path = tmp_path / "x.pt"
    torch.save([d] if change == "top_list" else d, path)
    with pytest.raises(BundleError):
        load_bundle(str(path))
