"""The numbered fixes follow what the replays showed: ``event.fixes`` (written by the diagnosis before any
replay) reconciled with ``cause.tested_fixes`` (what the replays of the numeric fixes gave, :mod:`.tested`).

For each numeric fix (a learning rate, a gradient-norm clip, a scope run in float32, an eps or clamp at
the origin op): a structured fix (:class:`nanguard.core.diagnosis.fixes.Fix`, the text with its ``kind``,
``value``, ``scope`` and where the value is written, from the builders that wrote it; after a JSON round
trip, from ``cause.fix_specs``), never read back out of its text:

* a replay of its kind passed: the fix is printed first; when its value or scope is not the one that
  passed (the rule guessed 0.01, the replay passed 0.001; the rule named module 'out', only the whole
  model in float32 was finite) it is reworded to the one that passed, in the framework's own words
  (:mod:`nanguard.core.diagnosis.fixes`); a fix whose value the replay agrees with is left as written;
* only failed replays of its kind, at its value or scope (or a lower learning rate / clip, a wider
  float32 scope): it is marked ``(replay: still non-finite)`` (``still diverging`` when the replay stayed finite
  and the loss kept growing) and moved after the others;
* no replay of its kind tested it: it is listed in ``cause.untested_fixes`` (``{"fix_index", "kind",
  "why"}``) and the renderers say "not tested by replay".

Each tested entry that matched a fix gets ``fix_index`` (its position in the reconciled ``event.fixes``);
``cause.fix_specs`` holds each reconciled fix's fields (None for the others), so a report read back (a
child process's event) reconciles the same. The three fields are optional in ``nanguard.report/1``. :func:`reconcile` is idempotent and framework-neutral.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional

from ..diagnosis import fixes as X
from ..diagnosis import text as T
from .tested import spike_fix

# tested kind -> the fix kind it tests
TESTS = {"lr_replay": "lr", "clip_replay": "clip", "upcast_module": "dtype", "domain_guard": "eps"}
# a value within this ratio of the tested one is the value tested (else the fix is reworded to the tested one)
SAME_VALUE = 1.05
# a fix's value at most this much below a value whose replay failed counts as failed too (the rules round
# their values to 1, 2 or 5 x 10^k)
NEAR_FAILED = 1.6

def fix_kind(fix: Any) -> Optional[str]:
    """``"dtype"``, ``"clip"``, ``"lr"``, ``"eps"``: the numeric fix a replay of nanguard could test (a
    structured fix's ``kind``); None for the others (advice without a value to test: check the data, use
    betas=..., add a warm-up)."""
    return fix.kind if isinstance(fix, X.Fix) else None


def reconcile(event: Any, framework: Optional[str] = None) -> None:
    """Reconcile ``event.fixes`` with ``event.cause["tested_fixes"]`` in place (see the module docstring).
    ``framework``: the words of reworded fixes (``"pytorch"``, ``"tensorflow"``, ``"jax"``)."""
    cause = event.cause if isinstance(event.cause, dict) else None
    if cause is None:
        return
    fixes = X.restore([f for f in (event.fixes or []) if isinstance(f, str)], cause.get("fix_specs"))
    tested = [t for t in cause.get("tested_fixes") or [] if isinstance(t, dict) and t.get("kind") in TESTS]
    with X.speaking(framework or X.framework_of(None, {"backend": (event.localization or {}).get("backend")})):
        r = _Reconciler(event, cause, fixes, tested)
        r.run()
    event.fixes = r.ordered()
    r.index(cause)
    saved = X.specs(event.fixes)
    if any(saved):
        cause["fix_specs"] = saved
    else:
        cause.pop("fix_specs", None)


class _Reconciler:
    def __init__(self, event: Any, cause: Dict[str, Any], fixes: List[str], tested: List[dict]) -> None:
        self.event, self.cause, self.fixes, self.tested = event, cause, fixes, tested
        self.kinds = [fix_kind(f) for f in fixes]
        self.passed: Dict[int, dict] = {}   # fix position -> the tested entry that passed for it
        self.failed: Dict[int, dict] = {}   # fix position -> the failed entry that contradicts it
        self.matched: Dict[int, int] = {}   # id(entry) -> fix position

    # ------------------------------------------------------------------ per kind
    def run(self) -> None:
        for kind in ("lr", "clip", "dtype", "eps"):
            entries = [t for t in self.tested if TESTS[t["kind"]] == kind and not t.get("inconclusive")]
            if not entries:
                continue
            ok = next((t for t in entries if t.get("passed") and t.get("spike")), None) or \
                next((t for t in entries if t.get("passed")), None)  # a kept rate past a schedule's spike first
            bad = [t for t in entries if not t.get("passed")]
            for i in [i for i, k in enumerate(self.kinds) if k == kind]:
                getattr(self, f"_{kind}")(i, ok, bad)

    def _lr(self, i: int, ok: Optional[dict], bad: List[dict]) -> None:
        f = self.fixes[i]
        v = f.value
        if ok is not None and isinstance(ok.get("spike"), dict):  # the rate now kept: a spike in the schedule
            if id(ok) not in self.matched:  # the first lr fix says so; the others stand as written
                self.fixes[i] = X.Fix(spike_fix(ok["spike"]), "lr", _first(ok.get("lr")))
                self._pass(i, ok)
            return
        if ok is not None:
            lr = _first(ok.get("lr"))
            if lr is not None and f.spans and v is not None and not _same(v, lr):
                # the tested rate, exactly ("to about 0.01" -> "to 0.001"); a cut stated as a factor follows it
                fac = f.factor * lr / v if f.factor is not None and f.factor_spans else None
                self.fixes[i] = f.reworded(lr, T.g(lr), fac, T.g(fac, 2) if fac is not None else None)
            self._pass(i, ok)
            return
        tried = sorted(x for t in bad for x in _tried_lrs(t))
        if tried and (v is None or v >= tried[0] / NEAR_FAILED):
            self._fail(i, bad[0], f"lr {T.g(tried[0])}" if v is None or not _same(v, tried[0]) else None)

    def _clip(self, i: int, ok: Optional[dict], bad: List[dict]) -> None:
        f = self.fixes[i]
        v = f.value
        if ok is not None:
            c = ok.get("max_norm")
            if isinstance(c, (int, float)) and v is not None and f.spans and not _same(v, c):
                self.fixes[i] = f.reworded(float(c), T.g(float(c), 2))
            self._pass(i, ok)
            return
        tried = sorted(t["max_norm"] for t in bad if isinstance(t.get("max_norm"), (int, float)))
        if tried and v is not None and v >= tried[0] / NEAR_FAILED:
            self._fail(i, bad[0], f"clip at {T.g(tried[0])}" if not _same(v, tried[0]) else None)

    def _dtype(self, i: int, ok: Optional[dict], bad: List[dict]) -> None:
        scope = self.fixes[i].scope
        if ok is not None:
            p = ok.get("module") or ""
            if scope is None or not _same_scope(scope, p):
                failed = scope is not None and any(_same_scope(scope, t.get("module") or "") for t in bad)
                fix = _float32_fix(p, self.event.origin or {})
                tail = f" ({_scope_words(scope)} alone: replay still non-finite)" if failed else ""
                self.fixes[i] = fix.plus(tail) if isinstance(fix, X.Fix) else fix + tail
            self._pass(i, ok)
            return
        if scope is None:
            return
        # a scope fails when it, or a scope that contains it (the whole model: ""), was replayed non-finite
        hit = next((t for t in bad if _same_scope(scope, t.get("module") or "")
                    or _contains(t.get("module") or "", scope)), None)
        if hit is not None:
            self._fail(i, hit, None if _same_scope(scope, hit.get("module") or "")
                       else f"{_scope_words(hit.get('module') or '')} in float32")

    def _eps(self, i: int, ok: Optional[dict], bad: List[dict]) -> None:
        f = self.fixes[i]
        for t in ([ok] if ok is not None else []) + bad:
            op = t.get("op")
            # a division's guard is worded by its denominator ("divide by max(count, 1)"), not the op's name
            if op and (f"{X.fn(op)}(" in f or (op in _DIVISIONS and "the denominator" in f)
                       or (op.split(".")[-1] in _POWERS and " ** " in f)):  # a power is written x ** p
                if t.get("passed"):
                    self._pass(i, t)
                else:
                    self._fail(i, t, None)
                return

    # ------------------------------------------------------------------ outcome
    def _pass(self, i: int, t: dict) -> None:
        self.passed[i] = t
        self.matched.setdefault(id(t), i)  # fix_index: the first fix of its kind

    def _fail(self, i: int, t: dict, what: Optional[str]) -> None:
        still = "still diverging" if t.get("still_diverging") else "still non-finite"  # (finite, the loss growing)
        note = f"(replay: {what} {still})" if what else f"(replay: {still})"
        f = self.fixes[i]
        if "(replay:" not in f:
            self.fixes[i] = f.plus(f" {note}") if isinstance(f, X.Fix) else f"{f} {note}"
        self.failed[i] = t
        self.matched.setdefault(id(t), i)

    def ordered(self) -> List[str]:
        n = len(self.fixes)
        # a guard that passed (a floor under a log) stays behind a fix the rule put before it that removes the value
        # at its source (the logits form; a value positive by construction, where a clamp holds a learned scalar
        # that crossed 0 at its floor with no gradient): the guard confirms the domain error the source fix removes
        first = [i for i in range(n) if i in self.passed and not (self.kinds[i] == "eps" and any(
            _AT_SOURCE.search(str(f)) for f in self.fixes[:i]))]
        last = [i for i in range(n) if i in self.failed and i not in self.passed]
        middle = [i for i in range(n) if i not in first and i not in last]
        self.order = first + middle + last
        out = [self.fixes[i] for i in self.order]
        return [_leading(out[0])] + out[1:] if out else out

    def index(self, cause: Dict[str, Any]) -> None:
        pos = {old: new for new, old in enumerate(self.order)}
        for t in cause.get("tested_fixes") or []:
            if isinstance(t, dict):
                t.pop("fix_index", None)
                if id(t) in self.matched:
                    t["fix_index"] = pos[self.matched[id(t)]]
        warning = bool(getattr(self.event, "is_warning", False))
        untested = [{"fix_index": pos[i], "kind": k, "why": why_untested(k, cause, warning)}
                    for i, k in enumerate(self.kinds)
                    if k is not None and i not in self.passed and i not in self.failed]
        untested.sort(key=lambda u: u["fix_index"])
        if untested:
            cause["untested_fixes"] = untested
        else:
            cause.pop("untested_fixes", None)


_AT_SOURCE = re.compile(r"log_softmax|logsigmoid|log_sigmoid|from_logits|_with_logits|logsumexp|Categorical\(logits"
                        r"|positive by construction")


def _leading(f: Any) -> Any:
    """A fix written as an alternative ("or clamp ...") that a replay moved to the front loses its "or"."""
    if not str(f).startswith("or "):
        return f
    if isinstance(f, X.Fix):  # its value spans move with the text
        def back(spans: Any) -> list:
            return [(a - 3, b - 3) for a, b in spans]
        return X.Fix(str(f)[3:], f.kind, f.value, f.scope, back(f.spans), f.factor, back(f.factor_spans))
    return f[3:]


# ---------------------------------------------------------------------------- why a fix was not tested
_DIVISIONS = ("div", "true_divide", "divide", "reciprocal")
_POWERS = ("pow", "Pow", "power", "float_power")
_TESTER = {"lr": "lr_replay", "clip": "clip_replay", "dtype": "upcast_module", "eps": "domain_guard"}


def why_untested(kind: str, cause: Dict[str, Any], warning: bool = False) -> str:
    """Why no replay tested a numeric fix of ``kind``, from what the investigation recorded (``warning``: the
    event is an early warning)."""
    ev = cause.get("evidence") or {}
    tester = _TESTER[kind]
    why = (ev.get("experiments_unavailable_why") or {}).get(tester)
    if why:
        return why
    if tester in (ev.get("experiments_unavailable") or ()):
        if tester in ("lr_replay", "clip_replay"):
            return ("no snapshot from before the failing step to replay from; recovery keeps them "
                    "(--recover auto, or recover=\"auto\")")
        return "the origin's module could not be found to run it in float32"
    late = next((t for t in cause.get("tested_fixes") or [] if isinstance(t, dict) and t.get("kind") == tester
                 and t.get("inconclusive")), None)
    if late is not None:
        return ("its replay started from a snapshot taken after the growth began (weights already diverging) and "
                "stayed non-finite, which does not test it")
    if tester in ((ev.get("experiments_cost") or {}).get("not_run_for_budget") or ()):
        return "its replay did not fit in the experiments' budget"
    ran = [e for e in ev.get("experiments") or () if isinstance(e, dict) and e.get("kind") == tester]
    done = [e for e in ran if e.get("finite") is not None]
    if done:  # the replay ran, with another change than this fix's
        return f"the replay tested another change ({done[0].get('change')}), not this one"
    if ran:
        return "its replay could not run"
    if "experiments" not in ev:
        if warning:
            return "an early warning is not replayed: nothing is non-finite yet to test it against"
        return "no replay ran on this failure"
    if kind == "eps":
        return "no replay tries this value"
    return "no replay of it was planned for this cause"


# ---------------------------------------------------------------------------- values and scopes
def _first(xs: Any) -> Optional[float]:
    if isinstance(xs, (list, tuple)) and xs and isinstance(xs[0], (int, float)):
        return float(xs[0])
    return float(xs) if isinstance(xs, (int, float)) and not isinstance(xs, bool) else None


def _same(a: float, b: float) -> bool:
    return a > 0 and b > 0 and abs(math.log(a / b)) <= math.log(SAME_VALUE)


def _tried_lrs(t: dict) -> List[float]:
    """The first group's learning rates a failed lr_replay tried."""
    lr = _first(t.get("lr"))
    out = [lr] if lr is not None else []
    tried = [x for x in t.get("tried") or [] if isinstance(x, dict) and isinstance(x.get("factor"), (int, float))]
    last = tried[-1]["factor"] if tried else None
    if lr is not None and last:
        out += [lr / last * x["factor"] for x in tried]
    return out


def _same_scope(a: str, b: str) -> bool:
    """Paths of one module (a Keras layer named by its name or its path)."""
    if a == b:
        return True
    return bool(a and b) and (a.endswith("/" + b) or b.endswith("/" + a))


def _contains(outer: str, inner: str) -> bool:
    """``outer`` (a module path, ``""`` the whole model) contains ``inner``."""
    if outer == "":
        return True
    sep = "/" if "/" in outer or "/" in inner else "."
    return inner.startswith(outer + sep)


def _scope_words(path: str) -> str:
    return "the whole model" if path == "" else f"{X.layer_word()} '{path}'"


def _float32_fix(path: str, origin: Dict[str, Any]) -> str:
    """The fix that runs ``path`` in float32 (``""``: the whole model), in the framework's words."""
    if path == "":
        return X.float32_model()
    same = _same_scope(path, str(origin.get("module") or origin.get("layer") or ""))
    o = dict(origin) if same else {"module": path, "layer": path}
    return X.float32_layer(o, T.where(origin) if origin else "the origin")

