"""The numbered fixes follow what the replays showed: ``event.fixes`` (written by the diagnosis before any
replay) reconciled with ``cause.tested_fixes`` (what the replays of the numeric fixes gave, :mod:`.tested`).

For each numeric fix (a learning rate, a gradient-norm clip, a scope run in float32, an eps or clamp at
the origin op: :func:`fix_kind`):

* a replay of its kind passed: the fix is printed first; when its value or scope is not the one that
  passed (the rule guessed 0.01, the replay passed 0.001; the rule named module 'out', only the whole
  model in float32 was finite) it is reworded to the one that passed, in the framework's own words
  (:mod:`nanguard.core.diagnosis.fixes`); a fix whose value the replay agrees with is left as written;
* only failed replays of its kind, at its value or scope (or a lower learning rate / clip, a wider
  float32 scope): it is marked ``(replay: still non-finite)`` and moved after the others;
* no replay of its kind tested it: it is listed in ``cause.untested_fixes`` (``{"fix_index", "kind",
  "why"}``) and the renderers say "not tested by replay".

Each tested entry that matched a fix gets ``fix_index`` (its position in the reconciled ``event.fixes``).
Both fields are optional in ``nanguard.report/1``. :func:`reconcile` is idempotent and framework-neutral.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional

from ..diagnosis import fixes as X
from ..diagnosis import text as T

STILL = "(replay: still non-finite)"
# tested kind -> the fix kind it tests
TESTS = {"lr_replay": "lr", "clip_replay": "clip", "upcast_module": "dtype", "domain_guard": "eps"}
# a value within this ratio of the tested one is the value tested (else the fix is reworded to the tested one)
SAME_VALUE = 1.05
# a fix's value at most this much below a value whose replay failed counts as failed too (the rules round
# their values to 1, 2 or 5 x 10^k)
NEAR_FAILED = 1.6

_NUM = r"(\d+(?:\.\d+)?(?:e[-+]?\d+)?)"
_SCOPE = re.compile(r"^run (?:module|layer) '([^']*)'.*\bin float32\b")
_OP_SCOPE = re.compile(r"^compute the op at .* in float32")
_WHOLE = "run the whole model in float32"
_CLIP = re.compile(r"(max_norm=|global_clipnorm=|clipnorm=|clip_by_global_norm\()" + _NUM)
_LR_WORDS = ("learning rate", "learning_rate", "step size", "lr=", " lr ")
# the value a learning-rate fix proposes, most specific wording first ("the momentum to 0.9 ... or the
# learning rate to about 0.01": the learning rate's)
_LR_VALUES = (re.compile(r"to about\s+" + _NUM), re.compile(r"->\s*(?:about\s+)?" + _NUM), re.compile(r"\bto\s+" + _NUM))
_FACTOR = re.compile(r"(multiply the base lr by |scale the (?:hand-written update's )?step by )" + _NUM)
# an eps or a clamp with its value: x.clamp(min=1e-12), tf.maximum(x, 1e-12), clip_by_value(x, lo, hi),
# Adam(..., eps=1e-4), epsilon=1e-7, log(p + 1e-8)
_EPS = re.compile(r"(?:clamp\((?:min\s*=\s*)?|clamp_min\(|maximum\([^,()]*,\s*|clip_by_value\([^,()]*,\s*|"
                  r"jnp\.clip\([^,()]*,\s*|\beps\s*=\s*|epsilon\s*=\s*)-?" + _NUM + r"|\+\s*\d(?:\.\d+)?e-\d+")


def fix_kind(fix: str) -> Optional[str]:
    """``"dtype"``, ``"clip"``, ``"lr"``, ``"eps"``: the numeric fix a replay of nanguard could test; None
    for the others (advice without a value to test: check the data, use betas=..., add a warm-up)."""
    f = fix.strip()
    if _SCOPE.match(f) or _OP_SCOPE.match(f) or f.startswith(_WHOLE):
        return "dtype"
    if _CLIP.search(f):
        return "clip"
    low = f.lower()
    if any(w in low for w in _LR_WORDS) and (_lr_match(f) or _FACTOR.search(f) or "by 10x" in low):
        return "lr"
    if _EPS.search(f):
        return "eps"
    return None


def reconcile(event: Any, framework: Optional[str] = None) -> None:
    """Reconcile ``event.fixes`` with ``event.cause["tested_fixes"]`` in place (see the module docstring).
    ``framework``: the words of reworded fixes (``"pytorch"``, ``"tensorflow"``, ``"jax"``)."""
    cause = event.cause if isinstance(event.cause, dict) else None
    if cause is None:
        return
    fixes = [f for f in (event.fixes or []) if isinstance(f, str)]
    tested = [t for t in cause.get("tested_fixes") or [] if isinstance(t, dict) and t.get("kind") in TESTS]
    with X.speaking(framework or X.framework_of(None, {"backend": (event.localization or {}).get("backend")})):
        r = _Reconciler(event, cause, fixes, tested)
        r.run()
    event.fixes = r.ordered()
    r.index(cause)


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
            ok = next((t for t in entries if t.get("passed")), None)
            bad = [t for t in entries if not t.get("passed")]
            for i in [i for i, k in enumerate(self.kinds) if k == kind]:
                getattr(self, f"_{kind}")(i, ok, bad)

    def _lr(self, i: int, ok: Optional[dict], bad: List[dict]) -> None:
        f = self.fixes[i]
        v = _lr_value(f)
        if ok is not None:
            lr = _first(ok.get("lr"))
            m = _lr_match(f)
            if lr is not None and m is not None and v is not None and not _same(v, lr):
                # the tested rate, exactly ("to about 0.01" -> "to 0.001")
                f = f[:m.start(0)] + f[m.start(0):m.start(1)].replace("about ", "") + T.g(lr) + f[m.end(1):]
                fm = _FACTOR.search(f)
                if fm:  # the cut stated as a factor follows the value
                    f = f[:fm.start(2)] + T.g(float(fm.group(2)) * lr / v, 2) + f[fm.end(2):]
                self.fixes[i] = f
            self._pass(i, ok)
            return
        tried = sorted(x for t in bad for x in _tried_lrs(t))
        if tried and (v is None or v >= tried[0] / NEAR_FAILED):
            self._fail(i, bad[0], f"lr {T.g(tried[0])}" if v is None or not _same(v, tried[0]) else None)

    def _clip(self, i: int, ok: Optional[dict], bad: List[dict]) -> None:
        f = self.fixes[i]
        m = _CLIP.search(f)
        v = float(m.group(2)) if m else None
        if ok is not None:
            c = ok.get("max_norm")
            if isinstance(c, (int, float)) and v is not None and not _same(v, c):
                self.fixes[i] = _CLIP.sub(lambda mm: mm.group(1) + T.g(float(c), 2), f)
            self._pass(i, ok)
            return
        tried = sorted(t["max_norm"] for t in bad if isinstance(t.get("max_norm"), (int, float)))
        if tried and v is not None and v >= tried[0] / NEAR_FAILED:
            self._fail(i, bad[0], f"clip at {T.g(tried[0])}" if not _same(v, tried[0]) else None)

    def _dtype(self, i: int, ok: Optional[dict], bad: List[dict]) -> None:
        scope = _scope(self.fixes[i])
        if ok is not None:
            p = ok.get("module") or ""
            if scope is None or not _same_scope(scope, p):
                failed = scope is not None and any(_same_scope(scope, t.get("module") or "") for t in bad)
                self.fixes[i] = _float32_fix(p, self.event.origin or {}) + (
                    f" ({_scope_words(scope)} alone: replay still non-finite)" if failed else "")
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
            if op and f"{X.fn(op)}(" in f:
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
        note = f"(replay: {what} still non-finite)" if what else STILL
        if "(replay:" not in self.fixes[i]:
            self.fixes[i] = f"{self.fixes[i]} {note}"
        self.failed[i] = t
        self.matched.setdefault(id(t), i)

    def ordered(self) -> List[str]:
        n = len(self.fixes)
        first = [i for i in range(n) if i in self.passed]
        last = [i for i in range(n) if i in self.failed and i not in self.passed]
        middle = [i for i in range(n) if i not in self.passed and i not in self.failed]
        self.order = first + middle + last
        return [self.fixes[i] for i in self.order]

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


# ---------------------------------------------------------------------------- why a fix was not tested
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
    if any(isinstance(e, dict) and e.get("kind") == tester for e in ev.get("experiments") or ()):
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


def _lr_match(fix: str) -> Optional["re.Match[str]"]:
    for rx in _LR_VALUES:
        m = rx.search(fix)
        if m:
            return m
    return None


def _lr_value(fix: str) -> Optional[float]:
    m = _lr_match(fix)
    return float(m.group(1)) if m else None


def _tried_lrs(t: dict) -> List[float]:
    """The first group's learning rates a failed lr_replay tried."""
    lr = _first(t.get("lr"))
    out = [lr] if lr is not None else []
    tried = [x for x in t.get("tried") or [] if isinstance(x, dict) and isinstance(x.get("factor"), (int, float))]
    last = tried[-1]["factor"] if tried else None
    if lr is not None and last:
        out += [lr / last * x["factor"] for x in tried]
    return out


def _scope(fix: str) -> Optional[str]:
    """The module/layer a float32 fix names (``""``: the whole model), or None (an op)."""
    m = _SCOPE.match(fix.strip())
    if m:
        return m.group(1)
    return "" if fix.strip().startswith(_WHOLE) else None


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

