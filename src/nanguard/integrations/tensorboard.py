"""TensorBoard logging of nanguard's step history and events (``pip install 'nanguard[tensorboard]'``).

>>> guard = nanguard.Guard(model, opt, tensorboard="runs/exp1")          # doctest: +SKIP
>>> # or, zero-code:  nanguard run --tensorboard runs/exp1 train.py
>>> TensorBoardLogger.attach_to(monitor, SummaryWriter("runs/exp1"))   # doctest: +SKIP

The tags are listed in :mod:`nanguard.core.render.tensorboard`.
"""
from ..pytorch.tensorboard import TensorBoardLogger

__all__ = ["TensorBoardLogger"]
