"""Names of the watched tensors (as the report gives them), and the exact slow-path scans that name
the non-finite ones."""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional

import torch

from ...core.script import main_names
from .slices import OptimizerView
from .tensors import is_checkable, local_finite, nonfinite_tensors


def model_prefixes(roots: List[torch.nn.Module], by_class: bool = False) -> List[str]:
    """The prefix of each watched model's parameter names: none for one model; with several, the
    script's variable of it (``emb_u.``), else (``by_class``) its class (``Embedding:``) or none."""
    if len(roots) < 2:
        return [""] * len(roots)
    var = main_names()
    return [var[id(r)] + "." if id(r) in var else (type(r).__name__ + ":" if by_class else "") for r in roots]


class TensorNames:
    """``id(tensor) -> name`` over the watched modules (parameters, buffers) and optimizers."""

    def __init__(self, roots: "weakref.WeakSet[torch.nn.Module]", views: Dict[int, OptimizerView]) -> None:
        self.roots, self.views = roots, views  # the monitor's own (live) collections
        self._names: Optional[Dict[int, str]] = None
        # per root: how often it was called at top level after another root (counted by the monitor's add_root)
        self.calls: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()

    def state_roots(self) -> List[torch.nn.Module]:
        """The roots whose state is checked and snapshotted: those with parameters, and parameter-free ones
        called again after another root (a running normaliser). A parameter-free module called once (a loss
        built each step with ``pos_weight=neg / pos``) holds this step's inputs, not state."""
        return [r for r in list(self.roots) if self.calls.get(r, 0) > 1 or next(r.parameters(), None) is not None]

    def invalidate(self) -> None:
        """A module or optimizer was added: rebuild the map when next needed."""
        self._names = None

    def param_names(self) -> Dict[int, str]:
        if self._names is None:
            names: Dict[int, str] = {}
            roots = list(self.roots)
            for root, pre in zip(roots, model_prefixes(roots)):
                for n, p in root.named_parameters(remove_duplicate=False):
                    names.setdefault(id(p), pre + n)
                for n, b in root.named_buffers(remove_duplicate=False):
                    names.setdefault(id(b), pre + n)
            for oi, view in enumerate(self.views.values()):
                opt = view.opt_ref()
                if opt is None:
                    continue
                for gi, g in enumerate(opt.param_groups):
                    for pi, p in enumerate(g["params"]):
                        names.setdefault(id(p), f"optimizer{oi}.param_groups[{gi}][{pi}]")
            self._names = names
        return self._names

    def name_of(self, t: torch.Tensor) -> str:
        return self.param_names().get(id(t), f"tensor{tuple(t.shape)}")

    def nonfinite_params(self, groups: Iterable[List[torch.Tensor]], roots: bool = True,
                         buffers: bool = True) -> List[str]:
        """Names of non-finite tensors among ``groups`` and (with ``roots``) the state-holding watched modules'
        parameters outside the optimizers (frozen ones, another model's) and (with ``buffers``) buffers."""
        groups = [list(g) for g in groups]
        out = [self.name_of(p) for p in nonfinite_tensors(groups)]
        seen = {id(p) for g in groups for p in g}
        if not roots:
            return out
        for root in self.state_roots():
            for n, t in list(root.named_parameters()) + (list(root.named_buffers()) if buffers else []):
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if is_checkable(t) and not local_finite(t):
                    out.append(self.name_of(t) if isinstance(t, torch.nn.Parameter) else n)
        return out

    def nonfinite_grads(self, groups: Iterable[List[torch.Tensor]]) -> List[str]:
        return [self.name_of(p) for g in groups for p in g
                if p.grad is not None and is_checkable(p.grad) and not local_finite(p.grad)]
