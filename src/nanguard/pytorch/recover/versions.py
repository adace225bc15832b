"""Recovery in the middle of a script's iteration keeps the version counters of the trained tensors.

A recovery acts at an optimizer step, and the script may still hold a graph built before it: a GAN's
generator output, made before the discriminator's step, is backpropagated after it. A rollback's
copies, a replay's updates and its training forwards (BatchNorm's running statistics, which the
batch-norm backward saves) bump the version counters of parameters and buffers, so that later
``backward`` raised "modified by an inplace operation" and killed the run. The values are meant to
change (that is the recovery), so the counters are set back to what the script's graphs saw.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Sequence

import torch

_set = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def trained_tensors(modules: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> List[torch.Tensor]:
    """The parameters and buffers of ``modules`` and the parameters of ``optimizers``, once each."""
    ts = [t for m in modules for t in m.parameters()] + [t for m in modules for t in m.buffers()]
    ts += [p for o in optimizers for g in getattr(o, "param_groups", ()) for p in g["params"]]
    return list({id(t): t for t in ts if isinstance(t, torch.Tensor)}.values())


@contextmanager
def versions_kept(modules: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> Iterator[None]:
    """Within: recovery may write the trained tensors in place; after: their version counters are back."""
    ts = trained_tensors(modules, optimizers) if _set is not None else []
    before = [t._version for t in ts]
    try:
        yield
    finally:
        changed = [(t, v) for t, v in zip(ts, before) if t._version != v]
        if changed:
            try:
                _set(tuple(t for t, _ in changed), tuple(v for _, v in changed))
            except Exception:  # a tensor kind without a settable counter: the script's backward may raise
                pass
