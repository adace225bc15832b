"""The training loop's own shape: gradients never reset (NGL017), a gradient clip that runs before backward
(NGL018). Both let the update grow unchecked; the run-time diagnosis names them too
(``core.diagnosis.rules.divergence.script_shape``)."""
from __future__ import annotations

import ast
from typing import Iterator

from ...core.diagnosis.rules.divergence import move_clip_fix, zero_grad_fix
from ..flow import Flow
from ..registry import Hit, rule

_CLIPS = ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm")


def _where(origin: dict) -> str:
    return f"{str(origin.get('file') or '').rsplit('/', 1)[-1]}:{origin.get('line')}"


@rule("NGL017", "zero-grad-not-called", "lr_too_high", fixes=lambda origin, facts: [zero_grad_fix()],
      what="`optimizer.zero_grad` (or `model.zero_grad`) written as a statement without its parentheses: nothing "
           "is called, the gradients are never reset, each backward adds to the last ones and the update grows "
           "with the step count until the run diverges")
def _zero_grad_not_called(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Attribute) and node.value.attr == "zero_grad":
        yield Hit(node.value, "`zero_grad` is named but not called (no parentheses): the gradients are never "
                              "reset and accumulate over the steps")


@rule("NGL018", "clip-before-backward", "gradient_explosion",
      fixes=lambda origin, facts: [move_clip_fix(_where(origin))],
      what="a gradient clip (clip_grad_norm_ / clip_grad_value_) called before the body's backward(), with no "
           "optimizer step between them: it runs on no gradient (None after zero_grad), so no update is clipped")
def _clip_before_backward(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    if not isinstance(node, ast.Call):
        return
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name not in _CLIPS:
        return
    backwards = flow.call_lines("backward")
    later = [b for b in backwards if b > node.lineno]
    # a backward before the clip, or an optimizer step between the clip and the backward (clip; step;
    # zero_grad; backward: it clips the last step's gradients), is a sound order
    if not later or any(b < node.lineno for b in backwards) or \
            any(node.lineno < s < later[0] for s in flow.call_lines("step")):
        return
    yield Hit(node, f"the gradient clip runs before backward() (line {later[0]}): it finds no gradients of this "
                    "step, so the update after the backward is never clipped")
