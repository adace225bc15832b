"""Guard settings shared by every driver and both frameworks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class GuardConfig:
    """Settings shared by every driver."""

    on_nonfinite: str = "stop"          # "stop" (raise before the update) or "warn" (carry on)
    history_size: int = 200
    strict: bool = False                # guard errors raise instead of warning
    check_data: bool = True
    min_loss_scale: float = 1.0         # a GradScaler scale below this is a collapse
    max_consecutive_skips: int = 12     # ...and so is a scaler that keeps skipping
    # Skips while the scale is above this are warm-up and do not count toward max_consecutive_skips:
    # a float16 overflow at scale S only says some gradient exceeds 65504 / S, an ordinary
    # magnitude (< 0.07) above 2**20 (e.g. GradScaler(init_scale=2**40) halving down to a usable scale).
    warmup_loss_scale: float = 2.0 ** 20
    max_events: int = 50                # events kept in the report (the rest are counted)
    # After each update the parameters are re-read in K rotating slices (each ~1/K of the bytes, every
    # parameter at least every K updates). None = auto: K = 1 (all of them, every update) up to
    # 2 MiB of parameters, else ceil(bytes / 2 MiB), at most 8. Recovery mode uses 1.
    param_check_every: Optional[int] = None
    # Sync-free mode (PyTorch): no host read in a healthy step; a flagged step's update is kept out on
    # the device and the flags are read later, at the latest this many checks later (on CPU and under
    # torch.distributed exactly then; on CUDA as soon as the GPU has produced them).
    sync_free_every: int = 8

    def __post_init__(self) -> None:
        if self.on_nonfinite not in ("stop", "warn"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'warn', got {self.on_nonfinite!r}")
        if self.history_size < 1:
            raise ValueError("history_size must be >= 1")
        if isinstance(self.sync_free_every, bool) or not isinstance(self.sync_free_every, int) \
                or self.sync_free_every < 1:
            raise ValueError(f"sync_free_every must be an int >= 1, got {self.sync_free_every!r}")
        k = self.param_check_every
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"param_check_every must be None or an int >= 1, got {k!r}")
