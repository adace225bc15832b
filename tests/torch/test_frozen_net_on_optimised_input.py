"""A frozen network in eval mode scoring an input that is being optimised (neural style transfer: L-BFGS on
the image, the losses stored by modules inside the network; a perceptual loss on a generator's output) is
part of the training step, not an evaluation: its non-finite output is the step's failure, never an ``eval``
event (the scenario ``style_transfer_lbfgs_image`` gave two ``eval`` events before its ``params`` one)."""
from __future__ import annotations

import pathlib
import shutil

from ngtest import run_ng

SCENARIO = pathlib.Path(__file__).resolve().parents[1] / "scenarios" / "style_transfer_lbfgs_image.py"


def test_an_eval_mode_network_on_an_optimised_input_is_training(tmp_path):
    script = tmp_path / SCENARIO.name
    shutil.copy(SCENARIO, script)
    code, rep = run_ng(tmp_path, str(script), localize=True)
    assert rep["status"] == "nonfinite"
    failures = [e for e in rep["events"] if e.get("kind") != "warning"]
    assert failures and all(e["phase"] != "eval" for e in failures), [(e["step"], e["phase"]) for e in failures]
    assert (failures[0]["step"], failures[0]["cause"]["category"]) == (1, "lr_too_high")
