"""Recovery uses the proof: an action that changes how training runs is applied only when a
counterfactual replay showed that it makes the failing step finite.

The experiments (``nanguard.core.experiments``) leave their outcome in the event's
``cause.evidence.experiments`` (plain dicts). This module reads them for the policy:

* ``upcast`` needs a finite ``upcast_module`` replay (and upcasts the module that replay used,
  which may be a parent of the origin's), ``lr_backoff`` a finite ``lr_replay``, ``clip`` a finite
  ``clip_replay``; an action without its proof is left out (the step is skipped instead, and the
  record says why);
* a finite ``drop_samples`` replay adds ``drop_samples``: the step is re-run without the offending
  rows and its update applied, instead of skipping the whole batch;
* ``skip_step`` and ``rollback`` change nothing about how training runs and need no proof.

When no experiment ran (no replayable step: ``nanguard run`` without a step tape, or experiments
off) the table's actions are used as before and the record says they were not verified. The same
for one action whose experiment this step cannot run at all (``evidence.experiments_unavailable``:
``nanguard run``'s step replay has no snapshot to replay the steps before from, so ``lr_backoff`` and
``clip`` are applied unverified there, and the notes say so).

A failure confined to a few samples of the batch (a verified ``drop_samples``, or an origin whose
non-finite rows are a strict subset of its rows) is a *per-sample* failure: like bad input data,
it counts against the bad-data budget, which is larger than the general one.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..diagnosis.confidence import EXACT
from ..experiments.tested import passes

# action -> the experiment kind whose finite outcome verifies it
PROOF_KIND = {"upcast": "upcast_module", "lr_backoff": "lr_replay", "clip": "clip_replay",
              "drop_samples": "drop_samples"}
# categories a few samples can trigger on their own (as nanguard.core.experiments.kinds.PER_SAMPLE)
PER_SAMPLE = EXACT | {"bad_input_data", "exp_overflow"}
VERIFIED = "verified by replay before applying"


def experiments(cause: Dict[str, Any]) -> Optional[List[dict]]:
    """The experiments run on this failure, or None when none could run."""
    ev = cause.get("evidence") or {}
    exps = ev.get("experiments")
    return list(exps) if isinstance(exps, list) and (exps or "experiments_cost" in ev) else None


def proof(cause: Dict[str, Any], action: str) -> Optional[dict]:
    """The finite experiment that verifies ``action``, if any."""
    kind = PROOF_KIND.get(action)
    for e in experiments(cause) or []:
        if e.get("kind") == kind and passes(e.get("finite"), e.get("details")):
            return e
    return None


def refuted(cause: Dict[str, Any], action: str) -> bool:
    """An experiment of ``action``'s kind ran and the step stayed non-finite (from a snapshot after the
    growth began, ``params.after_onset``, that is no verdict: :func:`inconclusive`)."""
    kind = PROOF_KIND.get(action)
    return any(e.get("kind") == kind and e.get("finite") is False and not _late(e) for e in experiments(cause) or [])


def inconclusive(cause: Dict[str, Any], action: str) -> bool:
    """Every replay of ``action``'s kind started from weights already diverging and stayed non-finite: the
    rollback's own state was not tested."""
    kind = PROOF_KIND.get(action)
    runs = [e for e in experiments(cause) or [] if e.get("kind") == kind and e.get("finite") is not None]
    return bool(runs) and all(e.get("finite") is False and _late(e) for e in runs)


def _late(e: dict) -> bool:
    return bool((e.get("params") or {}).get("after_onset"))


def verified_plan(cause: Dict[str, Any], acts: Sequence[str], allowed: Sequence[str],
                  phase: str) -> Tuple[List[str], Dict[str, dict], List[str]]:
    """The actions to take (proven ones only, when experiments ran), their proofs, and notes on the
    ones left out."""
    if experiments(cause) is None:
        return list(acts), {}, []
    out: List[str] = []
    proofs: Dict[str, dict] = {}
    notes: List[str] = []
    unavailable = set((cause.get("evidence") or {}).get("experiments_unavailable") or ())
    for a in acts:
        if a not in PROOF_KIND:
            out.append(a)
            continue
        e = proof(cause, a)
        if e is not None:
            out.append(a)
            proofs[a] = e
        elif PROOF_KIND[a] in unavailable and not refuted(cause, a):
            out.append(a)
            notes.append(f"{a} applied unverified: this step cannot be replayed with it ({PROOF_KIND[a]} needs "
                         + ("a snapshot before the step)" if a in ("lr_backoff", "clip") else "the origin's module)"))
        elif inconclusive(cause, a):
            out.append(a)
            notes.append(f"{a} applied unverified: its replay ({PROOF_KIND[a]}) started from a snapshot taken after "
                         "the growth began, whose weights were already diverging")
        else:
            notes.append(f"{a} not applied: no replay showed that it makes the failing step finite")
    drop = proof(cause, "drop_samples")
    rows = ((drop or {}).get("details") or {}).get("rows")
    if drop is not None and rows and "drop_samples" in allowed and phase in ("data", "forward", "backward") \
            and not any(a in out for a in ("rollback", "upcast", "lr_backoff", "clip")):
        out.append("drop_samples")
        proofs["drop_samples"] = drop
    return out, proofs, notes


def per_sample(event: Any) -> bool:
    """The failure sits in a few samples of the batch (see the module docstring)."""
    cause = event.cause if isinstance(event.cause, dict) else {}
    if proof(cause, "drop_samples") is not None:
        return True
    if cause.get("category") not in PER_SAMPLE:
        return False
    o = event.origin or {}
    # (rows of a tensor that are no batch rows: a PINN's collocation points, a few of them at a pole)
    rows = [r for r in (o.get("samples") or o.get("tensor_rows") or []) if isinstance(r, int)]
    shape = o.get("shape") or []
    return bool(rows) and bool(shape) and isinstance(shape[0], int) and len(rows) < min(shape[0], 10) \
        and len(rows) <= max(1, shape[0] // 4)


def proof_record(e: dict) -> Dict[str, Any]:
    """What the recovery record says about the replay that verified an action."""
    return {"experiment": e.get("kind"), "change": e.get("change"), "finite": True, "seconds": e.get("seconds")}
