"""The state a script carries from one outermost module call to the next: a language model's hidden state,
detached (``repackage_hidden``) and passed back in with the next batch.

It is not a weight, so a rollback does not restore it: after a blow-up the weights go back, yet the next call
reads the hidden state the blown-up weights made (pytorch/examples' word_language_model with RNN_RELU at lr 20:
losses of 1e23, 1e15, 6e8 for the steps after the rollback, and a final loss past the clipped run's). With
recovery only: the storages of each outermost call's floating outputs are noted (no copy); when a snapshot is
taken at a call, its floating inputs that reuse those storages are copied with it (the run's first call: all
its floating inputs that are no weights; at most ``MAX_NUMEL`` values);
after a rollback to that snapshot, the next call of that module gets the copies in place of the inputs that
reuse its last outputs' storages (the carried ones; a new batch stays), through the forward pre-hook's return
value: the script's own tensors are not written.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..detect.tensors import Storages

MAX_NUMEL = 1 << 22  # a carried state larger than this (elements, all inputs of a call) is not copied


def _leaves(x: Any) -> List[Any]:
    return pytree.tree_leaves(x)


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided


class Carried:
    """Carried inputs of the outermost calls, copied at each snapshot, handed back after a rollback."""

    def __init__(self) -> None:
        self._outs: Dict[int, Storages] = {}  # id(module) -> the storages of its last call's floating outputs
        self.kept: Dict[int, Tuple[Any, Dict[int, torch.Tensor]]] = {}  # snapshot step -> (module ref, copies)
        self.pending: Optional[Tuple[Any, Dict[int, torch.Tensor]]] = None
        self._unsure: set = set()  # kept steps whose copies are all the first call's inputs (a batch among them)

    def noted(self, module: torch.nn.Module, args: tuple, storages: Optional[Storages]) -> None:
        """An outermost call of ``args`` returned outputs whose floating tensors live in ``storages``
        (``detect.tensors.Storages``; None: a call that did not train). The run's first call's inputs are
        kept as step 0's (the initial snapshot is taken inside that first step)."""
        if not self._outs and not self.kept:
            self._copy(0, module, args)
        if storages:
            self._outs[id(module)] = storages
        else:
            self._outs.pop(id(module), None)

    def keep(self, step: int, module: torch.nn.Module, args: tuple, steps: set) -> None:
        """A snapshot of ``step`` was taken as ``module`` is called with ``args``: copy the inputs that reuse its
        last outputs' storages. ``steps``: the steps whose snapshots are still kept (older copies go)."""
        for s in [s for s in self.kept if s not in steps]:
            del self.kept[s]
            self._unsure.discard(s)
        prev = self._outs.get(id(module))
        if step in steps and prev:
            self._copy(step, module, args, prev)

    def _copy(self, step: int, module: torch.nn.Module, args: tuple, only: Optional[Storages] = None) -> None:
        # the floating inputs that are no weights and (``only``) reuse the last call's output storages; the
        # first call copies them all (its hidden state is the script's own zeros, carried from nowhere yet):
        # which of them is carried is decided at the call after a rollback
        copies: Dict[int, torch.Tensor] = {}
        n = 0
        for i, t in enumerate(_leaves(args)):
            if _floating(t) and not t.requires_grad and (only is None or t in only):
                n += t.numel()
                if n > MAX_NUMEL:
                    return
                with torch.no_grad():
                    copies[i] = t.detach().clone()
        if copies:
            self.kept[step] = (weakref.ref(module), copies)
            if only is None:
                self._unsure.add(step)
            else:
                self._unsure.discard(step)

    def rolled_back(self, step: int) -> Optional[Dict[str, Any]]:
        """The weights went back to the snapshot of ``step``: its carried inputs are due at the next call (the
        rollback's record says so)."""
        self.pending = self.kept.get(step)
        if self.pending is None:
            return None
        ref, copies = self.pending
        m = ref()
        name = type(m).__name__ if m is not None else "the model"
        if step in self._unsure:  # the first call's inputs: which of them is carried shows at the next call only
            return {"carried_inputs": f"an input the script carries into {name} from its previous call (a detached "
                                      f"hidden state), if any, is put back as it was at step {step}, at its next call "
                                      "(a new batch stays as it is)"}
        return {"carried_inputs": f"the {sum(c.numel() for c in copies.values())} values the script carries into "
                                  f"{name} from its previous call (a detached hidden state) are put back as they "
                                  f"were at step {step}, at its next call"}

    def args_for(self, module: torch.nn.Module, args: tuple) -> tuple:
        """``args`` with the carried inputs due replaced by the snapshot's copies (``module`` is the one they
        were copied at; the shapes still match), else ``args`` as they are."""
        ref, copies = self.pending if self.pending is not None else (None, {})
        if ref is None or ref() is not module:
            return args
        self.pending = None
        prev = self._outs.get(id(module)) or ()
        leaves, spec = pytree.tree_flatten(args)
        swapped = []
        for i, c in copies.items():
            t = leaves[i] if i < len(leaves) else None
            # only an input carried from the last call (its storage is that call's output's): a new batch stays
            if _floating(t) and t in prev and t.shape == c.shape \
                    and t.dtype == c.dtype and t.device == c.device:
                leaves[i] = c.clone()
                swapped.append(i)
        if not swapped:
            return args
        return pytree.tree_unflatten(leaves, spec)
