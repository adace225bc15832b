"""Rules over the step history: a run that blows up (``signals.history_signals`` and its
``dynamics``), wherever the non-finite value surfaces, and a collapsing loss scale.

Where did the size come from, in this order:

1. a batch far outside the data seen so far at the start of the excursion -> ``bad_input_data``
   (even though every value of it is finite);
2. the parameters grew over the last updates (update-to-weight ratio far above ~1e-2) ->
   ``lr_too_high``, naming what made the step too large: the learning rate for this optimizer, a
   schedule that raised it (warm-up), a momentum close to 1, Adam's ``beta2`` far below 0.999, or
   the measured step of hand-written updates; one single huge update right after a gradient jump is
   ``gradient_explosion`` instead;
3. the last update alone moved the weights by as much as their own norm or more (measured from the
   parameter norm before and after it, or ``lr * |g| / |w|`` for plain gradient steps), with a
   gradient in line with the ones before it -> ``lr_too_high``, without a long history (``--lr 1e25``,
   a warm-up's first step);
3b. steady geometric growth of the loss or gradient norm -> ``lr_too_high``;
4. a sudden gradient-norm jump after a calm run -> ``gradient_explosion``;
5. a loss excursion whose updates were >= 0.1 of the weights (the weights oscillate along the sharpest
   direction before their norm grows: the edge of stability) -> ``lr_too_high``; checked before 4.
   when the updates were >= 3% of the weights already before the excursion;
6. (last) a ruinous update earlier in the run (>= 1x the weights' norm) that the run never came back from:
   the weights are still >= 3x the norm before it and the loss >= 2x its start (or, after the update threw it
   above 1.5x, no lower than half its start: a normalised network back at its chance level) -> ``lr_too_high``, onset
   before that update. pytorch/examples vae at lr 1 (Adam): step 0 moves the weights 23 -> 574, the loss
   plateaus at 14x its start, and 16 steps later the evaluation's ``exp(0.5 * logvar)`` overflows on
   weights 157x their start: the exp is where it surfaced, the learning rate is why (it was exp_overflow,
   whose fixes, bounding the exponent, leave the ruined weights).

Each result carries the numbers, the step where the growth began (``evidence.onset_step``: recovery
rolls back to a snapshot from before it) and, for ``lr_too_high``, the learning-rate factor that
recovery applies (``evidence.lr_backoff_factor``).
"""
from __future__ import annotations

import math

from .. import fixes as X
from .. import per_optimizer as P
from .. import text as T

# The learning-rate factor (clamped to [1e-4, 0.1] for a first cut, ``lr_backoff_factor``; the
# uncapped estimate is ``lr_stable_factor``, which recovery uses when a cut already made proved too small):
# * plain gradient steps (SGD, hand-written updates): half the stability limit. On a quadratic, a step
#   size past 2/lambda amplifies the deviation along the sharpest direction by amp = |1 - lr lambda|
#   per step, and the loss (its square) by amp^2: amp = sqrt(the loss's per-step factor),
#   limit = 2 lr / (amp + 1), factor = 1 / (amp + 1); momentum b moves the limit to 2 (1 + b) / lambda
#   (``_curvature_factor``). The factor is read from the excursion's first step, the nearest to that
#   model: an accelerating excursion (a deep net, whose loss grows as a power of the weights) would give
#   a rate too small to train from its median, a decelerating one (the growth slows as units die or
#   saturate, the run's first update >= ``DECELERATING`` x the median: measured, a Flax SGD+momentum MLP at lr 10
#   grew x2.3e6 at its first step, then ~x300 per step) a rate still unstable that never overflows again
#   (lr 0.5: a finite run at loss 1128, where the first step's 0.0125 trains like the clean lr 0.01);
# * adaptive optimizers (Adam...: the step is ~lr per element whatever the gradient): aim the first
#   update of the excursion at 3% of the weights (healthy training moves them ~1e-3 per step): a run
#   whose first diverging update was R times its weights gets 0.03 / R.
TARGET_UPDATE_RATIO = 0.03
# A first step's loss factor >= 10x the excursion's median, on the run's first update (a plain gradient step
# from the initial weights, no momentum yet): a decelerating excursion (below that, a steady one whose first
# step is batch noise around its median: x12 then x9 per step). Later in a run the first step of an
# excursion is no such model (measured: an Equinox SGD+momentum run on unscaled features whose loss went
# 4.1e4, 8.2e11, 6.2e5, 1.2e17 had a first excursion step of x1.9e11 then x2.8: its 1e-4 cut stalls the run).
DECELERATING = 10.0
HEALTHY_RATIO = "healthy < 1e-2"


def note_onsets(dy: dict, ev: dict) -> None:
    """Where the growth began (and where the loss left its best level), for the rollback's bound."""
    for k in ("onset_step", "regime_onset_step"):
        if dy.get(k) is not None:
            ev[k] = dy[k]


def divergence(sig: dict, origin: dict | None, ev: dict, method: str, conf: float,
               ctx: dict | None = None, outcome: str = "until it overflowed") -> dict | None:
    """The divergence cause the history supports, or None when it shows no growth. ``outcome``: how the
    growth ended, in the summary ("until it overflowed"; an early warning: "so far")."""
    ctx = ctx or {}
    if sig.get("by_optimizer"):
        return _by_optimizer(sig["by_optimizer"], origin, ev, method, conf, ctx, outcome)
    dy = sig.get("dynamics") or {}
    where = outcome + (f" (the overflow surfaced at {T.where(origin)})" if origin else "")
    note_onsets(dy, ev)
    if T.fin(sig.get("grad_clip_ceiling")):
        ev["grad_clip_ceiling"] = sig["grad_clip_ceiling"]
    if _outlier(dy):
        return outlier_batch(dy, ev, method, conf, where)
    if _switched_up(dy, ctx):  # a new optimizer at a far higher rate, the growth right after: not a jump of its own
        return params_grew(sig, dy, ev, method, conf, where, ctx)
    if dy.get("param_growth_significant"):
        single_jump = (dy.get("param_growth_updates", 0) <= 1 or _batch_spike(dy)) and _grad_jump_at_onset(dy) >= 50
        if not single_jump:
            return params_grew(sig, dy, ev, method, conf, where, ctx)
    big = one_update_ratio(dy, ev, ctx)
    if big is not None:
        return one_update(sig, dy, ev, method, conf, where, ctx, big)
    if sig.get("geometric_growth"):
        return steady_growth(sig, dy, ev, method, conf, where, ctx)
    calm_large = T.fin(dy.get("update_ratio_calm")) and dy["update_ratio_calm"] >= CALM_TOO_LARGE
    if calm_large and (_updates_too_large(dy) or dy["update_ratio_calm"] >= CALM_RUINOUS):
        # the updates were too large before any jump (each moving the weights by a third of their norm: a
        # gradient norm that then climbs is the step size's doing, not a jump of its own)
        return params_grew(sig, dy, ev, method, conf, where, ctx)
    if sig.get("grad_jump") or _grad_jump_at_onset(dy) >= 50:
        if _ruined(dy):  # the "calm run" before the jump was a network on weights an early update ruined
            return lasting_ruin(sig, dy, ev, method, conf, where, ctx)
        return grad_jump(sig, dy, ev, method, conf, where)
    if _updates_too_large(dy):
        return params_grew(sig, dy, ev, method, conf, where, ctx)
    if _lasting_ruin(dy) or _ruined(dy):
        return lasting_ruin(sig, dy, ev, method, conf, where, ctx)
    return None


