"""Integrations: torch.distributed (DDP), PyTorch Lightning, Hugging Face Trainer, TensorBoard.

Each submodule imports its framework lazily, so ``import nanguard`` never pulls in
Lightning, transformers or tensorboard:

* :mod:`nanguard.integrations.distributed` - the rank-consistent decision used
  automatically by :class:`~nanguard.Guard` and ``nanguard run`` when a
  ``torch.distributed`` process group with more than one rank is initialized;
* :mod:`nanguard.integrations.lightning` - ``NanGuardCallback`` for ``lightning.Trainer``;
* :mod:`nanguard.integrations.hf` - ``NanGuardCallback`` for ``transformers.Trainer``;
* :mod:`nanguard.integrations.tensorboard` - ``TensorBoardLogger``: step history and
  events as TensorBoard scalars and text.

See docs/INTEGRATIONS.md.
"""
