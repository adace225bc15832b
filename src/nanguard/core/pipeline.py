"""Glue for one failure: detection + localization + diagnosis -> a report :class:`Event`.

Both drivers (the explicit Guard and ``nanguard run``) go through
:func:`build_event`, so a failure is explained the same way whichever way it
was caught.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Dict, Optional, Sequence

from .events import PHASES, Detection, Event

# The cheap check's phase is a fact for these; the replay refines the others
# (e.g. a NaN batch that the user's own preprocessing made in this step is a
# forward-pass origin, not bad data).
_FIXED_PHASES = ("params", "optimizer", "eval")

ORIGIN_KEYS = ("op", "module", "file", "line", "function", "dtype")


def build_event(det: Detection, loc_run: Optional[Dict[str, Any]], history: Sequence[dict],
                context: Optional[Dict[str, Any]] = None) -> Event:
    """Turn a detection (+ the replay's result, if any) into a reported event. Never raises."""
    loc = (loc_run or {}).get("localization")
    reproduced = bool((loc_run or {}).get("reproduced")) and bool(loc)
    phase = det.phase
    if reproduced:
        written = written_in_step(det, loc)
        if written is not loc:
            loc, phase = written, written["phase"]
    if reproduced and phase not in _FIXED_PHASES and loc.get("phase") in PHASES:
        phase = loc["phase"]
        if det.phase == "backward" and phase == "forward" and _finite_number((det.detected or {}).get("loss")):
            # the run's own loss was finite (a compiled step fused log(softmax) stably): its op-by-op replay
            # made the value in the forward, but the run met it first in the backward
            phase = "backward"
    elif reproduced and det.phase == "optimizer" and loc.get("phase") == "params" \
            and (loc.get("preexisting") or {}).get("kind") == "param":
        # The cheap check only saw parameters non-finite after an update; the replay found them
        # non-finite before the step (written between updates, e.g. an in-place no-grad edit):
        # the update merely carried them along.
        phase = "params"
    localization = _describe_localization(det, loc_run, reproduced)
    # not reproduced, but the (eager) replay of a compiled TensorFlow step saw a non-finite value that a later op
    # dropped: the likely origin (a PyTorch replay runs the step's own kernels: nothing to read from it there)
    masked = loc.get("masked_origin") if not reproduced and isinstance(loc, dict) and \
        loc.get("backend") == "tensorflow" else None
    from . import diagnosis  # loaded at the first failure, not at start-up
    try:
        cause = diagnosis.diagnose(loc if reproduced or masked else None, list(history), phase=phase,
                                   context=dict(context or {}, detected=det.detected or {}))
    except Exception as e:  # diagnosis is best effort; the detection stands on its own
        warnings.warn(f"nanguard: diagnosis failed: {type(e).__name__}: {e}", RuntimeWarning)
        cause = {"category": "other", "summary": f"non-finite value in phase {phase} at step {det.step}",
                 "confidence": 0.2, "evidence": {}, "fixes": []}
    fixes = list(cause.pop("fixes", []) or [])
    method = cause.pop("method", None)
    if method and not localization.get("method"):
        localization["method"] = method
    cause.setdefault("evidence", {})
    cause["evidence"].setdefault("detected", det.detected)
    origin = _origin(loc) if reproduced else None
    if masked and (cause.get("evidence") or {}).get("masked_in_replay"):
        origin = masked.get("origin")
        localization["method"] = (f"replayed step {det.step} under op-level instrumentation (eager): it ended "
                                  "finite, but an op made a non-finite value there that a later op dropped; the "
                                  "compiled step that failed kept it, so that op is named (not reproduced exactly)")
    if (loc_run or {}).get("bundle"):
        localization["bundle"] = loc_run["bundle"]
    return Event(step=det.step, phase=phase, origin=origin, cause=cause, fixes=fixes,
                 detected=det.detected, localization=localization, rank=getattr(det, "rank", None))


def written_in_step(det: Detection, loc: Dict[str, Any]) -> Dict[str, Any]:
    """A parameter the replay found non-finite with the op that wrote it seen in the step itself, when the run
    met the failure in the forward or backward (its parameters were finite as the step began): the write is
    the origin (a data-dependent init in the first forward: ``s.data = -log(x.std(0))`` on a constant
    column), not a corruption from before the step. Else ``loc`` unchanged."""
    pre = loc.get("preexisting") or {}
    wb = pre.get("written_by") or {}
    # the run's check may first see the parameter at the update (phase params): a write inside a module's
    # forward (not the script's setup, which runs outside any module) was still made by the step
    in_step = det.phase in ("forward", "backward") or (det.phase == "params" and bool(wb.get("module")))
    # a buffer the script's own code computed (a diffusion schedule's sqrt in __init__, outside any module's
    # forward): no update wrote it, so the op that did is where its values were born, whenever it ran
    made = pre.get("kind") == "buffer" and not wb.get("module") and bool(wb.get("facts"))
    if pre.get("kind") not in ("param", "buffer") or not (in_step or made) \
            or wb.get("stage") not in ("forward", "backward") or not wb.get("op") or not wb.get("line"):
        return loc
    origin = {k: wb.get(k) for k in ("op", "api", "module", "file", "line", "function", "stage", "output")}
    origin.update(dtype=(pre.get("stats") or {}).get("dtype"), kind="op", written_into=pre.get("name"))
    out = {k: v for k, v in loc.items() if k != "preexisting"}
    out.update(origin=origin, facts=dict(wb.get("facts") or {}), phase=wb["stage"])
    return out


def _origin(loc: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    o = loc.get("origin")
    if not o:
        pre = loc.get("preexisting")
        if pre:
            out = {"op": None, "module": None, "file": None, "line": None, "function": None,
                   "dtype": (pre.get("stats") or {}).get("dtype"), "tensor": pre.get("name"),
                   "kind": pre.get("kind"), "samples": pre.get("samples"),
                   "source_rows": pre.get("source_rows")}
            if pre.get("module_type"):  # a layer's own tensor: the layer is where it lives
                fu = pre.get("first_use") or {}
                out.update(module=fu.get("module"), layer=fu.get("layer"), module_type=pre["module_type"])
            return out
        return None
    out = {k: o.get(k) for k in ORIGIN_KEYS}
    for k, v in o.items():
        if k not in out and v is not None:
            out[k] = v
    return out


_VERBS = {"rerun": "re-ran the script to step {step}",
          "replay-tape": "replayed step {step} in-process from the step tape (no re-run of the script)",
          "replay-eval": "replayed the failing evaluation call in-process"}


def _describe_localization(det: Detection, loc_run: Optional[Dict[str, Any]], reproduced: bool) -> Dict[str, Any]:
    if loc_run is None:
        return {"method": None, "reproduced": None, "note": "no replay was run"}
    how = loc_run.get("method", "replay")
    d: Dict[str, Any] = {"method_kind": how, "reproduced": reproduced,
                         "seconds": loc_run.get("seconds")}
    if loc_run.get("fallback_from"):  # the in-process replay could not be used: why
        d["fallback_from"] = loc_run["fallback_from"]
    if reproduced:
        verb = _VERBS.get(how, "replayed step {step}").format(step=det.step)
        d["method"] = f"{verb} under op-level instrumentation (forward, backward and optimizer ops), reproduced"
        if loc_run.get("partial_step"):  # the script raised inside the step (pytorch/raised.py)
            d["partial_step"] = True
            d["method"] = (f"{verb} up to the call that raised, under op-level instrumentation: a non-finite value "
                           f"was born before the script raised")
        if (loc_run.get("fallback_from") or {}).get("reason"):
            d["method"] += f"; the in-process replay was not used: {loc_run['fallback_from']['reason']}"
    elif loc_run.get("interrupted"):  # a signal cut the localization short: nothing to conclude from it
        d["method"] = (f"localization of step {det.step} was interrupted by {loc_run['interrupted']} before it "
                       f"finished, so no origin is claimed")
        d.update(reproduced=None, interrupted=loc_run["interrupted"])
    else:
        why = loc_run.get("reason") or loc_run.get("error") or "no non-finite value appeared"
        cause = loc_run.get("unrepeatable") or "this points to nondeterminism or a hardware/transient fault"
        d["method"] = (f"tried to replay step {det.step} under op-level instrumentation: could not reproduce "
                       f"({why}); {cause}, so no origin is claimed")
        if loc_run.get("unrepeatable"):
            d["unrepeatable"] = loc_run["unrepeatable"]
        d["reason"] = why
    return d


def recurrence_event(det: Detection, first: Event, history: Sequence[dict],
                     context: Optional[Dict[str, Any]] = None, first_phase: Optional[str] = None) -> Event:
    """A later failure: same phase as the first one -> same diagnosis (not re-localized); else diagnose anew.
    ``first_phase``: the first one's detector phase, which its replay may have refined (bad rows found in
    the batch: 'forward' -> 'data'); an unreplayed later failure is compared like with like (an actor-critic's
    critic update after its actor's, on the same episode's NaN reward: both 'forward' at the check)."""
    seen = ""
    if first_phase is not None and det.phase == first_phase != first.phase and det.phase != "params":
        seen = f" (both '{first_phase}' at the check, which its replay refined to '{first.phase}')"
        det = dataclasses.replace(det, phase=first.phase)
    if det.phase == "optimizer" and first.phase == "params" and _same_params(det, first):
        # The first failure was shown (by its replay) to be parameters corrupted outside the update;
        # the same parameters non-finite after a later update is that corruption again.
        det = dataclasses.replace(det, phase="params")
    if det.phase == first.phase:
        cause = dict(first.cause)
        cause["confidence"] = round(float(cause.get("confidence") or 0) * 0.8, 3)
        cause["evidence"] = {"same_as_step": first.step, "detected": det.detected}
        return Event(step=det.step, phase=det.phase, origin=first.origin, cause=cause, fixes=list(first.fixes),
                     detected=det.detected, rank=getattr(det, "rank", None), recurrence_of=first.step, count=1,
                     localization={"method": f"not replayed: same phase as the failure at step {first.step}{seen}, "
                                             f"assumed to be its recurrence", "reproduced": None})
    return build_event(det, None, history, context)


def consequence_event(det: Detection, first: Event) -> Event:
    """A later failure that follows from the first one (warn mode let its non-finite values through):
    a recurrence of the first event, not a new cause."""
    cause = {"category": (first.cause or {}).get("category", "other"),
             "summary": (f"a consequence of the failure at step {first.step}: its non-finite values stayed in "
                         f"the run (on non-finite: warn, or updates that ran before the stop could act: the later "
                         f"updates of one compiled call) and reached the {det.phase} of this step"),
             "confidence": round(float((first.cause or {}).get("confidence") or 0) * 0.9, 3),
             "evidence": {"same_as_step": first.step, "detected": det.detected}}
    return Event(step=det.step, phase=det.phase, origin=first.origin, cause=cause, fixes=list(first.fixes),
                 detected=det.detected, rank=getattr(det, "rank", None), recurrence_of=first.step, count=1,
                 localization={"method": f"not replayed: a consequence of the failure at step {first.step}",
                               "reproduced": None})


def same_cause(a: Event, b: Event) -> bool:
    """The same diagnosis: category, origin op and line (or the same pre-existing tensor)."""
    oa, ob = a.origin or {}, b.origin or {}
    keys = ("op", "file", "line", "tensor")
    return ((a.cause or {}).get("category") == (b.cause or {}).get("category")
            and all(oa.get(k) == ob.get(k) for k in keys))


def as_recurrence(ev: Event, first: Event) -> Event:
    """``ev`` (diagnosed on its own) has the same cause as ``first``: mark it as its recurrence."""
    ev.recurrence_of, ev.count = first.step, 1
    ev.cause = dict(ev.cause or {})
    ev.cause.setdefault("evidence", {})["same_as_step"] = first.step
    return ev


def fold_recurrences(events: Sequence[Event]) -> list:
    """Merge runs of recurrences of the same event with the same phase into one (counted) record."""
    out: list = []
    for ev in events:
        prev = out[-1] if out else None
        if (prev is not None and ev.recurrence_of is not None and ev.recovery is None and prev.recovery is None
                and prev.recurrence_of == ev.recurrence_of and prev.phase == ev.phase):
            prev.count = (prev.count or 1) + (ev.count or 1)
            prev.last_step = ev.last_step if ev.last_step is not None else ev.step
            continue
        out.append(ev)
    return out


def _same_params(det: Detection, first: Event) -> bool:
    names = set((det.detected or {}).get("nonfinite_params_after_update") or [])
    fd = first.detected or {}
    before = set(fd.get("nonfinite_params_after_update") or []) | set(fd.get("nonfinite_params") or [])
    tensor = (first.origin or {}).get("tensor")
    if tensor:
        before.add(tensor)
    return bool(names) and names <= before


def _finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
