"""The HTML report's Evidence section: the numbers that decided the cause, each with what it is, its
unit and one line of meaning; the replays that tested the cause; everything else folded away.

``EVIDENCE`` is the registry: a dotted path inside ``cause.evidence`` (``facts.sqrt_domain.zeros``)
-> label, unit, how to format it and what it means. A key the registry does not know is never
lost: the whole evidence dict is in the folded "All evidence" block below the table. The registry
holds what reaches a reader's decision; a fact that only feeds a rule stays folded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..text import listed, plural
from .html_blocks import e, kv_table, prose_html, value_html
from .values import fmt, num

# Where the history's numbers decide the cause (a divergence, not an op that met a bad input).
DYNAMICS = ("lr_too_high", "gradient_explosion", "loss_scale_collapse", "bad_input_data")

# Keys the origin section shows already (the op, its place, its inputs): left out of the raw dump.
SHOWN_IN_ORIGIN = frozenset({"op", "file", "line", "function", "dtype", "shape", "stage", "autograd_node",
                             "forward_op", "inputs", "sink", "output", "samples", "api", "module", "module_type",
                             "layer"})


@dataclass(frozen=True)
class EvidenceKey:
    path: str                 # dotted path inside cause.evidence
    label: str
    unit: str                 # what the number counts or measures ("" when it is a plain value)
    kind: str                 # count | number | factor | finite | rows | list | seconds | flag
    meaning: str              # one line; "{name}" fields are filled from the value's parent dict
    of: Optional[str] = None  # the sibling key holding the total: "2 of 56"
    categories: Tuple[str, ...] = ()  # shown only for these causes (empty: any cause)


def _k(path, label, unit, kind, meaning, of=None, categories=()):
    return EvidenceKey(path, label, unit, kind, meaning, of, tuple(categories))


EVIDENCE: Tuple[EvidenceKey, ...] = (
    # what the origin op produced
    _k("output.nan", "NaN outputs", "elements", "count", "elements of the origin op's output that are NaN (0/0, "
       "inf - inf, a domain error)"),
    _k("output.posinf", "+inf outputs", "elements", "count", "elements of the origin op's output that are +inf "
       "(x/0 with x > 0, an overflow)"),
    _k("output.neginf", "-inf outputs", "elements", "count", "elements of the origin op's output that are -inf "
       "(log(0), x/0 with x < 0)"),
    _k("facts.float64_check.finite", "origin op in float64", "", "finite", "the op re-run in float64 on the same "
       "inputs: still non-finite means the inputs are outside its domain, finite means the dtype ran out of range"),
    _k("facts.float32_check.direct_finite", "origin op in float32", "", "finite", "the low-precision op re-run in "
       "float32: finite means float16/bfloat16 ran out of range or resolution"),
    _k("facts.float32_check.chain_finite", "producers in float32", "", "finite", "the ops that made the origin's "
       "inputs, re-run in float32: finite means the precision loss happened upstream"),
    # domains
    _k("facts.zero_denominator.zeros", "zero denominators", "elements", "count", "denominator entries exactly 0: "
       "x/0 = inf, 0/0 = NaN", of="numel"),
    _k("facts.zero_denominator.zero_over_zero", "0/0", "elements", "count", "a zero numerator over a zero "
       "denominator: NaN"),
    _k("facts.zero_denominator.nonzero_over_zero", "x/0", "elements", "count", "a non-zero numerator over a zero "
       "denominator: +inf or -inf"),
    _k("facts.sqrt_domain.negatives", "negative inputs of the root", "elements", "count", "sqrt of a negative "
       "number is NaN", of="numel"),
    _k("facts.sqrt_domain.zeros", "inputs of the root at 0", "elements", "count", "the root's gradient "
       "1/(2·sqrt(x)) divides by 0 there", of="numel"),
    _k("facts.log_domain.zeros", "log inputs at 0", "elements", "count", "log(0) = -inf", of="numel"),
    _k("facts.log_domain.negatives", "negative log inputs", "elements", "count", "the log of a negative number "
       "is NaN", of="numel"),
    _k("facts.log_domain.min", "smallest log input", "", "number", "the log's smallest argument"),
    _k("facts.trig_domain.abs_gt_1", "inputs with |x| > 1", "elements", "count", "asin/acos/atanh are NaN or "
       "infinite at and beyond ±1", of="numel"),
    _k("facts.domain.inside", "inputs outside the domain", "elements", "count", "inputs where {condition}",
       of="numel"),
    _k("facts.exp_input_max", "largest exp input", "", "number", "exp(x) overflows its dtype above the threshold "
       "below"),
    _k("facts.overflow_threshold", "overflow threshold", "", "number", "log of the dtype's largest value (88.7 in "
       "float32, 11.1 in float16)"),
    _k("facts.overflow.input_max_abs", "largest input |x|", "", "number", "the largest input magnitude of an op "
       "whose output overflowed"),
    _k("facts.overflow.dtype_max", "dtype maximum", "", "number", "the largest finite value of the origin's "
       "dtype"),
    _k("facts.softmax_all_masked_rows.count", "fully masked rows", "rows", "count", "softmax rows whose inputs "
       "are all -inf: 0/0 = NaN", of="rows_total"),
    _k("key_padding_rows.count", "fully padded sequences", "rows", "count", "key_padding_mask rows that mask "
       "every key"),
    _k("facts.std_var.n", "elements per reduction", "elements", "count", "how many values each std/var reduced"),
    _k("facts.std_var.n_minus_correction", "n - correction", "", "number", "the std/var divisor: 0 or less "
       "divides by 0"),
    _k("bad_samples.batch_rows", "bad samples", "batch rows", "rows", "the batch rows whose removal made the "
       "step finite"),
    _k("bad_samples.dataset_indices", "bad samples in the dataset", "dataset rows", "rows", "the same rows as "
       "dataset indices"),
    # what the per-step check read
    _k("detected.loss", "loss at the failing step", "", "number", "the loss the per-step check read (finite: "
       "the failure was born after the loss, in the backward or the update)"),
    _k("detected.n_bad_grads", "non-finite gradients", "parameters", "count", "parameters whose gradient was "
       "non-finite"),
    # the history (divergences)
    _k("loss_growth_factor_per_step", "loss growth", "× per step", "factor", "the loss's geometric growth over "
       "its last consecutive rises", categories=DYNAMICS),
    _k("loss_growth_steps", "loss rising for", "steps", "count", "consecutive steps of that growth",
       categories=DYNAMICS),
    _k("grad_growth_factor_per_step", "gradient-norm growth", "× per step", "factor", "the gradient norm's "
       "geometric growth over its last consecutive rises", categories=DYNAMICS),
    _k("grad_growth_steps", "gradient norm rising for", "steps", "count", "consecutive steps of that growth",
       categories=DYNAMICS),
    _k("grad_jump_factor", "gradient-norm jump", "×", "factor", "the last gradient norm over the median of the "
       "steps before it", categories=DYNAMICS),
    _k("grad_norm_last", "last gradient norm", "L2 norm", "number", "the global gradient norm at the last "
       "finite step", categories=DYNAMICS),
    _k("grad_norm_median_before", "median gradient norm before", "L2 norm", "number", "the typical gradient "
       "norm of the healthy steps", categories=DYNAMICS),
    _k("lr", "learning rate", "per param group", "list", "the optimizer's learning rate at the failing step",
       categories=DYNAMICS),
    _k("estimated_stable_lr_limit", "stable learning-rate limit", "", "number", "the largest learning rate the "
       "measured amplification allows (2·lr / (amplification + 1))", categories=DYNAMICS),
    _k("lr_backoff_factor", "learning-rate cut", "×", "factor", "the factor recovery multiplies the learning "
       "rate by", categories=DYNAMICS),
    _k("history.update_ratio_last", "update-to-weight ratio", "lr·|g|/|w| per step", "number", "how far one "
       "update moves the weights, relative to their size (healthy: ~1e-3)", categories=DYNAMICS),
)


def lookup(evid: Dict[str, Any], path: str) -> Tuple[Any, Dict[str, Any]]:
    """The value at dotted ``path`` in ``evid`` and its parent dict ((None, {}) when absent)."""
    cur: Any = evid
    parent: Dict[str, Any] = {}
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None, {}
        parent, cur = cur, cur[part]
    return cur, parent


def format_value(key: EvidenceKey, v: Any, parent: Dict[str, Any]) -> Optional[str]:
    """The value as a reader reads it (escaped HTML), or None when there is nothing to show."""
    if v is None or v == [] or v == {}:
        return None
    if key.kind == "count":
        x = num(v)
        if x is None or x == 0:  # none: the row would say nothing
            return None
        total = num(parent.get(key.of)) if key.of else None
        n = int(x) if x == int(x) else x
        text = f"{fmt(n)} of {fmt(int(total))}" if total is not None and math.isfinite(total) else fmt(n)
        unit = f" {e(key.unit)}" if key.unit else ""
        return f'<span class="num">{e(text)}</span>{unit}'
    if key.kind == "finite":
        if not isinstance(v, bool):
            return None
        return '<span class="tag ok">finite</span>' if v else '<span class="tag bad">still non-finite</span>'
    if key.kind == "factor":
        x = num(v)
        if x is None:
            return None
        return f'<span class="num">×{e(fmt(x, 3))}</span>' + (
            f" {e(key.unit.lstrip('×').strip())}" if key.unit.lstrip("×").strip() else "")
    if key.kind == "rows":
        rows = v if isinstance(v, list) else [v]
        return f"{e(listed(rows))} <span class=\"muted\">({e(plural(len(rows), 'row'))})</span>"
    if key.kind == "list":
        items = v if isinstance(v, list) else [v]
        return f'<span class="num">{e(", ".join(fmt(x, 4) for x in items[:8]))}</span>' + (
            f" {e(key.unit)}" if key.unit and len(items) > 1 else "")
    x = num(v)
    if x is None:
        return e(str(v))
    bad = "" if math.isfinite(x) else " bad"
    return f'<span class="num{bad}">{e(fmt(v, 4))}</span>' + (f" {e(key.unit)}" if key.unit else "")


def deciding_rows(cause: Dict[str, Any]) -> List[Tuple[EvidenceKey, str, str]]:
    """``(key, value html, meaning)`` for every registry entry this cause's evidence has."""
    evid = cause.get("evidence") or {}
    cat = cause.get("category")
    out = []
    for key in EVIDENCE:
        if key.categories and cat not in key.categories:
            continue
        v, parent = lookup(evid, key.path)
        html = format_value(key, v, parent)
        if html is None:
            continue
        try:
            meaning = key.meaning.format(**{k: x for k, x in parent.items() if isinstance(x, (str, int, float))})
        except (KeyError, IndexError, ValueError):
            meaning = key.meaning
        out.append((key, html, meaning))
    return out