def _by_optimizer(per: dict, origin: dict | None, ev: dict, method: str, conf: float, ctx: dict,
                  outcome: str) -> dict | None:
    """Several optimizers (``per_optimizer.py``): the rules on each one's own signals and facts. The cause of
    the one whose update grew the most (``per_optimizer.growth``), named, with fixes for it alone; the
    evidence lists every optimizer whose own steps diverge (``optimizer.indices``: a recovery cuts those).
    When every one of them diverges, the cause is worded for them all (no one optimizer to name)."""
    hits = []
    for i, s in per.items():
        r = divergence(s, origin, dict(ev), method, conf, P.context_for(ctx, int(i)), outcome)
        if r is not None:
            hits.append((P.growth(s.get("dynamics") or {}), int(i), r))
    if not hits:
        return None
    _g, i, r = max(hits, key=lambda h: h[0])
    indices = sorted(h[1] for h in hits)
    others = [P.label_of(ctx, int(j)) for j in per if int(j) not in indices]
    if not others:  # each optimizer's own steps diverge: the cause of the one that grew most, for them all
        c = dict(P.context_for(ctx, i), optimizer_label=None)
        r = divergence(per[i], origin, dict(ev), method, conf, c, outcome) or r
        r["evidence"]["optimizer"] = {"indices": indices, "labels": [P.label_of(ctx, j) for j in indices]}
        r["summary"] += f" (each optimizer's own steps grew: {', '.join(P.label_of(ctx, j) for j in indices)})"
        return r
    label = P.label_of(ctx, i)
    r["evidence"]["optimizer"] = {"index": i, "indices": indices, "label": label,
                                  "lr": P.context_for(ctx, i).get("lr"), "others": others}
    r["summary"] += (f" (read from {label}'s own steps: its updates grew; {', '.join(others)} stepping in the "
                     "same run did not make this growth)")
    return r


def history_words(sig: dict) -> str:
    """What the history says when no divergence rule matched: never "no divergence" when it grew."""
    if sig.get("by_optimizer"):  # each optimizer's own history: the first that shows growth
        words = [history_words(s) for s in sig["by_optimizer"].values()]
        return next((w for w in words if w != _NONE), _NONE)
    dy = sig.get("dynamics") or {}
    tot = dy.get("loss_growth_total")
    if T.fin(tot) and tot >= 10:
        return (f"the loss grew ×{T.g(tot, 3)} from step {dy.get('loss_onset_step')}, but no parameter growth, "
                "update size, outlier batch or gradient jump in the history explains it")
    if dy.get("param_growth_significant"):
        return (f"the parameter norm grew {T.g(dy.get('param_norm_before'))} -> {T.g(dy.get('param_norm_last'))} "
                "over the last updates")
    return _NONE


_NONE = "the history shows no divergence"


# ---------------------------------------------------------------------------- 1. an outlier batch
def _outlier(dy: dict) -> bool:
    return bool(dy.get("outlier_step") is not None and (dy.get("outlier_loss_factor") or 0) >= 10)


def outlier_batch(dy: dict, ev: dict, method: str, conf: float, where: str) -> dict:
    s = dy["outlier_step"]
    ev.update(outlier_step=s, outlier_batch_max=dy.get("outlier_batch_max"),
              batch_max_before=dy.get("batch_max_before"), outlier_factor=dy.get("outlier_factor"),
              rollback_to_step=s)
    grew_s = ""
    if dy.get("param_growth_significant"):
        grew_s = (f"; its update threw the parameters (norm {T.g(dy.get('param_norm_before'))} -> "
                  f"{T.g(dy.get('param_norm_last'))})")
    again = dy.get("outlier_steps_before") or []
    if again:
        ev["outlier_steps_before"] = again
    others = (f" (not counting the batches as far out at step{'s' if len(again) > 1 else ''} "
              f"{', '.join(map(str, again))}: the same bad data again?)") if again else ""
    summ = (f"a batch far outside the data seen so far: the batch of step {s} holds values up to "
            f"{T.g(dy.get('outlier_batch_max'))}, ×{T.g(dy.get('outlier_factor'), 3)} the largest of the batches "
            f"before it ({T.g(dy.get('batch_max_before'))}){others}; every value is finite, but the loss jumped "
            f"×{T.g(dy.get('outlier_loss_factor'), 3)} at that step{grew_s}, {where}")
    fixes = [f"validate the inputs before training on them (units, scaling, export errors): e.g. reject a batch "
             f"whose x.abs().max() is far above the data's usual range ({T.g(dy.get('batch_max_before'))})",
             "normalise the features with statistics of the training data, and clip or winsorise extreme values",
             f"skip or quarantine the batch of step {s} (nanguard --recover auto rolls back to before it)"]
    return T.result("bad_input_data", summ, conf, ev, fixes, method)


# ---------------------------------------------------------------------------- 2. parameters grew
# An excursion of the loss (>= 10x) whose updates were >= 0.1 of the weights (10x the healthy ~1e-2):
# the weights oscillate along the sharpest direction (edge of stability) before their norm grows.
UPDATES_TOO_LARGE = 0.1
# Updates of >= 3% of the weights per step already in the calm phase: the step size (or an
# initialisation that makes every gradient huge) is the cause, not the gradient jump it leads to.
CALM_TOO_LARGE = 0.03
# Updates of >= 30% of the weights per step in the calm phase: the step size, whatever the loss did yet.
CALM_RUINOUS = 0.3


def _switched_up(dy: dict, ctx: dict) -> bool:
    """A new optimizer took over (a fine-tuning stage, a re-compiled ``fit``) at a learning rate >= 10x the
    previous one, and the growth began within 3 steps of it: the gradient jump that follows is that rate's
    doing (``_why_step`` names the switch)."""
    sw = ctx.get("optimizer_switch") if isinstance(ctx.get("optimizer_switch"), dict) else {}
    at, onset, lo, lr = sw.get("step"), dy.get("onset_step"), dy.get("lr_rose_from"), dy.get("lr_at_onset")
    if not (T.fin(at) and T.fin(onset) and T.fin(lo) and T.fin(lr) and lo > 0):
        return False
    return dy.get("lr_rose_from_step", at) < at <= onset <= at + 3 and lr >= 10 * lo


