"""The script's own clip calls are noted; nanguard's (recovery's clip, a replay testing the clip fix) are not:
a diagnosis said "the script already clips its gradients (clip.py:12)" of an MLP that never clips, the line
being nanguard's recover/clip.py."""
import torch

from nanguard.pytorch.clipwatch import ClipWatch
from nanguard.pytorch.recover.clip import clip_grads


def test_only_the_scripts_clip_calls_are_noted():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    w = ClipWatch()
    w.install()
    try:
        clip_grads([opt], 1.0)
        assert w.calls == 0 and w.used() is None
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert w.calls == 1 and w.used()["file"] == __file__
    finally:
        w.uninstall()