def _replay_text(r: Any) -> str:
    """``confirmed_by`` / a ``ruled_out`` record in one line: the category, the replay and its result."""
    if not isinstance(r, dict):
        return value_html(r)
    fin = r.get("finite")
    res = "finite" if fin is True else "still non-finite" if fin is False else "no result"
    head = f'<code class="category">{e(r["category"])}</code>: ' if r.get("category") else ""
    why = f' <span class="muted">{prose_html(str(r["why"]))}</span>' if r.get("why") else ""
    return (head + f"the step replayed with {prose_html(str(r.get('change') or r.get('kind') or r.get('by') or '?'))}"
            f" was <b>{e(res)}</b>" + why)


def _experiments_table(exps: Any) -> str:
    rows = [x for x in exps if isinstance(x, dict)] if isinstance(exps, list) else []
    if not rows:
        return ""
    body = []
    for x in rows:
        fin = x.get("finite")
        res = ('<span class="tag ok">finite</span>' if fin is True else
               '<span class="tag bad">non-finite</span>' if fin is False else
               f'<span class="tag warn">{e(x.get("error") and "failed" or "no result")}</span>')
        verdicts = x.get("verdicts") or {}
        v = ", ".join(f"{k} {w}" for k, w in verdicts.items()) if isinstance(verdicts, dict) else str(verdicts)
        secs = num(x.get("seconds"))
        body.append(f'<tr><td>{prose_html(str(x.get("change") or x.get("kind") or "?"))}</td><td>{res}</td>'
                    f'<td>{e(v)}</td><td class="num">{e(fmt(secs, 3) + " s" if secs is not None else "")}</td></tr>')
    return ('<h3>Replays that tested the cause</h3><div class="scroll"><table class="data experiments" '
            'id="evidence-experiments"><thead><tr><th>the failing step replayed with</th><th>result</th>'
            '<th>verdict</th><th>time</th></tr></thead><tbody>' + "".join(body) + "</tbody></table></div>")


