"""TensorBoard for the PyTorch backend: a log directory becomes a ``torch.utils.tensorboard.SummaryWriter``,
and under torch.distributed only rank 0 writes (see :mod:`nanguard.core.render.tensorboard`)."""
from __future__ import annotations

from typing import Any

from ..core.render.tensorboard import TensorBoardLogger as _NeutralLogger
from .distributed import is_main

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(_NeutralLogger):
    __doc__ = _NeutralLogger.__doc__

    def _open(self, log_dir: str) -> Any:
        try:  # lazy: the tensorboard package is optional (nanguard[tensorboard]) and slow to import
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("nanguard's TensorBoard logging needs the tensorboard package: "
                              "pip install 'nanguard[tensorboard]'") from e
        return SummaryWriter(log_dir=log_dir)

    @staticmethod
    def _is_main() -> bool:
        return is_main()
