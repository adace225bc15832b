"""Stage 2: find where the first non-finite value of one training step is born.

``OpRecorder`` records every ATen op of one armed training step (forward,
backward and optimizer update) with a ``TorchDispatchMode``, knows the torch
API call that issued each op (``TorchFunctionMode``), the module whose forward
is running (global module hooks) and, for backward ops, the forward op that
created the autograd node (every node created while armed is tagged with the
forward op in ``node.metadata``; anomaly-mode tracebacks are optional).

It tracks *provenance*, not just "the first NaN": every non-finite tensor
produced while armed carries a taint that points to the op that created the
non-finite values out of finite inputs (a real origin), to an intentional
non-finite constant (``masked_fill(mask, -inf)``) or to a tensor that was
already non-finite before the step (data, parameter, buffer). The reported
origin is the taint that reaches a sink: the loss, the parameter gradients, or
the parameters / optimizer state after the update. Non-finite values that are
masked away (``where``, ``masked_fill``, PyTorch's own norm backward) never
reach a sink and are ignored.

Parts, one job each:

* ``modes``: installing, removing and pausing the dispatch and function modes;
* ``naming``: names of parameters, buffers, gradients, optimizer state, modules, API calls, user lines;
* ``ops``: reading one ATen call (op name, tensor and scalar arguments, written arguments);
* ``oplog``: the per-op records of the step and the tensors kept alive for evidence;
* ``provenance``: taints, origins and the sinks they must reach;
* ``evidence``: the facts about an origin, one registered gatherer per fact (keyed like the op
  families of ``nanguard.core.diagnosis.families``); ``opcheck``: an op recomputed in float64/float32;
* ``library``: evidence about library calls (all targets ignored, fully padded attention rows);
* ``recorder``: ``OpRecorder``, which ties them; ``result``: the localisation dict it returns.

What does not depend on PyTorch is shared with the TensorFlow recorder and lives in
``nanguard.core.locate``: the taint rules, the op log's walks (producer chain, where-trap), the
failing-sink choice and the result's assembly and typed shape, the evidence registry, the user-file rule.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.exports import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from .recorder import OpRecorder

__all__ = ["OpRecorder"]

# imported on first use (a healthy run does not load this package's modules)
__getattr__, __dir__ = lazy_exports(__name__, {
    "OpRecorder": ".recorder"})
