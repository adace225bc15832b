"""Stage 2 driver: replay the failing step under op-level instrumentation.

Two ways, one recorder (:class:`nanguard.pytorch.locate.OpRecorder`):

* **Explicit API** (:class:`nanguard.Guard`): the guard has the step function,
  the batch and the RNG state of the step, and the parameters are still the
  pre-update ones when the check fails, so it re-runs the step in-process
  (:func:`replay_step`).
* **Zero-code** (``nanguard run``): the training step is inline code in the
  user's script and cannot be called again, so nanguard re-runs the script in a
  child process (:func:`rerun_localize`; the child is :mod:`nanguard.pytorch.rerun`),
  from the same initial RNG state, counting steps exactly as the first run did,
  and arms the recorder at the start of the failing step. Cost: the script's run
  time up to the failing step, plus one instrumented step. Ops before that step
  run at full speed (only the cheap hooks are on). A non-deterministic script
  may not fail the same way: the report then says "could not reproduce" and
  gives no guessed origin.
"""
from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from ..core.childrun import CHILD_TIMEOUT_S, run_child
from ..core.script import interruptible
from .detect.names import model_prefixes
from .distributed import is_origin, local_replay, rerun_env
from .locate import OpRecorder
from .rng import capture_rng, restore_rng


# --------------------------------------------------------------------------- the recorder


def make_recorder(roots, optimizers, named_params=None, named_buffers=None, data_rows=None):
    """Build an OpRecorder for the given modules/optimizers (``data_rows``: see OpRecorder)."""
    params: Dict[str, torch.Tensor] = {} if named_params is None else named_params
    buffers: Dict[str, torch.Tensor] = {} if named_buffers is None else named_buffers
    fill_names(params, buffers, roots, optimizers)
    return OpRecorder(named_params=params, named_buffers=buffers, roots=list(roots),
                      optimizers=list(optimizers), data_rows=data_rows)


def fill_names(params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor], roots, optimizers) -> None:
    """Fill name -> tensor maps in place (the recorder may hold the same dicts)."""
    roots = list(roots)
    for r, prefix in zip(roots, model_prefixes(roots, by_class=True)):
        for n, p in r.named_parameters():
            params.setdefault(prefix + n, p)
        for n, b in r.named_buffers():
            buffers.setdefault(prefix + n, b)
    known = {id(p) for p in params.values()}
    for oi, opt in enumerate(optimizers):
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                if id(p) not in known:
                    params[f"optimizer{oi}.param_groups[{gi}][{pi}]"] = p


# --------------------------------------------------------------------------- in-process (Guard)

@contextlib.contextmanager
def put_back(model: torch.nn.Module, optimizers: Sequence[Any]) -> Iterator[List[torch.Tensor]]:
    """``with put_back(model, optimizers) as params:`` a replay inside the block leaves the step as it
    found it: the parameters' gradients, the model's buffers and the RNG are put back when it ends."""
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    saved_grads = [p.grad for p in params]
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    after = capture_rng(plain=False)
    try:
        yield params
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(model.buffers(), saved_buffers):
                b.copy_(saved)
        restore_rng(after)


def replay_step(model: torch.nn.Module, optimizers: Sequence[Any], scaler: Any, batches: Sequence[Any],
                loss_fn: Callable[[Any], torch.Tensor], rng: Dict[str, Any]) -> Dict[str, Any]:
    """Re-run a failing step's forward and backward under the op recorder (params unchanged).

    ``rng`` is the RNG state the step started from. The gradients, the buffers and the RNG
    are put back afterwards, so the caller carries on as if nothing was replayed.
    """
    t0 = time.time()
    rec = make_recorder([model], optimizers)
    with put_back(model, optimizers) as params:
        for p in params:
            p.grad = None
        restore_rng(rng)
        rec.start()
        rec.set_stage("forward")
        try:
            with local_replay(model):  # DDP: no collectives in a one-rank replay
                for b in batches:
                    loss = loss_fn(b)
                    rec.mark_loss(loss)
                    rec.set_stage("backward")
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    rec.set_stage("forward")
        finally:
            rec.stop()
        res = rec.result()
    return {"method": "replay", "reproduced": bool(res.get("reproduced")), "localization": res,
            "seconds": round(time.time() - t0, 3)}


# --------------------------------------------------------------------------- nanguard run: re-run the script

# The settings of the first run (GuardConfig fields) the re-run needs to see the same detections.
CHILD_CONFIG_KEYS = ("min_loss_scale", "max_consecutive_skips", "param_check_every")


def rerun_localize(script: str, argv: List[str], step: int, rng_file: Optional[str],
                   config: Dict[str, Any], timeout: float = CHILD_TIMEOUT_S,
                   bundle: Optional[str] = None, extra_env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Re-run ``script`` in a child process and localize step ``step``. Never raises."""
    args = ["--config", json.dumps(config)] + (["--rng", rng_file] if rng_file else []) + \
        (["--bundle", bundle] if bundle else []) + ["--", script] + list(argv)
    # extra_env: torch.distributed: the children's own rendezvous (pytorch.distributed);
    # interruptible: SIGTERM/Ctrl-C now stops the child, not the report
    return run_child("nanguard.pytorch.rerun", args, step, timeout=timeout, extra_env=extra_env,
                     around=interruptible)


def rerun_localize_all(det: Any, script: str, argv: Sequence[str], rng_file: Optional[str],
                       config: Dict[str, Any], bundle: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """``nanguard run``'s localization of ``det``, on every rank at once when distributed."""
    env = rerun_env()
    if env is None:
        return None
    return rerun_localize(script, list(argv), det.step, rng_file, config,
                          bundle=bundle if is_origin(det) else None, extra_env=env)
