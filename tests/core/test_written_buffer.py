"""A buffer the script's own code computed (``self.register_buffer("sqrt_alphas_cumprod", torch.sqrt(ac))`` in a
diffusion model's ``__init__``, outside any module's forward) holding NaN: the op that computed it is the origin,
with its own facts (sqrt of 3 negatives: sqrt_domain at that line), not "a corrupted parameter, re-initialise it".
A buffer a module's forward writes (BatchNorm's running statistics) keeps its reading."""
from __future__ import annotations

from nanguard.core.events import Detection
from nanguard.core.pipeline import written_in_step


def _loc(module=None, facts=True):
    wb = {"op": "aten.sqrt.default", "api": "torch.sqrt", "module": module, "file": "/u/diffusion.py", "line": 70,
          "function": "__init__", "stage": "forward", "output": {"nan": 3, "posinf": 0, "neginf": 0},
          "facts": {"sqrt_domain": {"zeros": 0, "negatives": 3, "numel": 10}} if facts else {}}
    pre = {"kind": "buffer", "name": "sqrt_alphas_cumprod", "stats": {"dtype": "float32", "nan": 3, "numel": 10},
           "written_by": wb}
    return {"reproduced": True, "phase": "params", "origin": None, "preexisting": pre, "facts": {}}


def test_a_buffer_computed_by_the_scripts_code_is_born_at_its_op():
    out = written_in_step(Detection(0, "params"), _loc())
    assert "preexisting" not in out and out["phase"] == "forward"
    assert out["origin"]["line"] == 70 and out["origin"]["written_into"] == "sqrt_alphas_cumprod"
    assert out["facts"]["sqrt_domain"]["negatives"] == 3
    # written by a module's forward (a running statistic): as before, unless the run met it in the step
    loc = _loc(module="bn")
    assert written_in_step(Detection(0, "optimizer"), loc) is loc
    loc = _loc(facts=False)
    assert written_in_step(Detection(0, "optimizer"), loc) is loc
