"""End-to-end (``nanguard run`` in a subprocess): a DCGAN-shaped loop whose discriminator's lr is x1000
(tests/scenarios/gan_discriminator_lr_typo) warns ``lr_too_high`` naming the discriminator's optimizer, its
rate and a cut for it alone, tested by replay with the generator's rate kept; under ``--recover`` only its rate
is cut. The same loop at the right rate: no warning."""
from __future__ import annotations

import os
import pathlib

import pytest

from ngtest import run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scenarios" / "gan_discriminator_lr_typo.py"
ENV = {"OMP_NUM_THREADS": os.environ.get("NANGUARD_TEST_THREADS", "2")}


def test_gan_warning_names_the_discriminators_optimizer(tmp_path):
    p, data = run_scenario(SCRIPT, tmp_path, False, ENV)
    assert data is not None and data["status"] == "warning", p.stderr[-2000:]
    ev = data["events"][0]
    assert ev["step"] <= 6 and ev["cause"]["category"] == "lr_too_high", ev["cause"]["summary"]
    named = ev["cause"]["evidence"]["optimizer"]
    assert named["index"] == 0 and named["label"].startswith("optimizerD (Adam over netD)") and named["lr"] == [0.2]
    assert ev["fixes"][0].startswith("lower the learning rate of optimizerD (Adam over netD) from 0.2 to"), ev["fixes"]
    tested = ev["cause"].get("tested_fixes") or []
    assert tested and tested[0]["passed"] and tested[0]["text"].startswith("lr 0.2 -> "), tested  # D's alone


def test_gan_recovery_cuts_the_discriminators_rate_alone(tmp_path):
    p, data = run_scenario(SCRIPT, tmp_path, True, ENV)
    assert data is not None and data["status"] == "recovered", p.stderr[-2000:]
    cut = data["events"][0]["recovery"]["actions"]["lr_backoff"]
    assert cut["lr_before"] == [0.2] and cut["lr_after"][0] < 0.02 and cut["optimizers"] == [0]


def test_the_same_gan_at_the_right_rate_is_clean(tmp_path):
    script = tmp_path / "gan_ok.py"
    script.write_text(SCRIPT.read_text().replace("lr=2e-1,", "lr=2e-4,"))
    p, data = run_scenario(script, tmp_path, False, ENV)
    assert data is not None and data["status"] == "clean" and not data["events"], (data or {}).get("events")