def _updates_too_large(dy: dict) -> bool:
    return bool((dy.get("loss_growth_total") or 0) >= 10 and T.fin(dy.get("update_ratio_excursion_max"))
                and dy["update_ratio_excursion_max"] >= UPDATES_TOO_LARGE)


def _batch_spike(dy: dict) -> bool:
    """The excursion's first loss jumped >= 1e3x over the step before while the update between them moved the
    weights by a calm fraction (<= 1e-2): no step size explains that, the batch does (an outlier target the
    input's batch_max cannot see). The weights' growth that follows (momentum carries the one huge
    gradient over several updates) is its consequence, not the learning rate's."""
    r, u = dy.get("loss_ratio_first"), dy.get("update_ratio_at_onset")
    return T.fin(r) and r >= 1e3 and T.fin(u) and u <= 1e-2


def _grad_jump_at_onset(dy: dict) -> float:
    b, last = dy.get("grad_norm_before"), dy.get("grad_norm_last")
    if T.fin(b) and T.fin(last) and b > 0:
        return last / b
    return 0.0


def _lr_ref(dy: dict, ctx: dict) -> tuple[float | None, bool]:
    """(the step size to lower, whether it was measured from hand-written updates)."""
    lr = dy.get("lr_at_onset", dy.get("lr_last"))
    if T.fin(lr) and lr > 0:
        return float(lr), False
    if T.fin(dy.get("effective_lr")):
        return float(dy["effective_lr"]), True
    lrs = [x for x in (ctx.get("lr") or []) if T.fin(x)]
    return (float(lrs[0]), False) if lrs else (None, False)


def inner_steps(ctx: dict) -> int:
    """How many updates one optimizer step may compound without a line search to bound them: LBFGS's
    ``max_iter`` inner iterations, each taken at the full lr along its direction (1 for any other
    optimizer, or with ``line_search_fn`` set)."""
    n = ctx.get("max_iter")
    if isinstance(n, int) and n > 1 and "line_search_fn" in ctx and ctx.get("line_search_fn") is None:
        return n
    return 1


def stable_factor(dy: dict, ctx: dict, measured: bool) -> float:
    """The learning-rate factor estimated to bring the step size to half its stability limit, uncapped
    (see ``TARGET_UPDATE_RATIO``; 0.1 when the history gives no estimate)."""
    opt = str(ctx.get("optimizer") or "")
    adaptive = bool(opt) and not measured and opt.lower() != "sgd"
    ratio, per = dy.get("update_ratio_at_onset"), dy.get("loss_ratio_per_step")
    if T.fin(dy.get("one_update_ratio")) and dy["one_update_ratio"] > 0 and (adaptive or not (T.fin(per) and per > 1)):
        # one update measured against the weights: the step scales with the lr (plain or adaptive), so
        # the factor that brings it to TARGET_UPDATE_RATIO is read off directly, however far it is. A plain
        # step whose loss growth was measured keeps the curvature estimate below: the update's size
        # against the weights says nothing of the curvature (weights near 0 make any step look large).
        # A step of n inner updates (LBFGS without a line search) compounds them: the weights grew by
        # (1 + r)^n for a per-update ratio r, and it is r that scales with the lr.
        r, n = float(dy["one_update_ratio"]), inner_steps(ctx)
        if n > 1:
            r = math.expm1(math.log1p(r) / n)
        return max(1e-30, min(1.0, TARGET_UPDATE_RATIO / r))
    if adaptive and T.fin(ratio) and ratio > 0:
        f = TARGET_UPDATE_RATIO / ratio
    elif not adaptive and T.fin(per) and per > 1:
        first = dy.get("loss_ratio_first")
        run_start = bool(dy.get("loss_ratio_first_at_start"))
        use_first = T.fin(first) and (1 < first < per or (run_start and first >= DECELERATING * per))
        if use_first:  # the excursion's first step is the linear regime (accelerating or decelerating after it)
            per = first
        f = _curvature_factor(math.sqrt(per), ctx, carried=not (use_first and run_start))
    else:
        f = 0.1
    return max(1e-4, min(1.0, f))


def momentum(ctx: dict) -> tuple[float, bool]:
    """(the optimizer's momentum coefficient, whether it is Nesterov's), from the context (PyTorch and Keras
    give ``momentum``; JAX its optax ``hyperparams``); (0.0, False) when it has none."""
    hp = ctx.get("hyperparams") if isinstance(ctx.get("hyperparams"), dict) else {}
    b = ctx.get("momentum", hp.get("momentum"))
    nest = bool(ctx.get("nesterov", hp.get("nesterov")))
    return (float(b), nest) if T.fin(b) and 0 < b < 1 else (0.0, False)


def _curvature_factor(amp: float, ctx: dict, carried: bool) -> float:
    """The factor that puts the step size at half its stability limit, from the per-step amplification
    ``amp`` = |1 - lr lambda| of a plain step along the sharpest direction (lr lambda = amp + 1). Heavy-ball
    momentum b raises the limit from lr lambda < 2 to < 2 (1 + b) (Nesterov's: 2 (1 + b) / (1 + 2b)); a
    growth measured once momentum carries the steps (``carried``) amplifies by ~lr lambda - (1 + b) per step,
    one measured on the run's first update (no momentum yet) by lr lambda - 1."""
    b, nest = momentum(ctx)
    lam = amp + 1.0 + (b if carried else 0.0)  # lr * lambda
    half_limit = (1.0 + b) / (1.0 + 2.0 * b) if nest else 1.0 + b
    return half_limit / lam


def backoff(dy: dict, ctx: dict, measured: bool) -> float:
    """The learning-rate factor of a first cut: the estimate, and at least 10x."""
    return min(0.1, stable_factor(dy, ctx, measured))


