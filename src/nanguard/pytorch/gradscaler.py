"""What nanguard reads from a ``torch.amp.GradScaler`` (without syncing)."""
from __future__ import annotations

from typing import Any

import torch


def scaler_enabled(scaler: Any) -> bool:
    try:
        return bool(scaler.is_enabled())
    except Exception:
        return False


def scale_tensor(scaler: Any, dev: torch.device) -> torch.Tensor:
    """The current loss scale as a 0-d float32 tensor on ``dev`` (NaN without an enabled scaler)."""
    s = getattr(scaler, "_scale", None) if scaler is not None and scaler_enabled(scaler) else None
    if isinstance(s, torch.Tensor):
        return s.reshape(()).float().to(dev)
    return torch.tensor(float("nan"), device=dev)


def found_inf(scaler: Any, opt: Any, dev: torch.device) -> torch.Tensor:
    """The scaler's ``found_inf`` for ``opt`` this step (0 when none), as a 0-d tensor on ``dev``."""
    if scaler is None or opt is None or not scaler_enabled(scaler):
        return torch.zeros((), device=dev)
    try:
        st = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        if st:
            return sum(v.to(dev).float().reshape(()) for v in st.values())
    except Exception:
        pass
    return torch.zeros((), device=dev)
