"""torch.compile: guarding a compiled model, and replaying its failing step eagerly.

The guard's per-step check runs outside the compiled code (it reads the loss, the batch
and the gradients the compiled graphs produce), so it adds no graph break and no
recompilation in a healthy step. A compiled model (``torch.compile(model)``, an
``OptimizedModule``) is watched through the module it wraps (its parameter names in the
report are the model's own, without ``_orig_mod.``).

The failing step is replayed **eagerly** under the op recorder
(:func:`eager`: ``torch.compiler.set_stance("force_eager")``, which runs every compiled
function and module as plain Python, compiled loss functions included), so the recorder
sees each aten op with its module and source line. When the eager replay does not
reproduce the non-finite value, the compiled code made it (a fused kernel's numerics,
a backend bug): the report says so (:func:`explain_not_reproduced`) and offers
Inductor's own NaN checks for that replay (``torch._inductor.config.nan_asserts``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional

import torch


def is_compiled(model: Any) -> bool:
    """``model`` is a ``torch.compile`` wrapper (``OptimizedModule``)."""
    return hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule"


def unwrap_compiled(model: Any) -> Any:
    """The module a ``torch.compile`` wrapper runs (the model itself otherwise)."""
    while is_compiled(model):
        model = model._orig_mod
    return model


def compiling() -> bool:
    """True while dynamo traces (hooks must then do nothing, or they add graph breaks)."""
    try:
        return torch.compiler.is_compiling()
    except Exception:
        return False


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled functions and modules eagerly inside the block (the replay of a failing step)."""
    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None:  # older torch: disable dynamo for the block
        with torch._dynamo.config.patch(disable=True):
            yield
        return
    with stance("force_eager"):
        yield


def uses_compile(model: Any, loss_fn: Any = None) -> bool:
    """The step runs compiled code: a compiled model, a module inside it compiled in place
    (``module.compile()``), or a compiled loss function."""
    if is_compiled(model) or _compiled_fn(loss_fn):
        return True
    m = unwrap_compiled(model)
    try:
        return any(getattr(sub, "_compiled_call_impl", None) is not None for sub in m.modules())
    except Exception:
        return False


def _compiled_fn(fn: Any) -> bool:
    return fn is not None and (hasattr(fn, "_torchdynamo_orig_callable") or
                               getattr(fn, "__wrapped__", None) is not None and
                               hasattr(fn, "_torchdynamo_inline"))


def explain_not_reproduced(loc_run: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """What to add to the localization when the eager replay of a compiled step stayed finite."""
    if not loc_run or loc_run.get("reproduced"):
        return None
    return {"compiled_code_made_it": True,
            "note": ("the step runs compiled code (torch.compile) and its eager replay stayed finite: "
                     "the non-finite value was made by the compiled code (e.g. a fused kernel), not by "
                     "the model's eager ops"),
            "next": ("replay it with Inductor's NaN checks: TORCHINDUCTOR_NAN_ASSERTS=1 (or "
                     "torch._inductor.config.nan_asserts = True; on CUDA also "
                     "runtime_triton_nan_asserts = True) makes the compiled code assert on the first "
                     "non-finite kernel input/output; or compile with backend='aot_eager' to tell "
                     "Inductor apart from the graph capture")}
