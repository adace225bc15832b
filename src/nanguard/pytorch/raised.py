"""A script that raised inside a watched step: was a non-finite value born in the step before the raise?

A NaN born in a step's forward often makes the script raise before any check of nanguard's runs:
``binary_cross_entropy`` refuses an input outside [0, 1] (a sigmoid of NaN), ``torch.distributions``
refuses a NaN ``loc``, ``torch.multinomial`` a NaN probability, a user's ``assert not
torch.isnan(loss)`` fails. The script error alone says where it died, not where the NaN was born.

Here the partial step is replayed under the op recorder, the same recorder a failure's replay uses:

* **the sinks** are the non-finite tensors the raising code held (the locals of the frames of the
  exception's traceback): values the step recorded (:class:`~nanguard.pytorch.tape.StepTape`
  outputs) are marked where the replay makes them again; a call that raised inside a recorded call
  (a module's forward) raises again in the replay, and the replay's own traceback gives the held
  tensors. When the raising code held none, every non-finite output of the replayed calls that no later
  recorded call read is a sink (one that was read may have been masked: ``torch.where(m, log(x), 0)``).
* **a failure** is reported only when a sink is non-finite and its taint is a real origin (an op that
  made it from finite inputs, or a value non-finite before the step), not a constant the program wrote
  (``masked_fill(-inf)``): the event then has the origin op, module, line, the phase and the
  diagnosis of any failure, and the script error stays beside it (the report's status is
  ``nonfinite``: a failure not recovered wins over ``script_error``, which is kept). Otherwise the
  run is a plain ``script_error``, unchanged.

:func:`localize_raise` does it for a zero-code run (``nanguard run``, ``nanguard.watch()``) from the
step tape; :func:`replay_raise` for a :class:`~nanguard.Guard` step, whose ``loss_fn`` it calls again.
"""
from __future__ import annotations

import os
import types
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..core.events import Detection
from .distributed import is_distributed
from .replay import make_recorder, put_back
from .rng import capture_rng, restore_rng
from .stepreplay import BOUNDARY, StepReplay, _call, _modes, _refs
from .tape import set_rng, tensor_leaves

__all__ = ["held_nonfinite", "record_raise", "localize_raise", "replay_raise", "raise_detection", "accept"]

_MAX_FRAMES = 64
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the nanguard package


def _tensors_in(v: Any) -> List[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple, dict)):
        return tensor_leaves(v)
    out = []
    d = getattr(v, "__dict__", None)  # e.g. a model-output dataclass, a distribution's parameters
    if isinstance(d, dict) and not isinstance(v, (types.ModuleType, type, torch.nn.Module)):
        for x in list(d.values())[:32]:
            if isinstance(x, torch.Tensor):
                out.append(x)
    return out


def _nonfinite(t: torch.Tensor) -> bool:
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            return t.is_floating_point() and t.numel() > 0 and not bool(torch.isfinite(t).all())
    except Exception:
        return False


def held_nonfinite(tb: Optional[types.TracebackType]) -> List[torch.Tensor]:
    """The non-finite floating tensors the frames of traceback ``tb`` held (their locals), once each;
    nanguard's own frames (the replay's) left out."""
    seen, out, n = set(), [], 0
    while tb is not None and n < _MAX_FRAMES:
        n += 1
        if os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_OWN):  # nanguard's own frames
            tb = tb.tb_next
            continue
        try:
            values = list(tb.tb_frame.f_locals.values())
        except Exception:
            values = []
        for v in values:
            for t in _tensors_in(v):
                if id(t) not in seen:
                    seen.add(id(t))
                    if _nonfinite(t):
                        out.append(t)
        tb = tb.tb_next
    return out


def raise_detection(step: int, error: BaseException) -> Detection:
    """The failure of a step that raised: phase forward, what the script raised in ``detected``."""
    return Detection(step, "forward", {"script_raised": {"type": type(error).__name__,
                                                         "message": str(error)[:300]}})


def accept(out: Dict[str, Any]) -> bool:
    """A replay's localization names a non-finite value the step gave birth to (or read non-finite):
    a sink reached, its taint a real origin, not a constant the program wrote."""
    loc = out.get("localization") or {}
    if not loc.get("reproduced"):
        return False
    facts = loc.get("facts") or {}
    return not facts.get("intentional_constant")