def _why_step(dy: dict, ctx: dict, lr: float | None, measured: bool) -> tuple[str, list[str], str | None]:
    """What made the step too large, in words; the fixes for it; why lowering the lr alone is not sound."""
    opt = str(ctx.get("optimizer") or "")
    mom = ctx.get("momentum")
    lab = ctx.get("optimizer_label")  # several optimizers: the one whose update grew (per_optimizer.py)
    of = f" of {lab}" if lab else ""
    factor = backoff(dy, ctx, measured)
    new = T.g(T.nice_below(lr * factor), 2) if lr else None
    b2 = low_beta2(ctx)
    if b2 is not None:
        why = (f"{opt}'s beta2 = {T.g(b2)} makes the second-moment estimate forget within "
               f"{T.g(1 / max(1 - b2, 1e-9), 2)} steps, so the update m / sqrt(v) is not normalised by the gradient's "
               "history: parameters whose gradient shrinks or is 0 in most batches (rarely used rows, "
               "embeddings) get steps of up to ~lr / eps")
        b1 = T.g(ctx["betas"][0])
        fixes = [X.say(pytorch=f"use betas=({b1}, 0.999) in {lab or (opt + '(...)')}, not betas=({b1}, {T.g(b2)})",
                       tensorflow=f"use beta_2=0.999 in {lab or (opt + '(...)')}, not beta_2={T.g(b2)}",
                       jax=f"use b2=0.999 in {lab or 'optax.adam(...)'}, not b2={T.g(b2)}")
                 + " (beta2 close to 1; 0.95-0.999 are the usual values)",
                 "if you meant a short memory, raise eps (e.g. 1e-6) so sqrt(v) + eps cannot vanish"]
        unsound = (f"lowering the learning rate does not fix beta2 = {T.g(b2)} (the update stays unnormalised and "
                   "grows again): change betas")
        return why, fixes, unsound
    n = inner_steps(ctx)
    if n > 1 and lr:
        why = (f"{opt or 'the optimizer'} without a line search takes each of its up to {n} inner iterations per "
               f"step at the full learning rate {T.g(lr)} along its quasi-Newton direction, so a step size past "
               "the stable one compounds within one optimizer step")
        fixes = [f"use line_search_fn='strong_wolfe' in {opt or 'the optimizer'}(...): the line search sizes each "
                 "inner step (lr=1, the default, is then the first trial step)",
                 f"or lower the learning rate from {T.g(lr)} to {X.lr_about(new)}"]
        return why, fixes, None
    if measured:
        why = (f"there is no optimizer object: the hand-written update's step size, measured from the "
               f"parameter change and the gradient, is {T.g(lr)}")
        fixes = [X.scale_step(T.g(lr), T.g(factor, 2), new),  # untested: a hand-written update is not replayed
                 "or clip the gradient norm before the update: " + X.clip_grad_norm("0.25")]
        return why, fixes, None
    if T.fin(mom) and mom >= 0.95:
        eff = lr / (1 - mom) if lr else None
        why = (f"with momentum {T.g(mom)} the effective step is lr / (1 - momentum) = {T.g(eff)}: "
               f"the learning rate {T.g(lr)} was tuned for a lower momentum")
        fixes = [f"lower the momentum to 0.9 (effective step {T.g(lr / 0.1) if lr else '?'}) or the learning rate to "
                 f"{X.lr_about(new)}"]
        return why, fixes, None
    sw = ctx.get("optimizer_switch") if isinstance(ctx.get("optimizer_switch"), dict) else {}
    if dy.get("lr_rose_from") is not None and lr and sw and T.fin(dy.get("onset_step")) \
            and dy["lr_rose_from_step"] < sw.get("step", -1) <= dy["onset_step"]:
        # not a schedule: a new optimizer took over (a fine-tuning stage, a second compile/fit)
        why = (f"at step {sw['step']} the run switched from {sw.get('from') or 'one optimizer'} (learning rate "
               f"{T.g(dy['lr_rose_from'])}) to a new optimizer, {sw.get('to') or 'another one'}, with learning rate "
               f"{T.g(lr)}, and the growth began there: that learning rate is past the stability limit of this "
               "stage (fine-tuning usually needs a lower rate than the first stage, not a higher one)")
        fixes = [X.lr_sentence(f"lower the learning rate of the new {sw.get('to') or 'optimizer'} from {T.g(lr)} to "
                               "{about} (multiply it by {factor})", new, T.g(factor, 2))]
        return why, fixes, None
    ramp = dy.get("lr_ramp_per_step")
    if dy.get("lr_rose_from") is not None and lr and T.fin(ramp):
        why = (f"the learning rate rose at every step by the same factor (x{T.g(ramp, 3)} a step: an exponential ramp "
               f"with no peak, as an LR range test makes) from {T.g(dy['lr_rose_from'])} (step "
               f"{dy['lr_rose_from_step']}) to {T.g(lr)} at step {dy.get('onset_step')}, where the growth began: "
               "that rate is past the stability limit, and the ramp only goes higher")
        fixes = [X.lr_sentence("as a range test's reading: train at about a tenth of the rate where the loss blew up, "
                               "{about}, held constant or as a schedule's peak; or stop the ramp below " + T.g(lr),
                               T.g(T.nice_below(0.1 * lr), 2))]
        return why, fixes, None
    if dy.get("lr_rose_from") is not None and lr:
        to = dy.get("lr_rose_to_step", dy.get("onset_step"))
        why = (f"the learning-rate schedule raised it from {T.g(dy['lr_rose_from'])} (step {dy['lr_rose_from_step']}) "
               f"to {T.g(lr)} " + (f"at step {to}, where the growth began" if to == dy.get("onset_step") else
                                   f"(from step {to}), and the growth began at step {dy.get('onset_step')}")
               + ": the schedule's peak is past the stability limit")
        # the growth began as the rate reached lr: the peak belongs below it (half: what recovery cuts to)
        half = T.g(T.nice_below(0.5 * lr), 2)
        fixes = [X.lr_sentence("lower the schedule's peak learning rate to {about} (the growth began at " + T.g(lr)
                               + "), or lengthen the warm-up", half),
                 "check the schedule itself: a warm-up factor must stop at 1 "
                 "(e.g. min(1, (step + 1) / warmup_steps))"]
        return why, fixes, None
    name = lab or opt or "this optimizer"
    why = f"the learning rate {T.g(lr)} is too high for {name} here" if lr else "the step size is too large"
    fixes = [f"lower the learning rate{of} from {T.g(lr)} to {X.lr_about(new)}" if lr else
             f"lower the learning rate{of} {X.lr_by_10x()} or more"]
    now = [x for x in (ctx.get("lr") or []) if T.fin(x)]
    if lr and now and max(now) >= 1.5 * lr:  # the schedule went on rising after the update that diverged
        why += (f"; the schedule is still rising (a warm-up: {T.g(lr)} at the update that diverged, {T.g(max(now))} "
                "at the failing step)")
        fixes = [X.lr_sentence(f"lower the schedule as a whole: the learning rate {T.g(lr)} -> {{about}} at this step, and "
                               "its peak no higher (multiply the base lr by {factor}, or by less if the warm-up still "
                               f"rises well past {T.g(lr)}), or lengthen the warm-up", new, T.g(factor, 2))]
    return why, fixes, None


