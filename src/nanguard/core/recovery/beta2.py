"""``raise_beta2``: Adam's second-moment decay raised to 0.999 when the diagnosis names a beta2 far below it
as what made the step too large, tested by replay before it is applied.

With ``betas=(0.9, 0.1)`` (beta2 read as "1 - decay") the second-moment estimate forgets within a step, so
the update m / sqrt(v) is not normalised by the gradient's history: a parameter whose gradient is 0 in most
batches (a rarely used embedding row) gets steps that grow ~2.85x per step until sqrt(v) < eps. No learning
rate fixes that (the scenario ``adam_low_beta2_station_counts``: lr 1e-4 and 1e-5 still blow up, 1e-6 does
not learn), so the diagnosis says a learning-rate cut is unsound (``evidence.recovery_unsound``) and gives
``evidence.beta2_fix`` (the beta2 now, the one to use, the optimizer's history index when the run has
several). With that evidence, and a backend that can set betas
(:meth:`~nanguard.core.recovery.actions.RecoveryActions.can_raise_beta2`), the policy takes ``raise_beta2``
in ``lr_backoff``'s place (:func:`plan`): after the rollback to before the growth, the kept steps are
replayed from the snapshot with beta2 raised (``REPLAY_STEPS`` steps, the lr cut's replay,
:mod:`.tried`), and the value is applied with what the replay showed (``tested_by``, or ``untested`` and
why). Nothing runs in a healthy run.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..experiments.tested import g, passes, warning_check
from .tried import REPLAY_STEPS

ACTION = "raise_beta2"
TARGET = 0.999  # PyTorch's, Keras' and optax's default beta2


def beta2_fix(cause: Any) -> Optional[Dict[str, Any]]:
    """The diagnosis' ``evidence.beta2_fix`` when it is usable: ``{"beta2", "to", "optimizer"?}``."""
    ev = (cause.get("evidence") or {}) if isinstance(cause, dict) else {}
    fix = ev.get("beta2_fix")
    if not isinstance(fix, dict):
        return None
    to = fix.get("to")
    if not (isinstance(to, (int, float)) and not isinstance(to, bool) and 0 < to < 1):
        return None
    return fix


def plan(cause: Any, acts: Sequence[str], allowed: Sequence[str], actions: Any,
         unsound: Optional[str]) -> Tuple[List[str], Optional[str]]:
    """``(actions, why no recovery is sound)``: with ``raise_beta2`` in ``lr_backoff``'s place and no
    ``unsound`` when the diagnosis points at beta2 and this backend can set it (a rollback first when allowed:
    the weights the low beta2 threw are not trained on); else ``acts`` and ``unsound`` as they are."""
    if beta2_fix(cause) is None or ACTION not in allowed or not actions.can_raise_beta2():
        return list(acts), unsound
    out = [ACTION if a == "lr_backoff" else a for a in acts]
    if ACTION not in out:
        out.append(ACTION)
    if "rollback" in allowed and "rollback" not in out:
        out.insert(0, "rollback")
    return out, None


def apply(cause: Any, actions: Any, step: int, done: Dict[str, Any]) -> bool:
    """Replay the kept steps from the rollback's snapshot with beta2 raised, then raise it (the record in
    ``done["raise_beta2"]``, with ``tested_by`` or ``untested``). False when the backend could not."""
    fix = beta2_fix(cause) or {}
    to, which = float(fix.get("to", TARGET)), fix.get("optimizer")
    frm = (done.get("rollback") or {}).get("to_step")
    said: Dict[str, Any]
    if isinstance(frm, int):
        res = actions.replay_beta2(frm, step, steps=REPLAY_STEPS, beta2=to, optimizer=which)
        said = _tested(res, fix, to, frm, step)
    else:
        said = {"untested": "not tested by replay: no rollback, so no snapshot to replay the kept steps from"}
    rec = actions.raise_beta2(to, which)
    if rec is None:
        return False
    rec.update(said)
    done[ACTION] = rec
    return True


def _tested(res: Dict[str, Any], fix: Dict[str, Any], to: float, frm: int, step: int) -> Dict[str, Any]:
    if res.get("unavailable"):
        return {"untested": f"not tested by replay: {res['unavailable']}"}
    losses = [x for x in res.get("losses") or [] if isinstance(x, float)]
    details: Dict[str, Any] = {"steps": int(res.get("replays") or 0)}
    if res.get("finite") is True:
        details.update(warning_check(losses, res.get("grad_norms") or (), int(res.get("period") or 0)))
    ok = passes(res.get("finite"), details)
    text = f"beta2 {g(fix.get('beta2'))} -> {g(to)}: {details['steps']} steps " + (
        "finite" if res.get("finite") is True else f"non-finite at step {res.get('failed_at')}"
        if res.get("finite") is False else f"not run ({res.get('error') or 'no result'})")
    if len(losses) >= 2:
        text += f", loss {g(losses[0])} -> {g(losses[-1])}"
    rec = {"experiment": "beta2_replay", "passed": ok, "text": text, "from_step": frm, "to_step": step}
    return {"tested_by": rec} if ok else {"tested_by": rec, "untested": f"the replay did not pass ({text}): "
                                          "applied all the same, as the diagnosis' fix (no learning rate fixes it)"}
