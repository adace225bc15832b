"""Integrations at the edge: PyTorch Lightning, Hugging Face Trainer, TensorBoard.

They import the backend and the core; nothing in nanguard imports them. Each
imports its framework lazily, so ``import nanguard`` never pulls in Lightning,
transformers or tensorboard:

* :mod:`nanguard.integrations.lightning` - ``NanGuardCallback`` for ``lightning.Trainer``;
* :mod:`nanguard.integrations.hf` - ``NanGuardCallback`` for ``transformers.Trainer``;
* :mod:`nanguard.integrations.tensorboard` - ``TensorBoardLogger``: step history and
  events as TensorBoard scalars and text.

torch.distributed support is part of the PyTorch backend (:mod:`nanguard.pytorch.distributed`).
See docs/INTEGRATIONS.md.
"""