def low_beta2(ctx: dict) -> float | None:
    """Adam's beta2 when it is far below the usual 0.95-0.999 (< 0.9: the second moment forgets within ~10
    steps), else None."""
    opt, betas = str(ctx.get("optimizer") or ""), ctx.get("betas")
    if "adam" in opt.lower() and isinstance(betas, (list, tuple)) and len(betas) == 2 and T.fin(betas[1]) \
            and betas[1] < 0.9:
        return float(betas[1])
    return None


def _unsound(ev: dict, unsound: str | None, ctx: dict) -> None:
    """Why a learning-rate cut cannot be sound, on the evidence; for a low beta2 also the fix a recovery can
    apply instead (``beta2_fix``: core/recovery/beta2.py)."""
    if not unsound:
        return
    ev["recovery_unsound"] = unsound
    b2 = low_beta2(ctx)
    if b2 is not None:
        ev["beta2_fix"] = {"beta2": b2, "to": 0.999, "betas": list(ctx.get("betas") or []),
                           **({"optimizer": ctx["optimizer_index"]} if isinstance(ctx.get("optimizer_index"), int)
                              else {})}


_STEP_SIZE = ("gradient_explosion", "lr_too_high")


def misplaced_clip(out: dict, clip: dict | None) -> dict:
    """A divergence in a script whose every gradient clip ran before backward (``clip_before_backward``: it
    found no gradient, so it clipped nothing): the updates were never clipped; moving the call is the fix."""
    if not clip or out.get("category") not in _STEP_SIZE:
        return out
    line = f"{str(clip.get('file') or '').rsplit('/', 1)[-1]}:{clip.get('line')}"
    out["summary"] += (f"; the script's clip_grad_norm_ ({line}) runs before backward: it found no gradients "
                       f"(None after zero_grad) in any of its {clip.get('calls')} call(s), so no update was clipped")
    out["evidence"]["clip_before_backward"] = clip
    out["fixes"] = [move_clip_fix(line)] + [f for f in out.get("fixes") or [] if "clip" not in str(f)]
    return out


def move_clip_fix(line: str) -> str:
    """The fix for a gradient clip that runs before backward (also ``nanguard lint``'s NGL018)."""
    return X.say(pytorch=f"move torch.nn.utils.clip_grad_norm_ ({line}) after loss.backward() and before the "
                 "update: where it is, it clips nothing", tensorflow=f"clip after the gradients are computed ({line})",
                 jax=f"clip after the gradients are computed ({line})")


def script_shape(out: dict, ctx: dict, sig: dict | None = None) -> dict:
    """A step-size diagnosis with what the run saw of the script's loop: a clip before backward, a zero_grad
    never called, a clip the script already makes, a negative learning rate (failures and early warnings alike)."""
    out = never_zeroed(misplaced_clip(out, ctx.get("clip_before_backward")), ctx.get("no_zero_grad"))
    return negative_rate(clipped_already(out, ctx.get("clip_used")), sig or {})


def clipped_already(out: dict, clip: dict | None) -> dict:
    """A step-size diagnosis in a script that clips its gradients already (``clip_used``: its clip found
    gradients): "clip the gradient norm" is no fix there; clipping bounds the gradient, not the step."""
    if not clip or out.get("category") not in _STEP_SIZE:
        return out
    line = f"{str(clip.get('file') or '').rsplit('/', 1)[-1]}:{clip.get('line')}"
    kept = [f for f in out.get("fixes") or [] if not str(f).startswith("clip the gradient norm")]
    if len(kept) == len(out.get("fixes") or []):
        return out
    out["evidence"]["clip_used"] = clip
    out["fixes"] = [f"the script already clips its gradients ({line}): clipping bounds the gradient, not the "
                    "step size, so lower the learning rate (or its peak) instead"] + kept
    return out


def negative_rate(out: dict, sig: dict) -> dict:
    """A divergence under a negative learning rate (a linear decay run past its end): every update climbs the
    loss, so lowering the rate's size cannot help; the schedule must stay >= 0."""
    lrs = [x for x in (sig.get("lr") or []) if T.fin(x)]
    if out.get("category") not in _STEP_SIZE or not lrs or min(lrs) >= 0:
        return out
    lr = min(lrs)
    out["summary"] += (f"; the learning rate is negative ({T.g(lr)}): each update climbs the loss instead of "
                       "descending it (a schedule run past its end, a decay that crosses 0)")
    out["evidence"]["negative_lr"] = lr
    fix = X.say(pytorch="keep the learning rate >= 0: end the schedule at 0 (max(0.0, ...) in a LambdaLR's "
                "lambda) or size it for the steps the run really makes",
                tensorflow="keep the learning rate >= 0: clip the schedule at 0 (tf.maximum(0.0, lr) in the "
                "schedule or the LearningRateScheduler's function) or size it for the epochs fit really runs",
                jax="keep the learning rate >= 0: end the optax schedule at 0 or size it for the steps the run "
                "really makes")
    out["fixes"] = [fix] + [f for f in out.get("fixes") or [] if "lower the" not in str(f)]
    return out


def never_zeroed(out: dict, nz: dict | None) -> dict:
    """A divergence in a script that stopped calling zero_grad (``no_zero_grad``: an optimizer stepped N times
    since the last Optimizer/Module zero_grad, if any ran): each backward adds to the last gradients, so the step grows with the
    step count whatever the learning rate (``optimizer.zero_grad`` written without its parentheses)."""
    if not nz or out.get("category") not in _STEP_SIZE + ("optimizer_numerics",):
        return out
    last = "the last " if nz.get("ever") else ""  # (one at the start: Lightning's manual optimization)
    out["summary"] += (f"; no zero_grad() call was seen in {last}{nz.get('steps')} optimizer steps: unless the script "
                       "resets the gradients itself, each backward adds to the last ones and the update grows "
                       "step by step")
    out["evidence"]["no_zero_grad"] = nz
    out["fixes"] = [zero_grad_fix()] + list(out.get("fixes") or [])
    return out


def zero_grad_fix() -> str:
    """The fix for gradients never reset (also ``nanguard lint``'s NGL017)."""
    return X.say(pytorch="call optimizer.zero_grad() every step before loss.backward() (a bare "
                 "`optimizer.zero_grad` without parentheses does nothing); for gradient accumulation, zero them "
                 "after each optimizer.step()", tensorflow="reset the accumulated gradients every step",
                 jax="reset the accumulated gradients every step")


