"""Well-known errors that end a training script, with the user-facing reason and the fix.

See :mod:`nanguard.core.diagnosis.errors` for how a rule is registered and run. The messages are
PyTorch's own checks (and their shapes), read as facts about the run, never the user's names.
"""
from __future__ import annotations

import os

from ..errors import error_rule


def _at(err: dict) -> str:
    if err.get("file"):
        return f" at {os.path.basename(str(err['file']))}:{err.get('line')}"
    return ""


def _step(err: dict) -> str:
    return f" (step {err['step']})" if err.get("step") is not None else ""


@error_rule("batch_of_one", r"Expected more than 1 value per channel when training, got input size "
                            r"torch\.Size\(\[(\d+)(?:, (\d+))?", types=("ValueError",), category="batch_of_one")
def _bn_batch_of_one(m, err) -> dict:
    """BatchNorm in training given one value per channel: the last, incomplete batch of an epoch."""
    return {"summary": (f"a batch of one sample reached a BatchNorm layer in training mode{_at(err)}{_step(err)}: "
                        "batch statistics need more than one value per channel. This is usually the last, "
                        "incomplete batch of an epoch (dataset size % batch size == 1)"),
            "fixes": ["drop the incomplete last batch: DataLoader(..., drop_last=True)",
                      "or skip batches with fewer than 2 samples before the forward",
                      "or use a normalisation that does not need batch statistics (GroupNorm, LayerNorm)"]}


@error_rule("shape_mismatch", r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)",
            types=("RuntimeError",), category="shape_mismatch")
def _matmul_shapes(m, err) -> dict:
    """A linear layer given rows of a different width than it was built for: the data changed."""
    n, k, k2, out = (int(x) for x in m.groups())
    return {"summary": (f"a batch with {k} features per row reached a linear layer that expects {k2}{_at(err)}"
                        f"{_step(err)}: the input's last dimension changed (a different data file, an extra "
                        "column, a flattening that no longer matches)"),
            "fixes": [f"check the data that produced this batch: rows should have {k2} features, not {k}",
                      "assert x.shape[-1] == model's in_features where batches are built, to fail at the source"]}


@error_rule("backward_twice", r"Trying to backward through the graph a second time", types=("RuntimeError",),
            category="autograd_graph")
def _backward_twice(m, err) -> dict:
    """A backward through a graph an earlier backward freed: state carried across steps."""
    return {"summary": (f"backward ran through a graph that an earlier backward had already freed{_at(err)}"
                        f"{_step(err)}: a tensor carried over from the previous step (a hidden state, a running "
                        "sum of losses) still holds that step's graph"),
            "fixes": ["detach what you carry across steps: h = h.detach(), running = running + loss.item()",
                      "only if you really need two backward passes over one graph: backward(retain_graph=True)"]}


@error_rule("inplace_modified", r"one of the variables needed for gradient computation has been modified by an "
                                r"inplace operation", types=("RuntimeError",), category="autograd_graph")
def _inplace(m, err) -> dict:
    """An in-place op overwrote a tensor that backward needed."""
    return {"summary": (f"an in-place operation overwrote a tensor that backward still needed{_at(err)}{_step(err)}"),
            "fixes": ["replace the in-place op on that tensor by its out-of-place form (x = x * 2 instead of "
                      "x *= 2, relu(inplace=False))",
                      "run once under torch.autograd.set_detect_anomaly(True) to see the forward line"]}


@error_rule("no_grad_loss", r"element 0 of tensors does not require grad and does not have a grad_fn",
            types=("RuntimeError",), category="autograd_graph")
def _no_grad(m, err) -> dict:
    """backward on a loss with no autograd history (no_grad, detach, .item())."""
    return {"summary": (f"backward was called on a tensor with no autograd history{_at(err)}{_step(err)}: the loss "
                        "was computed under torch.no_grad(), detached, or rebuilt from .item() values"),
            "fixes": ["compute the loss from the model's outputs with grad enabled (no .item(), .detach() or "
                      "torch.tensor(...) on the way)"]}


@error_rule("target_out_of_bounds", r"Target (-?\d+) is out of bounds", types=("IndexError", "RuntimeError"),
            category="bad_labels")
def _target_range(m, err) -> dict:
    """A class label outside [0, num_classes)."""
    return {"summary": (f"a class label {m.group(1)} is outside the model's classes{_at(err)}{_step(err)}"),
            "fixes": ["labels must be in [0, num_classes): check the label encoding and the model's output size",
                      "mark labels to ignore with ignore_index (-100 by default), not other negative values"]}


@error_rule("out_of_memory", r"(CUDA|MPS|XPU)? ?out of memory", types=("OutOfMemoryError", "RuntimeError"),
            category="out_of_memory")
def _oom(m, err) -> dict:
    """The device ran out of memory."""
    return {"summary": f"the device ran out of memory{_at(err)}{_step(err)}",
            "fixes": ["lower the batch size (and keep the effective batch with gradient accumulation)",
                      "use mixed precision (torch.autocast) and activation checkpointing",
                      "do not keep tensors with graphs across steps (append loss.item(), not loss)"]}
