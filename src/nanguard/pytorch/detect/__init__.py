"""Stage 1, detect: the always-on, per-step check.

:class:`StepMonitor` is fed by a driver (the explicit :class:`~nanguard.Guard`,
or the global hooks of ``nanguard run``) and checks, once per training step:

* the batch (``data``), when the driver can see it,
* the parameters before the step (``params``) and after the update (``optimizer``),
* the loss (``forward``) and the gradients (``backward``).

Cost model (why it is cheap):

* gradients and parameters are reduced with fused ``torch._foreach_norm``
  kernels (one pass over each), per param group, on the device; on CPU, where
  ``_foreach_norm`` is one reduction per tensor, the small tensors are concatenated,
  one ``cat`` per tensor shape, into one buffer reduced by one dot (:class:`.norms._Flat`,
  at most 4 MiB a copy; the buffer is kept between steps when the list's small tensors hold
  at most 1 Mi elements in all);
* the RNG state for a replay: torch's every step; Python's and numpy's only once
  a probe step saw the step draw from them (:class:`nanguard.pytorch.rng.StepRng`);
* everything the step needs to decide is packed into one small tensor and read
  with **one host sync per step** (``Tensor.tolist()`` in :meth:`check`);
* the post-update parameter norms are computed right after the optimizer step
  but only *read* at the next step's sync, so catching an optimizer-made NaN
  costs no extra sync (it is reported one check later, with the right step);
* on models above 2 MiB or 64 tensors of parameters that post-update pass covers a
  rotating slice of about 1/K of the parameters (K up to 8, ``param_check_every``),
  so every parameter is re-read at least every K updates. A parameter the next
  forward uses is caught by the next step's loss/gradient check anyway (the
  slow path then checks every parameter exactly); only parameters the loss
  does not touch can wait up to K updates. The gradient pass is never sliced;
* hand-written updates (no optimizer, backward counting): the post-update norms
  are computed at the next check, with a small sample of the parameters and
  gradients (:mod:`.stepsize`) that gives the update's step size: three more
  numbers in the same vector, no extra sync;
* the early warning (:mod:`nanguard.core.spike`) and the history's
  post-update fields are fed from the values already read (in sync-free mode,
  when they are read): no extra sync;
* an L2 norm can overflow to ``inf`` while every element is finite (values
  around 1e20 in float32), so any non-finite norm is confirmed with an exact
  per-tensor ``isfinite`` pass. That slow path runs only when something looks
  wrong.

Other syncs: none in the healthy path. When the scaler is used, GradScaler's
own ``found_inf`` read stays where PyTorch puts it. Evaluation checks (outputs
of a watched model under ``no_grad``) sync once per evaluation forward.

The package: :mod:`.tensors` (what can be checked, sync-free finiteness flags),
:mod:`.norms` (fused L2 norms), :mod:`.slices` (the rotating post-update slices,
:func:`update_suspect`), :mod:`.names` (tensor names, exact slow-path scans),
:mod:`.consensus` (torch.distributed: one decision on every rank), :mod:`.stepsize`
(the step size of hand-written updates), :mod:`.monitor` (:class:`StepMonitor`).
"""
from __future__ import annotations

from .monitor import StepMonitor
from .norms import NormPlan, planned_norm
from .slices import plan_slices, update_suspect
from .tensors import all_finite, finite_flag, finite_markers, is_checkable, nonfinite_tensors, tensors_in

__all__ = ["NormPlan", "StepMonitor", "all_finite", "finite_flag", "finite_markers", "is_checkable",
           "nonfinite_tensors", "plan_slices", "planned_norm", "tensors_in", "update_suspect"]