def clip_fix(sig: dict, also: str = "add a warm-up") -> str:
    """The clipping fix: clip as a safety net; or, when the script already clips (``grad_clip_ceiling``:
    the recorded norms sit at its max_norm), say that clipping bounds the gradient, not the step."""
    c = sig.get("grad_clip_ceiling")
    if T.fin(c):
        return (f"the gradients are already clipped (their recorded norms sit at {T.g(c)}, the script's max_norm): "
                "clipping bounds the gradient, not the step size, so it cannot stop this" + (f"; {also}" if also else ""))
    return f"clip the gradient norm ({X.clip_api()}) as a safety net" + (f", and {also}" if also else "")


def params_grew(sig: dict, dy: dict, ev: dict, method: str, conf: float, where: str, ctx: dict) -> dict:
    lr, measured = _lr_ref(dy, ctx)
    ratio = dy.get("update_ratio_at_onset")
    k = dy.get("param_growth_updates")
    ev.update({kk: dy.get(kk) for kk in ("param_norm_before", "param_norm_last", "param_growth_updates",
                                         "param_growth_from_step", "update_ratio_at_onset", "update_ratio_calm",
                                         "lr_at_onset", "lr_rose_from", "effective_lr") if dy.get(kk) is not None})
    ev["lr_backoff_factor"] = backoff(dy, ctx, measured)
    ev["lr_stable_factor"] = stable_factor(dy, ctx, measured)
    if lr:  # per param group, as every other rule gives it (the hand-written update's: its measured size)
        ev["lr"] = [lr] if measured else (sig.get("lr") or [lr])
    why, fixes, unsound = _why_step(dy, ctx, lr, measured)
    _unsound(ev, unsound, ctx)
    if dy.get("param_growth_significant"):
        parts = [f"the parameter norm grew {T.g(dy.get('param_norm_before'))} -> {T.g(dy.get('param_norm_last'))} "
                 f"over {k} update{'s' if k != 1 else ''} from step {dy.get('param_growth_from_step')}"]
    else:
        parts = [f"the update/weight ratio rose to {T.g(dy.get('update_ratio_excursion_max'), 2)} from step "
                 f"{dy.get('onset_step')} ({T.g(dy.get('update_ratio_calm'), 2)} before; {HEALTHY_RATIO})"]
    if T.fin(ratio) and dy.get("param_growth_significant"):
        parts.append(f"the first diverging update changed the weights by {T.g(ratio, 2)}× their norm (update/weight "
                     f"ratio; {HEALTHY_RATIO})")
    if T.fin(dy.get("loss_before")) and T.fin(dy.get("loss_last")):
        parts.append(f"the loss went {T.g(dy['loss_before'])} -> {T.g(dy['loss_last'])}")
    calm = dy.get("update_ratio_calm")
    warm = dy.get("lr_rose_from") is not None  # a schedule raised the rate: the updates grew with it, not the init
    if T.fin(calm) and calm >= CALM_TOO_LARGE and not warm:
        parts.append(f"the updates were already {T.g(calm, 2)}× the weights before it: the gradients are large "
                     "from the first steps (an initialisation that grows through the layers, unnormalised inputs) "
                     "or the learning rate is too high for them")
        fixes.append("check the initialisation: the activations should not grow through the layers (zero-init or "
                     "scale by 1/sqrt(depth) the last layer of each residual branch, or add normalisation layers)")
    summ = f"step size too large: {'; '.join(parts)}, {where}; {why}"
    fixes += [clip_fix(sig, "" if warm else "add a warm-up")]  # (a schedule that raised the rate has one)
    return T.result("lr_too_high", summ, conf, ev, fixes, method)


# ---------------------------------------------------------------------------- 3. one update too large
# The last update moved the weights by >= their own norm (100x the healthy ~1e-2): direct evidence.
ONE_UPDATE_TOO_LARGE = 1.0
# ... unless its gradient was out of line: >= 50x the gradients before it (a jump), or, with no
# gradients before it, >= 100x the weights' own norm (a plain gradient step then scales a gradient
# that something other than the learning rate made huge).
GRAD_JUMP = 50.0
GRAD_HUGE = 100.0


def _plain_step(ctx: dict, dy: dict) -> bool:
    """The update is lr * gradient (plain SGD, or a hand-written update): ``lr * |g| / |w|`` is its size."""
    opt = str(ctx.get("optimizer") or "")
    return opt.lower() == "sgd" or (not opt and T.fin(dy.get("effective_lr")))


def one_update_ratio(dy: dict, ev: dict, ctx: dict) -> float | None:
    """The size of the last update relative to the weights when it alone is evidence that the step size
    is too large (see ``ONE_UPDATE_TOO_LARGE``), else None. Measured from the parameter norm before and
    after it (for every optimizer), or ``lr * |g| / |w|`` for plain gradient steps. A norm that overflowed
    while every weight stayed finite (the failing step read them finite: phase forward or backward, or an
    early warning) counts as growth past the dtype's range."""
    plain = _plain_step(ctx, dy)
    sizes = []
    if T.fin(dy.get("last_update_change")):
        sizes.append(float(dy["last_update_change"]))
    elif dy.get("param_norm_after_nonfinite") and (ev.get("phase") not in ("params", "optimizer", "data")
                                                   or (ev.get("phase") == "params" and update_threw_params(dy))):
        sizes.append(math.inf)
    if plain and T.fin(dy.get("last_update_ratio_est")):
        sizes.append(float(dy["last_update_ratio_est"]))
    if not sizes or max(sizes) < ONE_UPDATE_TOO_LARGE:
        return None
    finite = [x for x in sizes if math.isfinite(x) and x >= ONE_UPDATE_TOO_LARGE]
    jump = dy.get("last_grad_jump")
    if T.fin(jump) and jump >= GRAD_JUMP:
        return None  # the gradient jumped: its own rule (gradient_explosion) says where from
    if plain and jump is None and T.fin(dy.get("last_grad_to_weight")) and dy["last_grad_to_weight"] >= GRAD_HUGE:
        return None  # the gradient itself is huge from the start: not the step size's doing
    return max(finite) if finite else math.inf


def update_threw_params(dy: dict) -> bool:
    """The last applied update took the parameters from a finite norm to a non-finite one (measured right after
    it): weights found non-finite at a later check were made so by the optimizer's own update, not corrupted
    outside it. Measured: the neural-style tutorial (L-BFGS on the image, lr 100, no line search): step 0's
    inner iterations threw the image's norm 32 -> inf (an overflowing dot in L-BFGS's two-loop recursion), the
    closure's clamp_(0, 1) kept it finite for a while, and step 1's iterations made it NaN; it was
    param_corruption, "re-initialise the parameter". An update whose estimated size (``lr * |g| / |w|``) was
    small (< ``CALM_TOO_LARGE``) made them non-finite by its own numerics instead (the optimizer rules' case)."""
    est = dy.get("last_update_ratio_est")   # lr * |g| / |w|: a small one is no step size (optimizer numerics)
    return bool(dy.get("param_norm_after_nonfinite") and T.fin(dy.get("last_update_norm_before"))
                and not (T.fin(est) and est < CALM_TOO_LARGE))