def evidence_section(ev: Dict[str, Any]) -> str:
    """Decisive numbers (label, value with unit, meaning), the replays, then all evidence folded."""
    cause = ev.get("cause") or {}
    evid = cause.get("evidence") or {}
    head = '<section id="evidence"><h2>Evidence</h2>'
    intro = []
    if cause.get("method"):
        intro.append(("diagnosed by", e(cause.get("method"))))
    if cause.get("confirmed_by"):
        intro.append(("confirmed by", _replay_text(cause.get("confirmed_by"))))
    for r in cause.get("ruled_out") or []:
        intro.append(("ruled out", _replay_text(r)))
    rows = deciding_rows(cause)
    parts = [kv_table(intro)] if intro else []
    if rows:
        body = "".join(f'<tr data-key="{e(k.path)}"><th scope="row">{e(k.label)}</th><td class="value">{html}</td>'
                       f'<td class="meaning">{prose_html(meaning)}</td></tr>' for k, html, meaning in rows)
        parts.append('<table class="data deciding" id="evidence-deciding"><thead><tr><th>what</th><th>value</th>'
                     '<th>meaning</th></tr></thead><tbody>' + body + "</tbody></table>")
    parts.append(_experiments_table(evid.get("experiments")))
    rest = [(k, value_html(v)) for k, v in evid.items() if k not in SHOWN_IN_ORIGIN and v not in (None, {}, [])]
    if rest:
        parts.append(f'<details class="all-evidence" id="evidence-all"><summary>All evidence '
                     f'({e(plural(len(rest), "key"))}, as recorded in the JSON report)</summary>'
                     + kv_table(rest, cls="kv evidence") + "</details>")
    if not any(parts):
        return head + '<p class="muted">No evidence recorded.</p></section>'
    return head + "".join(p for p in parts if p) + "</section>"
