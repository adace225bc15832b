"""A healthy run loads only the per-step check: the diagnosis, the experiments, recovery, the op
recorder and the report page are imported at the first failure (their packages export lazily)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# loaded by a failure, never by a healthy step
FAILURE_ONLY = ["nanguard.core.diagnosis.engine", "nanguard.core.diagnosis.rules", "nanguard.core.experiments.investigate",
                "nanguard.core.experiments.planner", "nanguard.core.recovery.policy", "nanguard.pytorch.recover.policy",
                "nanguard.pytorch.locate.recorder", "nanguard.pytorch.replay", "nanguard.pytorch.raised",
                "nanguard.pytorch.experiments.bench"]

_SCRIPT = textwrap.dedent("""
    import json, sys, torch, nanguard
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    o = torch.optim.AdamW(m.parameters(), 1e-3)
    loss = lambda x: m(x).pow(2).mean() + (torch.log(x.abs().sum()) if %(bad)s else 0)
    if "%(mode)s" == "guard":
        g = nanguard.Guard(m, o, quiet=True, on_nonfinite="warn")
        for i in range(5):
            g.step(torch.randn(3, 4) * (0 if %(bad)s and i == 3 else 1), loss)
    else:
        with nanguard.watch(report=None, quiet=True, on_nonfinite="warn"):
            for i in range(5):
                o.zero_grad(); loss(torch.randn(3, 4) * (0 if %(bad)s and i == 3 else 1)).backward(); o.step()
    print(json.dumps(sorted(k for k in sys.modules if k.startswith("nanguard"))))
""")


def _loaded(mode: str, bad: bool) -> list:
    out = subprocess.run([sys.executable, "-c", _SCRIPT % {"mode": mode, "bad": bad}], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_a_healthy_guard_and_watch_load_no_failure_code_and_a_failure_loads_it():
    for mode in ("guard", "watch"):
        healthy = _loaded(mode, False)
        assert not [m for m in FAILURE_ONLY if m in healthy], (mode, healthy)
        assert len(healthy) < 90, (mode, len(healthy))  # 141-150 when every package loaded its modules
        failed = _loaded(mode, True)  # log(0) at step 3: located, diagnosed, reported
        for m in ("nanguard.core.diagnosis.engine", "nanguard.core.diagnosis.rules", "nanguard.pytorch.locate.recorder"):
            assert m in failed, (mode, m)