def one_update(sig: dict, dy: dict, ev: dict, method: str, conf: float, where: str, ctx: dict,
               size: float) -> dict:
    """``lr_too_high`` from the last update alone (the evidence of ``one_update_ratio``)."""
    s = dy.get("last_update_step")
    dy = dict(dy)
    if isinstance(s, int):  # the update of s made the weights the next step saw: roll back to before it
        dy["onset_step"] = min(s + 1, dy.get("onset_step", s + 1))
        ev["onset_step"] = dy["onset_step"]
    if T.fin(dy.get("last_update_lr")) and dy["last_update_lr"] > 0:
        dy["lr_at_onset"] = dy["last_update_lr"]  # the rate of the update that was too large, not the rate now
    if T.fin(size):
        dy.setdefault("update_ratio_at_onset", size)
        dy["one_update_ratio"] = size
    lr, measured = _lr_ref(dy, ctx)
    ev.update({k: dy.get(k) for k in ("last_update_step", "last_update_change", "last_update_ratio_est",
                                      "last_grad_to_weight", "last_grad_jump", "loss_start", "loss_max_vs_start")
               if dy.get(k) is not None})
    ev["update_ratio_last_update"] = size if T.fin(size) else "overflow"
    ev["lr_backoff_factor"] = backoff(dy, ctx, measured)
    ev["lr_stable_factor"] = stable_factor(dy, ctx, measured)
    if lr and T.fin(size):  # the lr at which this update would have been 2x TARGET_UPDATE_RATIO of the weights
        ev["estimated_stable_lr_limit"] = 2 * ev["lr_stable_factor"] * lr
    if lr:
        ev["lr"] = [lr] if measured else (sig.get("lr") or [lr])
    why, fixes, unsound = _why_step(dy, ctx, lr, measured)
    _unsound(ev, unsound, ctx)
    if T.fin(size):
        moved = (f"the update of step {s} alone moved the weights by {T.g(size, 2)}× their norm (update/weight "
                 f"ratio; {HEALTHY_RATIO})")
    else:
        kept = ("" if ev.get("phase") in ("params", "optimizer", "data")
                else " while every weight stayed finite")   # else the later steps found them non-finite
        moved = (f"the update of step {s} alone threw the weights so far that their norm overflowed{kept} "
                 f"(update/weight ratio far above the {HEALTHY_RATIO})")
    parts = [moved + (", with a gradient in line with the ones before it" if T.fin(dy.get("last_grad_jump")) else "")]
    if T.fin(dy.get("loss_max_vs_start")) and dy["loss_max_vs_start"] >= 2:
        parts.append(f"the loss rose to ×{T.g(dy['loss_max_vs_start'], 3)} its start ({T.g(dy.get('loss_start'))})")
    summ = f"step size too large: {'; '.join(parts)}, {where}; {why}"
    warm = dy.get("lr_rose_from") is not None
    fixes += [clip_fix(sig, "" if warm else "add a warm-up")]  # (a schedule that raised the rate has one)
    return T.result("lr_too_high", summ, conf, ev, fixes, method)


# ---------------------------------------------------------------------------- 6. a lasting ruin
RUIN_NORM_KEPT = 3.0   # the weights' norm still >= 3x (PARAM_GROWTH) what it was before the ruinous update
RUIN_LOSS_KEPT = 2.0   # and the loss >= 2x the run's first: the run never came back from it;
# or the update threw the loss above RUIN_PEAK x its start (the early warning's no-baseline bound for an update
# of >= 1x the weights, core/spike.py ``update_loss``) and the loss has not
# come below RUIN_LOSS_FLOOR x its start since (the dead-network bound, core/spike.py): a network whose
# normalisation layers bring the training loss back to its chance level while the weights keep their ruined
# scale. Measured: minDiffusion's superminddpm (Adam, BatchNorm) at lr 0.2: step 0 moves the weights
# 10.3 -> 51.4 (the loss 1.26 -> 32.9 at step 1), the loss settles at 1.0-1.3 (predicting zero noise) on
# weights 18x their start, and the sampling loop of the evaluation overflows a Conv2d (was 'other'); with
# another seed the same update took the loss only 1.15 -> 1.85 (x1.6), the weights x20 at the overflow.
RUIN_PEAK = 1.5
RUIN_LOSS_FLOOR = 0.5
# Weights still >= 100x their norm before the ruinous update are ruined whatever the loss does since: a ReLU
# network thrown that far has dead units and a constant output whose loss sits at its chance level, often far
# below a start inflated by unscaled inputs, with tiny gradients (a "calm run"). Measured: a Keras MLP on
# features of scale 300, SGD lr 0.5: steps 0-3 took the weights 9.9 -> 9.3e14 (the loss 63 -> 5.8e19), the loss
# then sat at 1.10 = ln 3 with gradients ~0.1 for 9 steps, and step 13's gradient jumped x1e14 to the overflow
# (it was a gradient explosion "after a calm run", clip at 2).
# A ruinous update whose gradient jumped (or was huge from the first step) is the gradient's doing, not the step
# size's (``grad_jump`` and the GRAD_HUGE bound of ``one_update_ratio``).
RUIN_NORM_EXTREME = 1e3


def _ruined(dy: dict) -> bool:
    if not (dy.get("ruin_step") is not None and T.fin(dy.get("ruin_norm_now_vs_before"))
            and dy["ruin_norm_now_vs_before"] >= RUIN_NORM_EXTREME):
        return False
    jump, huge = dy.get("ruin_grad_jump"), dy.get("ruin_grad_to_weight")
    if T.fin(jump):
        return jump < GRAD_JUMP
    return not (T.fin(huge) and huge >= GRAD_HUGE)


def _lasting_ruin(dy: dict) -> bool:
    if not (dy.get("ruin_step") is not None and T.fin(dy.get("ruin_norm_now_vs_before"))
            and dy["ruin_norm_now_vs_before"] >= RUIN_NORM_KEPT and T.fin(dy.get("ruin_loss_now_vs_start"))):
        return False
    now, peak = dy["ruin_loss_now_vs_start"], dy.get("ruin_loss_peak_vs_start")
    return bool(now >= RUIN_LOSS_KEPT or (now >= RUIN_LOSS_FLOOR and T.fin(peak) and peak > RUIN_PEAK))


