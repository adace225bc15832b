"""``nanguard run`` without ``--recover``: an early warning's fix is replayed on the warning step's own recorded
calls from the weights at the warning, then put back (issue 22: fixes tested before they are printed). A cut
that passes is printed as tested; one that fails from weights the excursion already moved is no verdict (the
fixes keep their order, untested). The replay changes nothing in the run: it trains on bit-for-bit as with the
replays off."""
from __future__ import annotations

import torch

from ngtest import run_ng, write

SCRIPT = """
import sys, torch
torch.manual_seed(0)
LR, OUT = float(sys.argv[1]), sys.argv[2]
x = torch.randn(512, 8); y = x @ torch.randn(8, 1)
enc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1))
dec = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(list(enc.parameters()) + list(dec.parameters()), lr=LR)
for step in range(30):
    i = torch.randint(0, 512, (32,))
    loss = ((dec(enc(x[i])) - y[i]) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
torch.save({"enc": enc.state_dict(), "dec": dec.state_dict()}, OUT)
"""


def _warning(rep):
    ws = [e for e in rep["events"] if e.get("kind") == "warning"]
    assert ws, "no early warning"
    return ws[0]


def test_a_warning_cut_is_tested_on_its_step_and_the_run_is_untouched(tmp_path):
    script = write(tmp_path, SCRIPT)
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    code, rep = run_ng(tmp_path, script, [0.6, a], localize=True)
    w = _warning(rep)
    c = w["cause"]
    assert c["category"] == "lr_too_high", c["summary"]
    passed = [t for t in c.get("tested_fixes") or [] if t.get("passed")]
    assert passed and passed[0]["text"].startswith("lr 0.6 -> "), c.get("tested_fixes")
    assert any(x["kind"] == "lr_replay" for x in c["evidence"]["experiments"])
    # the same run with the replays off: the same weights at the end (the replay put everything back)
    code2, rep2 = run_ng(tmp_path, script, [0.6, b], report=str(tmp_path / "r2.json"), localize=True,
                         experiments="off")
    assert not (_warning(rep2)["cause"].get("tested_fixes"))
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    for part in ("enc", "dec"):
        for k in sa[part]:
            assert torch.equal(sa[part][k], sb[part][k]), (part, k)


def _guard_run(experiments):
    import nanguard
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = x @ torch.randn(8, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.6)
    g = nanguard.Guard(model, opt, report=None, quiet=True, experiments=experiments)
    for _ in range(30):
        i = torch.randint(0, 512, (32,))
        g.step((x[i], y[i]), lambda b: ((model(b[0]) - b[1]) ** 2).mean())
    return g.close(), model.state_dict()


def test_the_guard_tests_a_warning_cut_on_its_step_and_trains_on_untouched():
    rep, sd = _guard_run("auto")
    w = next(e for e in rep.events if e.kind == "warning")
    passed = [t for t in w.cause.get("tested_fixes") or [] if t.get("passed")]
    assert passed and passed[0]["text"].startswith("lr 0.6 -> "), w.cause.get("tested_fixes")
    rep2, sd2 = _guard_run("off")
    assert not next(e for e in rep2.events if e.kind == "warning").cause.get("tested_fixes")
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
