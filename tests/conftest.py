"""Fixtures for the whole suite; the shared helpers are in ngtest.py."""
from __future__ import annotations

import os
import sys
import tempfile

# Inductor caches its kernels and precompiled headers per user, not per CPU capability: a cache written
# under the native capability breaks the C++ compile of a later run under ATEN_CPU_CAPABILITY=default
# ('at::vec' has not been declared). One cache per capability (subprocesses inherit it).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), "torchinductor_nanguard_" + os.environ.get("ATEN_CPU_CAPABILITY", "native")))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Default report/bundle paths are relative to the working directory: keep them in tmp."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _restore_global_state():
    """A failing test must not leave nanguard's global hooks or argv behind."""
    init, backward = torch.optim.Optimizer.__init__, torch.autograd.backward
    from torch.amp import grad_scaler as gs
    scaler_step = gs.GradScaler.step
    argv, path = list(sys.argv), list(sys.path)
    from torch.nn.modules import module as mm
    n_hooks = (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks))
    import torch.optim.optimizer as oo
    n_opt_hooks = (len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks))
    yield
    assert (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks)) == n_hooks, \
        "global module hooks left installed"
    assert (len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks)) == n_opt_hooks, \
        "global optimizer hooks left installed"
    assert torch.optim.Optimizer.__init__ is init, "Optimizer.__init__ hook left installed"
    assert torch.autograd.backward is backward, "autograd.backward hook left installed"
    assert gs.GradScaler.step is scaler_step, "GradScaler.step hook left installed"
    assert sys.argv == argv, "sys.argv not restored"
    assert sys.path == path, "sys.path not restored"