class PartialReplay(StepReplay):
    """The recorded calls of a step that raised (a module call that raised is recorded too: the
    watcher's forward hooks are always called), replayed with the held non-finite values as the sinks;
    the call that raises again ends it (module docstring)."""

    def __init__(self, watcher: Any, held: Iterable[torch.Tensor], error_type: Optional[type] = None) -> None:
        tape = watcher.tape
        super().__init__(tape, list(watcher.monitor.roots), watcher.optimizers(), watcher._orig["backward"],
                         watcher.quiet)
        self.needed = list(range(len(self.entries)))   # everything the partial step recorded
        self.problem = self._check(tape.ext_ver)
        refs = [tape.ref_of(t) for t in held]
        self.sinks = {(r.entry, r.slot) for r in refs if r is not None}
        # outputs a later recorded call read (a where/masked_fill may have masked their non-finite values)
        self.read = {(r.entry, r.slot) for e in self.entries for r in _refs((e.args, e.kwargs))}
        self.raised_again: Optional[str] = None
        self.error_type = error_type

    def _run_entries(self, rec: Any, ext: List[torch.Tensor]) -> List[torch.Tensor]:
        env: Dict[tuple, torch.Tensor] = {}
        self._env = env
        marked = 0
        produced: List[torch.Tensor] = []
        for i in self.needed:
            e = self.entries[i]
            if e.rng is not None:
                set_rng(e.rng)
            rec.set_call_site(BOUNDARY, e.site)
            with _modes(e):
                if e.kind == "backward":
                    tensors = self._build(e.args, env, ext)
                    a, k = self._build(e.kwargs[0], env, ext), self._build(e.kwargs[1], env, ext)
                    for t in tensors:
                        rec.mark_loss(t)
                    rec.set_stage("backward")
                    _call(self._backward, (tensors, *a), k)
                    rec.set_stage("forward")
                    continue
                try:
                    res = _call(e.fn, self._build(e.args, env, ext), self._build(e.kwargs or {}, env, ext))
                except Exception as err:  # the call that raised (a module call is recorded when it raised)
                    return self._raised(rec, err, marked, produced)
            for j, t in enumerate(tensor_leaves(res)):
                env[(i, j)] = t
                if (i, j) in self.sinks:
                    rec.mark_loss(t)
                    marked += 1
                elif isinstance(t, torch.Tensor) and (i, j) not in self.read:
                    produced.append(t)
        return self._raised(rec, None, marked, produced)

    def _raised(self, rec: Any, err: Optional[BaseException], marked: int, produced: List[torch.Tensor]) -> list:
        """The replay raised ``err`` again (or ended, None): what its frames held is the sink; with no
        held value marked, every non-finite output of the replayed calls that no later call read is."""
        if err is not None:
            self.raised_again = type(err).__name__
            if self.error_type is None or type(err) is self.error_type:  # not another error (e.g. a keyword
                for t in held_nonfinite(err.__traceback__):             # argument the tape had not recorded)
                    rec.mark_loss(t)
                    marked += 1
        if not marked:
            for t in produced:
                if _nonfinite(t):
                    rec.mark_loss(t)
        return []


def record_raise(watcher: Any, error: BaseException) -> None:
    """A zero-code run's script raised ``error`` inside a watched step: a non-finite value the partial
    step gave birth to before the raise is recorded as that step's failure, with its localization
    (the guard's own error here is a warning, unless strict)."""
    if len(watcher.detections) >= watcher.config.max_events:
        return
    found = watcher._guarded(lambda: localize_raise(watcher, error))
    if found is not None:
        det, loc = found
        watcher.loc_runs[id(det)] = loc
        watcher.detections.append(det)


def localize_raise(watcher: Any, error: BaseException) -> Optional[Tuple[Detection, Dict[str, Any]]]:
    """A zero-code run's script raised ``error``: the detection of the step's non-finite value and its
    localization (``loc_run``), or None (no tape, nothing non-finite, a step already failed)."""
    tape = watcher.tape
    if tape is None or watcher.disabled or not tape.enabled or tape.incomplete is not None or is_distributed():
        return None   # (torch.distributed: the ranks would have to replay together)
    if not tape.trained:
        return None   # not inside a training step (set-up, evaluation)
    step = tape.step
    if any(d.step == step and d.phase != "eval" for d in watcher.detections):
        return None   # this step's failure was already reported
    held = held_nonfinite(error.__traceback__)
    rep = PartialReplay(watcher, held, type(error))
    if rep.problem is not None:
        return None
    rec = make_recorder(list(watcher.monitor.roots), watcher.optimizers(), data_rows=watcher.data.rows_of)
    out = rep.run(recorder=rec)
    if not accept(out):
        return None
    loc_run = {"method": "replay-tape", "reproduced": True, "localization": out["localization"],
               "seconds": out.get("seconds"), "partial_step": True}
    return raise_detection(step, error), loc_run


def replay_raise(model: torch.nn.Module, optimizers: List[Any], batches: List[Any], loss_fn: Any,
                 rng: Any, error_type: Optional[type] = None) -> Optional[Dict[str, Any]]:
    """A :class:`~nanguard.Guard` step whose ``loss_fn`` raised: call it again on each of ``batches``
    (forward only) from the step's RNG state ``rng`` under the op recorder until it raises again; the
    sinks are the non-finite tensors its frames held then. Gradients, buffers and the RNG are put
    back. None: nothing non-finite was born (or it did not raise the same way again)."""
    rec = make_recorder([model], optimizers)
    raised = False
    with put_back(model, optimizers):
        if rng is not None:
            restore_rng(rng)
        rec.start()
        rec.set_stage("forward")
        try:
            for b in batches:
                rec.mark_loss(loss_fn(b))
        except Exception as err:
            raised = error_type is None or type(err) is error_type
            if raised:
                for t in held_nonfinite(err.__traceback__):
                    rec.mark_loss(t)
        finally:
            rec.stop()
    out = {"method": "replay", "reproduced": True, "localization": rec.result(), "partial_step": True}
    return out if raised and accept(out) else None
