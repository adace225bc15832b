"""``nanguard lint --fix``: the rewrites that are exactly safe, done with LibCST (comments and formatting
kept), and only at the positions the analysis marked fixable:

* NGL001: ``log(softmax(x, dim))`` -> ``log_softmax(x, dim)`` (``torch.log(F.softmax(x, -1))`` ->
  ``F.log_softmax(x, -1)``, ``x.softmax(-1).log()`` -> ``x.log_softmax(-1)``, ``tf.math.log(tf.nn.softmax(x))``
  -> ``tf.nn.log_softmax(x)``);
* NGL002: ``nn.BCELoss()(torch.sigmoid(z), y)`` -> ``nn.BCEWithLogitsLoss()(z, y)`` and
  ``F.binary_cross_entropy(torch.sigmoid(z), y)`` -> ``F.binary_cross_entropy_with_logits(z, y)``.

Everything else is reported, never rewritten. LibCST is imported here only (``pip install
'nanguard[lint]'``).
"""
from __future__ import annotations

from typing import Iterable, Optional, Set, Tuple

from .engine import Finding

__all__ = ["apply_fixes", "FixUnavailable"]

FIXERS = ("NGL001", "NGL002")


class FixUnavailable(RuntimeError):
    """LibCST is not installed."""


def _last(func) -> Optional[str]:
    import libcst as cst
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Name):
        return func.value
    return None


def _rename(func, new: str):
    import libcst as cst
    if isinstance(func, cst.Attribute):
        return func.with_changes(attr=cst.Name(new))
    return func.with_changes(value=new)


def _transformer(positions: Set[Tuple[str, int, int]]):
    import libcst as cst
    from libcst.metadata import PositionProvider

    class Fixer(cst.CSTTransformer):
        METADATA_DEPENDENCIES = (PositionProvider,)

        def __init__(self) -> None:
            super().__init__()
            self.done = 0

        def _at(self, node, code: str) -> bool:
            pos = self.get_metadata(PositionProvider, node).start
            return (code, pos.line, pos.column) in positions

        def leave_Call(self, original, updated):
            if self._at(original, "NGL001"):
                new = self._log_softmax(updated)
                if new is not None:
                    self.done += 1
                    return new
            if self._at(original, "NGL002"):
                new = self._with_logits(updated)
                if new is not None:
                    self.done += 1
                    return new
            return updated

        @staticmethod
        def _log_softmax(call):
            if _last(call.func) != "log":
                return None
            if isinstance(call.func, cst.Attribute) and not call.args and isinstance(call.func.value, cst.Call):
                inner = call.func.value                       # x.softmax(-1).log() / F.softmax(x, -1).log()
            elif len(call.args) == 1 and call.args[0].keyword is None and isinstance(call.args[0].value, cst.Call):
                inner = call.args[0].value                    # torch.log(F.softmax(x, -1))
            else:
                return None
            if _last(inner.func) != "softmax":
                return None
            return inner.with_changes(func=_rename(inner.func, "log_softmax"))

        @staticmethod
        def _logits(arg):
            """z for ``torch.sigmoid(z)`` / ``z.sigmoid()``, else None."""
            v = arg.value
            if arg.keyword is not None or not isinstance(v, cst.Call) or _last(v.func) != "sigmoid":
                return None
            if not v.args and isinstance(v.func, cst.Attribute):
                return v.func.value
            if len(v.args) == 1 and v.args[0].keyword is None:
                return v.args[0].value
            return None

        def _with_logits(self, call):
            if not call.args:
                return None
            z = self._logits(call.args[0])
            if z is None:
                return None
            args = [call.args[0].with_changes(value=z), *call.args[1:]]
            if isinstance(call.func, cst.Call) and _last(call.func.func) == "BCELoss":
                ctor = call.func.with_changes(func=_rename(call.func.func, "BCEWithLogitsLoss"))
                return call.with_changes(func=ctor, args=args)
            if _last(call.func) == "binary_cross_entropy":
                return call.with_changes(func=_rename(call.func, "binary_cross_entropy_with_logits"), args=args)
            return None

    return Fixer


def apply_fixes(source: str, findings: Iterable[Finding]) -> Tuple[str, int]:
    """``source`` with the fixable findings rewritten, and how many were."""
    positions = {(f.rule, f.line, f.col - 1) for f in findings if f.fixable and f.rule in FIXERS}
    if not positions:
        return source, 0
    try:
        import libcst as cst  # lazy: only --fix needs LibCST
        from libcst.metadata import MetadataWrapper
    except ModuleNotFoundError:
        raise FixUnavailable("--fix needs LibCST: pip install 'nanguard[lint]'") from None
    fixer = _transformer(positions)()
    out = MetadataWrapper(cst.parse_module(source)).visit(fixer)
    return out.code, fixer.done
