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
a backend bug): the report says so (:func:`annotate_compiled`) and offers
Inductor's own NaN checks for that replay (``torch._inductor.config.nan_asserts``).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator

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
    with warnings.catch_warnings():  # the recorder's global module hooks make dynamo warn about them
        warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
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
    return fn is not None and hasattr(fn, "_torchdynamo_orig_callable")


INDUCTOR_FIX = ("replay this step with Inductor's NaN checks: set TORCHINDUCTOR_NAN_ASSERTS=1 (or "
                "torch._inductor.config.nan_asserts = True; on CUDA also runtime_triton_nan_asserts = True) "
                "before compiling, so the compiled code asserts on the first non-finite graph input/output or "
                "kernel; compile with backend='aot_eager' to tell Inductor's kernels apart from the graph capture")


def annotate_compiled(ev: Any, loc_run: Dict[str, Any]) -> None:
    """The event of a step replayed eagerly: say so, and when the eager ops stayed finite, that the
    compiled code made the value (with Inductor's own NaN checks as the next step)."""
    loc = dict(ev.localization or {})
    loc["eager_replay"] = True
    step = ev.step
    if loc_run.get("reproduced"):
        loc["method"] = (f"replayed step {step} eagerly (the step runs torch.compile'd code; the replay runs it "
                         f"as plain PyTorch ops) under op-level instrumentation (forward, backward and optimizer "
                         f"ops), reproduced")
    else:
        loc["method"] = (f"replayed step {step} eagerly (the step runs torch.compile'd code) under op-level "
                         f"instrumentation: the eager ops stayed finite, so the non-finite value was made by the "
                         f"compiled code (a fused kernel's numerics or a compiler/backend bug), not by an op of "
                         f"the model; no eager origin is claimed")
        loc["compiled_code_made_it"] = True
        loc["next"] = INDUCTOR_FIX
        fixes = list(ev.fixes or [])
        if INDUCTOR_FIX not in fixes:
            ev.fixes = [INDUCTOR_FIX] + fixes
    ev.localization = loc