def lasting_ruin(sig: dict, dy: dict, ev: dict, method: str, conf: float, where: str, ctx: dict) -> dict:
    """``lr_too_high`` from a ruinous update the run never came back from (rule 6): ``one_update`` on it."""
    s = dy["ruin_step"]
    one = {k: v for k, v in dy.items() if not k.startswith("last_")}
    one.update(last_update_step=s, last_update_change=dy["ruin_change"], onset_step=s + 1)
    ev["ruin_norm_now_vs_before"] = dy["ruin_norm_now_vs_before"]
    peak, now = dy.get("ruin_loss_peak_vs_start"), dy.get("ruin_loss_now_vs_start")
    threw = (f" after it threw the loss to ×{T.g(peak, 3)}" if T.fin(now) and now < RUIN_LOSS_KEPT
             and T.fin(peak) and peak > 1 else "")
    loss = f", the loss ×{T.g(now, 3)} its start{threw}" if T.fin(now) else ""
    where = (f"and the run never came back from it (the weights are still ×{T.g(dy['ruin_norm_now_vs_before'], 3)} "
             f"their norm before it{loss}), {where}")
    return one_update(sig, one, ev, method, conf, where, ctx, float(dy["ruin_change"]))


# ---------------------------------------------------------------------------- 3b. steady growth
def steady_growth(sig: dict, dy: dict, ev: dict, method: str, conf: float, where: str, ctx: dict) -> dict:
    lr, measured = _lr_ref(dy, ctx)
    if lr is None:
        lrs = sig.get("lr") or []
        lr = lrs[0] if lrs and T.fin(lrs[0]) else None
    lfac, lrun = sig.get("loss_growth_factor", 1.0), sig.get("loss_growth_run", 0)
    gfac, grun = sig.get("grad_growth_factor", 1.0), sig.get("grad_growth_run", 0)
    amp = gfac if grun >= 3 else math.sqrt(max(lfac, 1.0))
    ev.update(loss_growth_factor_per_step=lfac, loss_growth_steps=lrun, grad_growth_factor_per_step=gfac,
              grad_growth_steps=grun, lr=sig.get("lr") or ([lr] if lr else []))
    fixes = []
    if lr:
        limit = 2 * lr / (amp + 1)
        ev["estimated_stable_lr_limit"] = limit
        what = "step size of the hand-written update" if measured else "learning rate"
        fixes.append(f"lower the {what} from {T.g(lr)} to at most {T.g(limit, 2)} (the stability limit estimated "
                     f"from the ×{T.g(amp, 2)}/step amplification of the gradient); e.g. {T.g(T.nice_below(limit / 2), 2)}")
    else:
        fixes.append(f"lower the learning rate {X.lr_by_10x()} or more")
    fixes += ["normalise the input features (zero mean, unit variance): unscaled features give a large "
              "curvature that makes the learning rate unstable",
              clip_fix(sig)]
    growth = f"the loss grew ×{T.g(lfac, 3)} per step for {lrun} consecutive steps" if lrun >= 3 else \
        f"the gradient norm grew ×{T.g(gfac, 3)} per step for {grun} consecutive steps"
    why = ""
    if measured:
        why = f"; the hand-written update's measured step size is {T.g(lr)}"
    elif lr:
        why = f"; lr {T.g(lr)}"
    return T.result("lr_too_high", f"learning rate too high: {growth} {where}{why}", conf, ev,
                    fixes, method)


# ---------------------------------------------------------------------------- 4. a gradient jump
RECURRENT_FIX = ("for recurrent models keep the recurrent matrix's spectral radius below 1 (orthogonal init with "
                 "gain < 1, gating, a parametrisation that bounds it) and use truncated BPTT")


def grad_jump(sig: dict, dy: dict, ev: dict, method: str, conf: float, where: str) -> dict:
    before = dy.get("grad_norm_before") if dy.get("grad_norm_before") else sig.get("grad_norm_median_before")
    last = sig.get("grad_norm_last") or dy.get("grad_norm_last")
    fac = last / before if T.fin(last) and T.fin(before) and before > 0 else sig.get("grad_jump_factor")
    p95 = sig.get("grad_norm_p95_healthy")
    ev.update(grad_norm_last=last, grad_norm_median_before=before, grad_jump_factor=fac, grad_norm_p95_healthy=p95)
    lrs = sig.get("lr") or []
    lr0 = lrs[0] if lrs and T.fin(lrs[0]) else None
    if T.fin(p95) and T.fin(before) and before > 0:  # the earlier norms may hold an earlier excursion
        p95 = min(p95, 10 * before)
    mx = T.g(T.nice(p95), 2) if T.fin(p95) else "1.0"
    fixes = [f"clip the gradient norm before the update: {X.clip_grad_norm(mx)} (the 95th percentile of the "
             "healthy gradient norms)",
             "roll back to the last finite state and skip or clip the step with the jump"]
    if lr0:
        fixes.append(f"if it recurs, lower the learning rate (e.g. {T.g(lr0)} -> {X.lr_to(T.g(lr0 / 10))})")
    fixes.append(RECURRENT_FIX)
    onset = dy.get("grad_onset_step")
    at = f" from step {onset}" if onset is not None else ""
    return T.result("gradient_explosion", f"gradient explosion: the gradient norm jumped from a median of "
                    f"{T.g(before)} to {T.g(last)} (×{T.g(fac, 3)}){at} after a calm run; it grew {where}",
                    conf, ev, fixes, method)


def loss_scale(sig: dict, ev: dict, method: str, conf: float) -> dict:
    ev.update(loss_scale_first=sig.get("loss_scale_first"), loss_scale_last=sig.get("loss_scale_last"),
              loss_scale_drops=sig.get("loss_scale_drops"), skipped_recent=sig.get("skipped_recent"))
    return T.result("loss_scale_collapse", f"the loss scale fell from {T.g(sig.get('loss_scale_first'))} to "
                    f"{T.g(sig.get('loss_scale_last'))} over {sig.get('loss_scale_drops')} consecutive reductions "
                    f"with {sig.get('skipped_recent')} of the last 8 steps skipped: gradients are non-finite at "
                    "every scale", conf, ev,
                    ["the gradients overflow even at a tiny scale, so a real non-finite source exists: run one "
                     "step in float32 (" + X.say(pytorch="autocast disabled", tensorflow="the \"float32\" dtype "
                                                 "policy", jax="x.astype(jnp.float32)") + ") to find it",
                     X.say(pytorch="use bfloat16 autocast (float32 range, no loss scaling needed) instead of float16",
                           tensorflow="use the \"mixed_bfloat16\" policy (float32's range, no loss scaling needed) "
                           "instead of mixed_float16",
                           jax="compute in bfloat16 (float32's range, no loss scaling needed) instead of float16"),
                     f"keep {X.loss_scaler()} but let its scale grow more slowly, and keep numerically sensitive ops "
                     "(softmax, log, norms, losses) in float32"], method)
