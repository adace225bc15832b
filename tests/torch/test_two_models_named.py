"""Several top-level models (a recommender's user and item embeddings, no parent module): a parameter is
named by the script's variable of its model (``emb_u.weight``), not by its optimizer slot, nor by a name
two models share (``weight``)."""
from __future__ import annotations

import pytest

from ngtest import run_ng_cli

SCRIPT = """
import torch, torch.nn as nn
torch.manual_seed(0)
emb_u, emb_i = nn.Embedding(50, 8), nn.Embedding(120, 8)
opt = torch.optim.Adam(list(emb_u.parameters()) + list(emb_i.parameters()), lr=1e-2, eps=0.0)
for step in range(5):
    u = torch.randint(0, 50, (16,)); i = torch.randint(0, 100, (16,))   # items 100-119 never drawn
    loss = ((emb_u(u) * emb_i(i)).sum(-1) - 3.0).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_a_parameter_of_one_of_two_top_level_models_is_named_by_its_variable(tmp_path):
    ev = run_ng_cli(tmp_path, SCRIPT)[0]["events"][0]
    assert ev["cause"]["category"] == "optimizer_numerics", ev["cause"]["summary"]
    # eps=0: 0/0 in the rows of both tables that no batch used; the first one made non-finite is emb_u's
    assert "'emb_u.weight'" in ev["cause"]["summary"] or "'emb_i.weight'" in ev["cause"]["summary"], \
        ev["cause"]["summary"]
    assert "param_groups" not in ev["cause"]["summary"], ev["cause"]["summary"]
