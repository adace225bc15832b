"""An early warning's step-size change is replayed before it is applied: the learning-rate cut or the clip
an early warning's recovery takes is one a replay from the rollback's snapshot showed to pass.

Under ``on_spike="rollback"`` (the default with ``--recover``) a warning rolls back to a snapshot from
before the excursion and applies what its diagnosis calls for (``lr_backoff``, ``clip``). Before applying
it, the backend replays (:meth:`~nanguard.core.recovery.actions.RecoveryActions.replay_kept`) the steps it
kept from the snapshot's step up to the warning's, cycled to ``REPLAY_STEPS`` steps, from the state just
rolled back to, with the candidate change: the policy's own value first, then ``FURTHER`` x it, up to
``MAX_CANDIDATES`` values. The first that passes is the one applied (a learning-rate cut that passed but moved
the loss by less than ``NEAR_STALL`` is replayed 10x larger too, within the same budget, and the larger kept
when it passes: a cut far below the limit stalls the run), and the recovery record and the
warning's fixes say so (``"lr 50 -> 0.5: 8 steps finite, loss 3.1 -> 2.2"``). "Passes" means the replay
does not show what the warning warned of (:func:`nanguard.core.experiments.tested.warning_check`): every
value finite and the loss not growing (the mean of the last losses at most 1.1x the first ones'; "lr 50 ->
5: 8 steps finite, loss 3.12 -> 12.1" has not passed). A warning of the dead rule replays a network the
excursion may already have killed: a replay whose gradient norms all stay <= 0.1x the first steps' tests
nothing (it "passes" any value), so no further value is tried and the action is said untested, with why.
When none passes, the policy's own value is applied, marked untested (``untested``: why), as it is when
no replay can run (no optimizer to replay, a GradScaler, the steps since the snapshot not kept).

The budget is work, not seconds: at most ``REPLAY_STEPS`` x ``MAX_CANDIDATES`` step replays per warning,
so the same run takes the same action whatever the machine's load. Nothing runs before a warning: a
healthy run pays nothing.

Each replay is recorded as an experiment dict (``cause.evidence.experiments``, the failure path's
shape), so :mod:`nanguard.core.experiments.tested` and :mod:`~nanguard.core.experiments.reconcile` word
the warning's fixes after them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..experiments.tested import g, passes, tested_fixes, warning_check
from .estimates import backoff_factor, clip_max_norm, cut_floor, peak_target
from .rate_spike import rate_spike

REPLAY_STEPS = 8     # steps each candidate is replayed for
MAX_CANDIDATES = 3   # the policy's value, then FURTHER x it, FURTHER^2 x it
FURTHER = 0.1
# action -> the experiment kind that tests it, and the replay's keyword for its value
KIND = {"lr_backoff": ("lr_replay", "lr_factor"), "clip": ("clip_replay", "max_norm")}


def candidates(first: float, floor: float = 0.0, n: int = MAX_CANDIDATES) -> List[float]:
    """``first``, then ``FURTHER`` x the last, ``n`` values at most, none below ``floor``."""
    out = [float(first)]
    while len(out) < n and out[-1] * FURTHER >= floor:
        out.append(out[-1] * FURTHER)
    return out


def try_values(action: str, values: Sequence[float], replay: Callable[..., Dict[str, Any]], *, from_step: int,
               to_step: int, lrs: Sequence[float] = (), grad_ref: Optional[float] = None,
               keep: Optional[Dict[str, Any]] = None) -> Tuple[Optional[float], List[Dict[str, Any]], Optional[str]]:
    """Replay each of ``values`` for ``action`` (``lr_backoff``: the factor on every learning rate;
    ``clip``: the max gradient norm) until one passes. ``replay(steps=, lr_factor= | max_norm=)`` returns
    the backend's result (``finite``, ``replays``, ``losses``, ``grad_norms``, ``period``, ``failed_at``,
    ``error``) or ``{"unavailable": why}``. ``grad_ref``: the dead rule's first-steps gradient norm (a
    replay with every gradient norm <= 0.1x it is a dead network's: nothing tested). ``keep``: the rate
    spike (:mod:`.rate_spike`) a factor of 1 is tested against (on each experiment's ``params``). Returns
    (the value that passed or None, the experiment dicts, why no replay could run)."""
    kind, key = KIND[action]
    runs: List[Dict[str, Any]] = []
    for v in values:
        res = replay(steps=REPLAY_STEPS, **{key: v})
        if res.get("unavailable"):
            return None, runs, str(res["unavailable"])
        e = _experiment(kind, key, v, res, from_step, to_step, lrs, grad_ref)
        if keep:
            e["params"]["keep"] = dict(keep)
        runs.append(e)
        if passes(e["finite"], e.get("details")):
            if key == "lr_factor":
                v = _larger_rate(v, e, replay, from_step, to_step, lrs, grad_ref, runs)
            return v, runs, None
        if e["details"].get("dead"):  # a dead network passes nothing and fails nothing: no value is testable
            return None, runs, (f"the replay from the snapshot of step {from_step} trains a dead network (gradient "
                                f"norms at most {g(e['details'].get('grad_norm_max'))}, the first steps': "
                                f"{g(grad_ref)}): it cannot tell whether a value works")
        if e["details"].get("stalled"):  # a smaller rate would not move either
            return None, runs, None
        if e["finite"] is None:  # the replay could not run: another value would not either
            return None, runs, f"its replay could not run ({res.get('error') or 'no result'})"
    return None, runs, None


NEAR_STALL = 0.01  # a passed cut whose replay lowered the loss by less than 1%: a larger rate is tried too


def _larger_rate(v: float, e: Dict[str, Any], replay: Callable[..., Dict[str, Any]], from_step: int, to_step: int,
                 lrs: Sequence[float], grad_ref: Optional[float], runs: List[Dict[str, Any]]) -> float:
    """A cut that passed but barely moved the loss (a 1e-4 cut of a summed loss's rate: 1.41e5 -> 1.40e5 in 8
    steps) may stall the run: 10x its rate is replayed too (below the rate that failed, within the candidate
    budget), and the larger one is kept when it passes as well."""
    while len(runs) < MAX_CANDIDATES:
        means = (e.get("details") or {}).get("loss_means") or []
        if len(means) != 2 or not all(isinstance(m, float) for m in means) or means[0] <= 0 \
                or (means[0] - means[1]) >= NEAR_STALL * means[0] or v / FURTHER >= 1.0:
            return v
        up = v / FURTHER
        res = replay(steps=REPLAY_STEPS, lr_factor=up)
        if res.get("unavailable"):
            return v
        e = _experiment("lr_replay", "lr_factor", up, res, from_step, to_step, lrs, grad_ref)
        runs.append(e)
        if not passes(e["finite"], e.get("details")):
            return v
        v = up
    return v


def _experiment(kind: str, key: str, v: float, res: Dict[str, Any], from_step: int, to_step: int,
                lrs: Sequence[float], grad_ref: Optional[float] = None) -> Dict[str, Any]:
    params: Dict[str, Any] = {("factor" if key == "lr_factor" else key): v, "from_step": from_step,
                              "to_step": to_step, "cycled_to": REPLAY_STEPS, "before_applying": True}
    d: Dict[str, Any] = {"steps": int(res.get("replays") or 0)}
    losses = [x for x in res.get("losses") or [] if isinstance(x, float)]
    if losses:
        d["losses"] = [losses[0], losses[-1]]
    if res.get("finite") is True:  # not what the warning warned of: the loss not growing, the network not dead
        d.update(warning_check(losses, res.get("grad_norms") or (), int(res.get("period") or 0), grad_ref,
                               stall=key == "lr_factor"))
    if res.get("failed_at") is not None:
        d["failed_at"] = res["failed_at"]
    if res.get("schedule"):  # each replayed step at its own rate x the factor (the script's schedule)
        d["schedule"] = True
    if key == "lr_factor" and lrs:
        d["lr_from"] = [float(x) for x in lrs]
        d["lr"] = [float(x) * v for x in lrs]
    from ..experiments.kinds import describe  # loaded at a warning's replay, not in a healthy run
    e: Dict[str, Any] = {"kind": kind, "change": describe(kind, params), "finite": res.get("finite"),
                         "seconds": round(float(res.get("seconds") or 0.0), 4), "replays": d["steps"],
                         "params": params, "details": d}
    if res.get("error"):
        e["error"] = res["error"]
    return e


def tested_record(runs: Sequence[Dict[str, Any]], value: Optional[float], why_none: Optional[str]) -> Dict[str, Any]:
    """What the recovery record says of the replays behind an action (``tested_by``/``untested``)."""
    texts = [t["text"] for t in tested_fixes(list(runs))]
    if value is not None:
        # the value applied first (a smaller rate may have passed before it: _larger_rate)
        chosen = [r for r in runs if value in ((r.get("params") or {}).get("factor"), (r.get("params") or {}).get("max_norm"))]
        entries = tested_fixes(chosen[:1] + [r for r in runs if r not in chosen[:1]])
        ok = entries[0]["text"] if entries else ""
        failed = [t["text"] for t in entries[1:] if not t["passed"]]
        also = [t["text"] for t in entries[1:] if t["passed"]]
        return {"tested_by": {"experiment": runs[-1]["kind"], "passed": True, "text": ok, "tried": len(runs),
                              **({"failed": failed} if failed else {}), **({"also_passed": also} if also else {})}}
    if why_none is not None:
        return {"untested": f"not tested by replay: {why_none}; the policy's value applied"}
    if not runs:
        return {"untested": "not tested by replay: no replay ran; the policy's value applied"}
    return {"untested": "no value passed a replay (" + "; ".join(texts[:MAX_CANDIDATES]) +
            "): the policy's value applied, untested", "tested_by": {"experiment": runs[-1]["kind"],
                                                                   "passed": False, "tried": len(runs)}}


def before_applying(policy: Any, action: str, cause: Dict[str, Any], actions: Any, history: Sequence[dict],
                    step: int, done: Dict[str, Any], runs: List[Dict[str, Any]]) -> Tuple[Optional[dict], Dict[str, Any]]:
    """Replay ``action``'s candidates (an early warning's, after its rollback: the state now is the
    snapshot's) and return the proof the policy's action takes its value from (``{"params": {"factor"
    | "max_norm": v}}``, or None: the policy's own value) and what to say of it on the action's record.
    Every replay is appended to ``runs``; an action no replay can test adds ``{"unavailable": kind,
    "why": ...}``."""
    if action not in KIND or "rollback" not in done:
        return None, {}
    kind = KIND[action][0]
    frm = done["rollback"]["to_step"]
    lrs = actions.learning_rates() if action == "lr_backoff" else []
    if action == "lr_backoff":
        if not lrs:
            why = "no optimizer learning rate to replay with (hand-written updates)"
            runs.append({"unavailable": kind, "why": why})
            return None, tested_record([], None, why)
        last = policy._last_cut
        repeat = last is not None and 0 < step - last <= policy.budget.window
        first = backoff_factor(policy.lr_factor, cause, lrs, repeat=repeat)
        first = peak_target(first, cause, lrs, actions.learning_rate_peaks())
        plain = 0.5 if repeat else policy.lr_factor  # the cut without the estimates
        values = candidates(first, floor=cut_floor(cause.get("evidence") or {}))
        extra = {"max_norm": policy.clip_norm} if policy.clip_norm is not None else {}
    else:
        prev = policy.clip_norm
        first = prev / 2 if prev is not None else clip_max_norm(history, quantile=policy.clip_quantile)
        values, extra, plain = candidates(first), {}, first

    def replay(**change: Any) -> Dict[str, Any]:
        return actions.replay_kept(frm, step, **{**extra, **change})

    spike = rate_spike(history, lrs, frm, step) if action == "lr_backoff" else None
    kept: List[Dict[str, Any]] = []
    if spike is not None:  # the rate now, tested first: the rollback alone undoes the spike's update
        value, kept, why = try_values(action, [1.0], replay, from_step=frm, to_step=step, lrs=lrs,
                                      grad_ref=dead_reference(cause), keep=spike)
        runs.extend(kept)
        if value is not None:
            return {"kind": kind, "params": {"factor": 1.0}, "spike": spike}, \
                {"schedule_spike": dict(spike, **tested_record(kept, value, None))}
    value, mine, why = try_values(action, values, replay, from_step=frm, to_step=step, lrs=lrs,
                                  grad_ref=dead_reference(cause))
    if value is None and why is None and mine and mine[-1]["details"].get("stalled") and plain > first:
        # the estimates' cut left a rate too small to train (an estimate made at another rate than the
        # rate now): the plain cut, then FURTHER x it
        value, more, why = try_values(action, candidates(plain, n=MAX_CANDIDATES - len(mine)), replay,
                                      from_step=frm, to_step=step, lrs=lrs, grad_ref=dead_reference(cause))
        mine += more
    runs.extend(mine)
    if why is not None:
        runs.append({"unavailable": kind, "why": why})
    said = tested_record(mine, value, why)
    if value is None:
        return None, said
    key = "factor" if action == "lr_backoff" else "max_norm"
    return {"kind": kind, "params": {key: value}}, said


def act(policy: Any, action: str, cause: Dict[str, Any], actions: Any, history: Sequence[dict], step: int,
        done: Dict[str, Any], runs: List[Dict[str, Any]]) -> None:
    """An early warning's ``action`` after its rollback: its candidates replayed (:func:`before_applying`),
    then the one that passed applied through the policy (``lr_backoff``, ``clip``). A rate spike whose
    replay at the rate now passed cuts nothing: the rollback undid the spike's update, and the record says
    so (``rollback.schedule_spike``)."""
    proof, said = before_applying(policy, action, cause, actions, history, step, done, runs)
    if proof is not None and proof.get("spike"):
        done["rollback"].update(said)
        return
    if action == "lr_backoff":
        policy._lr_backoff(cause, actions, done, step, proof)
    elif action == "clip":
        policy._clip(history, done, step, proof)
    note(done, action, said)


def failure_cut(policy: Any, event: Any, actions: Any, history: Sequence[dict], step: int, done: Dict[str, Any],
                proof: Optional[dict]) -> None:
    """A failure's ``lr_backoff`` after its rollback: when the steps rolled back hold a rate spike of the
    schedule (:mod:`.rate_spike`), the rate now is replayed first, as for an early warning (:func:`act`),
    and kept when it passes (``rollback.schedule_spike``; the event's fixes name the spike); else the
    policy's cut (``proof``: the investigation's replay that verified one)."""
    cause = event.cause if isinstance(event.cause, dict) else {}
    lrs = actions.learning_rates() if isinstance(done.get("rollback"), dict) else []
    frm = done["rollback"].get("to_step") if lrs else None
    spike = rate_spike(history, lrs, frm, step) if isinstance(frm, int) else None
    if spike is not None:
        value, kept, why = try_values("lr_backoff", [1.0], lambda **c: actions.replay_kept(frm, step, **c),
                                      from_step=frm, to_step=step, lrs=lrs, keep=spike)
        record_on_event(event, kept)
        if value is not None:
            done["rollback"]["schedule_spike"] = dict(spike, **tested_record(kept, value, None))
            return
    policy._lr_backoff(cause, actions, done, step, proof)


# the fix a warning's category calls for, tested in a plain run (no recovery: nothing is applied)
WARN_ACTION = {"lr_too_high": "lr_backoff", "gradient_explosion": "clip"}
DEFAULT_LR_FACTOR, DEFAULT_CLIP_QUANTILE = 0.1, 0.25  # RecoveryPolicy's defaults


def test_warning_fix(event: Any, history: Sequence[dict], step: int, lrs: Sequence[float],
                     replay: Callable[..., Dict[str, Any]]) -> Optional[float]:
    """A warning in a run that does not recover (``on_spike="warn"``): its fix (a learning-rate cut for
    ``lr_too_high``, a clip for ``gradient_explosion``) replayed on the warning step's own batch from the
    state now (before its update), cycled to ``REPLAY_STEPS`` steps, the candidates as a recovery would try
    them; nothing is applied, the state is put back. The replays go on the event's cause (``tested_fixes``,
    the fixes worded after them: :func:`record_on_event`). ``replay(steps=, lr_factor= | max_norm=)``: the
    backend's replay of that step. Returns the value that passed, or None."""
    cause = event.cause if isinstance(event.cause, dict) else {}
    action = WARN_ACTION.get(str(cause.get("category")))
    if action is None:
        return None
    kind = KIND[action][0]
    if action == "lr_backoff":
        if not lrs:
            record_on_event(event, [{"unavailable": kind, "why": "no optimizer learning rate to replay with"}])
            return None
        first = backoff_factor(DEFAULT_LR_FACTOR, cause, lrs)
        values = candidates(first, floor=cut_floor(cause.get("evidence") or {}))
    else:
        values = candidates(clip_max_norm(history, quantile=DEFAULT_CLIP_QUANTILE))
    value, runs, why = try_values(action, values, replay, from_step=step, to_step=step, lrs=lrs,
                                  grad_ref=dead_reference(cause))
    if why is not None:
        record_on_event(event, [{"unavailable": kind, "why": why}])
        return None
    if value is None:  # the weights at the warning already hold the excursion's updates: no verdict on the fix
        cause.setdefault("evidence", {})["warning_fix_replays"] = {
            "passed": False, "tried": [t["text"] for t in tested_fixes(runs)],
            "note": "replayed on the warning step's batch from the weights at the warning, which already hold the "
                    "excursion's updates (no snapshot from before it without --recover): none passed, which does "
                    "not rule the fix out; the fixes are untested"}
        return None
    record_on_event(event, runs)
    return value


def warning_fix_words(event: Any, on: str = "this step's batch") -> Optional[str]:
    """The words a warning's line gets for what :func:`test_warning_fix` found (``on``: what it was replayed
    on), or None when nothing was tried."""
    cause = event.cause if isinstance(event.cause, dict) else {}
    ok = next((t for t in cause.get("tested_fixes") or [] if t.get("passed")), None)
    if ok is not None:
        return f"fix tested on {on}: {ok.get('text')}"
    if (cause.get("evidence") or {}).get("warning_fix_replays"):
        return "fix untested: no value passed a replay from the weights at the warning (already moved)"
    why = ((cause.get("evidence") or {}).get("experiments_unavailable_why") or {})
    return f"fix not tested by replay: {next(iter(why.values()))}" if why else None


def dead_reference(cause: Dict[str, Any]) -> Optional[float]:
    """The first steps' gradient norm of a dead-rule warning (``evidence.warning``), else None."""
    hit = (cause.get("evidence") or {}).get("warning")
    if isinstance(hit, dict) and hit.get("rule") == "dead":
        ref = hit.get("grad_norm_start")
        return float(ref) if isinstance(ref, (int, float)) and not isinstance(ref, bool) and ref > 0 else None
    return None


def note(done: Dict[str, Any], action: str, said: Dict[str, Any]) -> None:
    """Add what the replays said to the action's record (``lr_backoff``, its ``grad_scale`` form, ``clip``)."""
    for name in (action, "grad_scale"):
        if said and isinstance(done.get(name), dict):
            done[name].update(said)
            return


def record_on_event(event: Any, runs: Sequence[Dict[str, Any]]) -> None:
    """Put the replays on the warning's cause (``evidence.experiments``, ``tested_fixes``; ``evidence.
    experiments_unavailable_why`` for a kind none could run) and word its fixes after them
    (:func:`~nanguard.core.experiments.reconcile.reconcile`)."""
    cause = event.cause if isinstance(event.cause, dict) else None
    if cause is None or not runs:
        return
    from ..experiments.reconcile import reconcile  # loaded at a warning's replay, not in a healthy run
    ev = cause.setdefault("evidence", {})
    ran = [r for r in runs if "unavailable" not in r]
    gone = {r["unavailable"]: r["why"] for r in runs if "unavailable" in r}
    if ran:
        ev["experiments"] = list(ev.get("experiments") or []) + ran
        ev.setdefault("experiments_cost", {"replays": sum(int(r.get("replays") or 0) for r in ran),
                                           "budget_steps": REPLAY_STEPS * MAX_CANDIDATES,
                                           "why": "an early warning's change, replayed before it is applied"})
        cause["tested_fixes"] = tested_fixes(ev["experiments"])
    if gone:
        ev["experiments_unavailable_why"] = dict(ev.get("experiments_unavailable_why") or {}, **gone)
    kept = next((t.get("spike") for t in cause.get("tested_fixes") or [] if t.get("passed") and t.get("spike")), None)
    if kept and isinstance(cause.get("summary"), str) and "schedule's spike" not in cause["summary"]:
        cause["summary"] += (f"; replayed from before it at the rate now ({g(kept.get('now'))}) the run trains: the "
                             f"update that diverged ran at the schedule's spike ({g(kept.get('lr'))} at step "
                             f"{(kept.get('steps') or ['?'])[0]}), not at the rate now")
    reconcile(event)
