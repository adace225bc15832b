"""Fixtures of the PyTorch tests (tests/torch): the Inductor cache and nanguard's global torch hooks."""
from __future__ import annotations

import os
import tempfile

# Inductor caches its kernels and precompiled headers per user, not per CPU capability: a cache written
# under the native capability breaks the C++ compile of a later run under ATEN_CPU_CAPABILITY=default
# ('at::vec' has not been declared). One cache per capability (subprocesses inherit it), and one per
# pytest-xdist worker (PYTEST_XDIST_WORKER, set before conftests load), so that parallel workers never
# compile into the same folder.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), "torchinductor_nanguard_" + os.environ.get("ATEN_CPU_CAPABILITY", "native")
    + ("_" + os.environ["PYTEST_XDIST_WORKER"] if os.environ.get("PYTEST_XDIST_WORKER") else "")))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_torch_hooks():
    """A failing test must not leave nanguard's global torch hooks behind."""
    init, backward = torch.optim.Optimizer.__init__, torch.autograd.backward
    from torch.amp import grad_scaler as gs
    scaler_step = gs.GradScaler.step
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
