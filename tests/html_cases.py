"""Reports for the HTML tests, made by real runs of small scripts under ``python -m nanguard run``.

Each case is run once per test session (cached here) in a temporary folder:

* ``log_domain``: a forward failure: a hand-written log(sigmoid) head gets a saturating outlier at
  step 25, ``torch.log`` receives an exact 0 inside module ``head`` (stopped, exit status 3);
* ``lr_recovered``: raw polynomial features under momentum SGD with a learning rate far above the
  stability limit diverge to inf; ``--recover auto`` rolls back and lowers the learning rate;
* ``clean_warning``: a clean two-group Adam run. nanguard has no warning events yet, so the test
  adds one by hand to the real clean report: ``"kind": "warning"`` plus the usual event keys (a
  guess at the shape the warnings feature will write; the page reads only ``kind``, ``step``,
  ``phase``, ``cause`` and ``fixes``). The page must mark it on the plots and list it.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Tuple

from nanguard.core.events import SCHEMA

LOG_DOMAIN = '''\
# Binary classifier whose head returns log-probabilities computed by hand.
import torch

torch.manual_seed(0)


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 1)

    def forward(self, h):
        p = torch.sigmoid(self.fc(h))
        return torch.log(p), torch.log(1 - p)  # log(0) = -inf once p rounds to 1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU())
        self.head = Head()

    def forward(self, x):
        return self.head(self.body(x))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    x = torch.randn(32, 4)
    y = (x[:, 0] > 0).float().unsqueeze(1)
    if step == 25:
        x[7] = 1e4  # an outlier reading: the logit saturates
    logp, log1mp = model(x)
    loss = -(y * logp + (1 - y) * log1mp).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''
LOG_DOMAIN_LINE = 14  # the torch.log line

LR_TOO_HIGH = '''\
# Linear regression on raw polynomial features (r, r^2, r^3 of r in [0, 3]) with momentum SGD;
# the learning rate was tuned for standardised inputs.
import torch

torch.manual_seed(0)
r = torch.rand(1024, 1) * 3
x = torch.cat([r, r ** 2, r ** 3], 1)
y = torch.cos(r) + 0.05 * torch.randn(1024, 1)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
for step in range(120):
    idx = torch.randint(0, 1024, (64,))
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
'''

CLEAN = '''\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam([{"params": model[0].parameters(), "lr": 3e-3},
                        {"params": model[2].parameters(), "lr": 1e-3}])
for step in range(60):
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''

WARNING_STEP = 40

CASES = {
    "log_domain": (LOG_DOMAIN, [], 3),
    # --on-spike warn: the failure's own recovery (the default under --recover rolls back at the early
    # warning, before anything is non-finite)
    "lr_recovered": (LR_TOO_HIGH, ["--recover", "auto", "--on-spike", "warn"], 0),
    "clean_warning": (CLEAN, [], 0),
}

_cache: Dict[str, Tuple[Dict[str, Any], str]] = {}


def run_case(name: str, folder: Path) -> Tuple[Dict[str, Any], str]:
    """(report dict, script path) of one case; the run happens once per session."""
    if name in _cache:
        return copy.deepcopy(_cache[name][0]), _cache[name][1]
    text, flags, want = CASES[name]
    d = Path(folder) / name
    d.mkdir(parents=True, exist_ok=True)
    script = d / "train.py"
    script.write_text(textwrap.dedent(text))
    report = d / "report.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "nanguard", "run", "--report", str(report), "--no-bundle", *flags,
                        str(script)], cwd=d, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == want, f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}"
    with open(report) as f:
        rep = json.load(f)
    if name == "clean_warning":
        assert rep["status"] == "clean" and rep["events"] == []
        rep = add_warning(rep)
    _cache[name] = (rep, str(script))
    return copy.deepcopy(rep), str(script)


def add_warning(rep: Dict[str, Any], step: int = WARNING_STEP) -> Dict[str, Any]:
    """The clean report plus one warning event, built by hand (a page with a warning on a clean history)."""
    rep = copy.deepcopy(rep)
    h = next(r for r in rep["history"] if r["step"] == step)
    rep["events"].append({
        "kind": "warning", "step": step, "phase": "backward", "origin": None,
        "cause": {"category": "grad_norm_spike", "confidence": 0.5, "evidence": {"grad_norm": h["grad_norm"]},
                  "summary": f"the gradient norm {h['grad_norm']:.3g} is far above the run's median (test-made "
                             "warning)"},
        "fixes": ["clip the gradient norm: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"],
        "recovery": None, "detected": {"grad_norm": h["grad_norm"]}, "localization": None})
    return rep


PAYLOADS = {
    "module": '<script>window.__ng_pwned = "module"</script>enc',
    "summary": 'summary <img src=x onerror="window.__ng_pwned=\'summary\'"> & "quotes"',
    "fix": 'use `x.clamp(min=1e-12)` </li><script>window.__ng_pwned="fix"</script>',
    "source": 'y = x  # <img src=x onerror="window.__ng_pwned=\'source\'"><script>alert(1)</script>',
}


def payload_report(folder: Path) -> dict:
    """A hand-made report whose strings carry HTML/JS payloads (and a source file whose line does)."""
    src = Path(folder) / "evil_<marquee>.py"
    src.write_text("import torch\n\n\ndef f(x):\n    " + PAYLOADS["source"] + "\n    return y\n")
    return {
        "schema": SCHEMA, "status": "nonfinite", "nanguard_version": "0.1.0", "counting": "optimizer",
        "steps_watched": 3, "max_grad_norm": "inf", "scaler_skips": 0,
        "info": [{"step": 1, "phase": "data", "note": "<script>x</script>"}],
        "history": [{"step": 0, "loss": 1.0, "grad_norm": 2.0, "group_grad_norms": [2.0], "param_norm": 3.0,
                     "update_ratio": 0.01, "lr": [0.1], "loss_scale": None, "skipped": False},
                    {"step": 1, "loss": "nan", "grad_norm": "inf", "group_grad_norms": ["inf"], "param_norm": 3.0,
                     "update_ratio": None, "lr": [0.1], "loss_scale": None, "skipped": True}],
        "events": [{
            "step": 2, "phase": "forward", "rank": "<i>0</i>",
            "origin": {"op": "aten.log.default", "module": PAYLOADS["module"], "file": str(src), "line": 5,
                       "function": "<lambda>", "dtype": "float32", "shape": [4],
                       "inputs": [{"dtype": "<u>float</u>", "shape": [4], "numel": 4, "min": 0.0}]},
            "cause": {"category": "log_domain<svg onload=alert(1)>", "summary": PAYLOADS["summary"],
                      "confidence": 0.9, "evidence": {"note": "</table><script>alert(2)</script>",
                                                      "sink": {"kind": "loss", "names": ["<xmp>nan</xmp>"]}}},
            "fixes": [PAYLOADS["fix"]], "recovery": None,
            "localization": {"method": "<script>alert(3)</script>", "reproduced": True}}],
        "<key>": "<script>alert(4)</script>",
    }
