"""What an exp's source line says: a hand-written softmax divides by a sum of exps or sums the exps
themselves; an exp weighting other terms inside a sum (a Gaussian NLL's (x - mu)^2 * exp(-logvar)) is not
one (a VAE's overflow there was told to use jax.nn.softmax)."""
from __future__ import annotations

import pytest

from nanguard.core.diagnosis.rules.exp import exp_argument


@pytest.mark.parametrize("line, arg, softmax", [
    ("nll = 0.5 * jnp.sum(x_logvar + (xb - x_mu) ** 2 * jnp.exp(-x_logvar), axis=-1)", "-x_logvar", False),
    ("p = torch.exp(z) / torch.exp(z).sum(1, keepdim=True)", "z", True),
    ("lse = torch.log(torch.sum(torch.exp(z), 1))", "z", True),
    ("s = torch.exp(z).sum(-1)", "z", True),
    ("std = torch.exp(0.5 * logvar)", "0.5 * logvar", False),
])
def test_a_softmax_is_told_from_a_weighted_sum(tmp_path, line, arg, softmax):
    f = tmp_path / "train.py"
    f.write_text("def step():\n    " + line + "\n")
    assert exp_argument({"file": str(f), "line": 2}) == (arg, softmax)
