"""Replaying a recorded training step in-process: :class:`StepReplay`, the zero-code step function.

A zero-code run (``nanguard run``, ``nanguard.watch()``) records the current step on a
:class:`~nanguard.pytorch.tape.StepTape`. When the step fails, the parameters and the optimizer state
are still the pre-update ones (the check runs before the update), so the step can be re-executed
here instead of re-running the script up to it. The interface, also for counterfactual replays
(issue 13) and rewinds (issue 14)::

    replay = watcher.step_replay(step)      # a StepReplay, or None: watcher.replay_unavailable says why
    out = replay.run(recorder=None, changes=None)

``run`` re-executes the step's recorded calls in order (outermost module calls, the loss code,
backward), each with its recorded torch RNG state, grad/inference/autocast mode and user call site,
under ``recorder`` (an :class:`~nanguard.pytorch.locate.OpRecorder`, started and stopped by ``run``)
when one is given, and then puts back everything it touched: the parameters' ``.grad``, the
modules' buffers (BatchNorm statistics), the RNG. It never runs the optimizer and never writes a
tensor of the user's (an in-place write to a tensor the step did not make is not re-executed: the
replay reads the written values).
``changes`` (a :class:`Changes`, all fields optional): ``inputs(t, i) -> t`` replaces external
tensor ``i`` (the batch, targets, masks; never called for tensors that require grad), ``context()``
returns a context manager entered around the whole replay (e.g. a module run in float32), ``keep_grads``
leaves the replay's gradients in place (a history replay from a snapshot applies the update with them).
It returns a dict: ``method`` ("replay-tape"), ``losses`` (the replayed tensors given to backward,
detached), ``same_loss`` (bit-for-bit the recorded values, NaN where NaN; None under ``changes``),
``grads_finite``, ``error`` (None, or why the replay could not run), ``seconds``, and with a
recorder ``localization`` (``recorder.result()``) and ``reproduced``.

Module side effects outside tensors (a Python counter incremented in ``forward``, a forward hook
that appends to a list) happen once more, as they would in any re-execution.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .distributed import is_distributed
from .numerics import version
from .tape import Entry, Ext, Ref, StepTape, rng_now, set_rng, tensor_leaves

__all__ = ["StepReplay", "Changes", "ReplayError", "replay_of"]


class ReplayError(RuntimeError):
    """The recorded calls could not be re-executed as recorded."""


@dataclass
class Changes:
    """What a counterfactual replay changes (see the module docstring)."""
    inputs: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None
    context: Optional[Callable[[], Any]] = None
    keep_grads: bool = False  # leave the replay's gradients (a history replay applies an update with them)


def _call(fn: Any, args: tuple, kwargs: dict) -> Any:
    """The replay's trampoline: the recorder's frame walk stops here and answers with the call site."""
    return fn(*args, **kwargs)


BOUNDARY = _call.__code__


class StepReplay:
    """One recorded step, replayable (see the module docstring)."""

    method_kind = "replay-tape"

    def __init__(self, tape: StepTape, roots: Sequence[torch.nn.Module], optimizers: Sequence[Any],
                 backward: Callable[..., Any], quiet: Callable[[], Any], targets: Optional[List[Ref]] = None) -> None:
        """``backward``: the unwrapped ``torch.autograd.backward``; ``quiet()``: a context manager that
        silences the caller's own hooks (the watcher's) while the replay runs. ``targets``: replay only
        what makes these recorded outputs (a value an evaluation read), not the step's losses."""
        self.targets = list(targets or [])
        self._leaf_graphs = False  # externals' freed graphs read as leaves (see _externals)
        self.step = tape.step
        self.entries: List[Entry] = list(tape.entries)
        self.ext: List[torch.Tensor] = list(tape.ext)
        # Tensors the step wrote in place before using them (read as written), and whether the calls
        # that built the batch were all recorded: a batch found non-finite is then made by an op.
        self.written: Dict[int, int] = dict(tape.ext_written)
        self.param_writes: Dict[int, dict] = dict(tape.param_writes)
        self.pre_truncated = tape.pre_truncated
        self.roots, self.optimizers = list(roots), list(optimizers)
        self._backward, self._quiet = backward, quiet
        self._env: Dict[tuple, torch.Tensor] = {}
        self.needed = self._slice(tape.writers)
        self.problem = self._check(tape.ext_ver)   # None, or why this step cannot be replayed faithfully

    # ------------------------------------------------------------------ what must run
    def _slice(self, writers: Dict[tuple, List[int]]) -> List[int]:
        """The entries the losses depend on (backward entries, what they read, and in-place writers of
        what they read before reading it), in program order. Logging and metrics are left out."""
        refs = [_refs((e.args, e.kwargs)) for e in self.entries]
        need: set = set()
        stack = [r.entry for r in self.targets] or [i for i, e in enumerate(self.entries) if e.kind == "backward"]
        while stack:
            i = stack.pop()
            if i in need:
                continue
            need.add(i)
            for r in refs[i]:
                stack.append(r.entry)
                stack.extend(w for w in writers.get((r.entry, r.slot), ()) if w < i)
        return sorted(need)

    def _check(self, ext_ver: List[Optional[int]]) -> Optional[str]:
        for i in self.needed:
            for x in _exts((self.entries[i].args, self.entries[i].kwargs)):
                t = self.ext[x.i]
                if self.written.get(x.i, -1) > i:
                    return "a tensor the loss needs was written in place after it was read"
                if version(t) != ext_ver[x.i]:
                    return "a tensor the loss needs was modified in place after the step read it"
        return None

    # ------------------------------------------------------------------ what the step was fed
    def data_unexplained(self, loaded: Optional[Callable[[torch.Tensor], bool]] = None) -> bool:
        """A tensor the step did not make (or wrote in place) holds non-finite values: the calls
        that made it were not recorded, so the replay cannot say which op did. Also a fresh tensor
        first read after a backward pass by a call that is not a module's: the region is closed from a
        backward to the next module call, so a plain call there (a second micro-batch's ``torch.log(t)``
        before its model call) made it unrecorded. Not a view of a tensor older than the step (a slice
        of the dataset) nor one ``loaded(t)`` says a data loader gave (those are the batch)."""
        idx = set(range(len(self.ext))) if self.pre_truncated else set(self.written)
        back = next((i for i, e in enumerate(self.entries) if e.kind == "backward"), None)
        for e in self.entries[back + 1:] if back is not None else ():
            if e.kind != "module":
                idx.update(x.i for x in _exts((e.args, e.kwargs))
                           if self.ext[x.i]._base is None and not (loaded is not None and loaded(self.ext[x.i])))
        cand = [t for t in map(self.ext.__getitem__, idx) if not t.requires_grad and t.is_floating_point()]
        return any(not bool(torch.isfinite(t).all()) for t in cand)

    def batch(self) -> List[Any]:
        """The positional arguments of the step's first module call (the model's inputs), as the last
        :meth:`run` rebuilt them (call it after a run)."""
        first = next((i for i in self.needed if self.entries[i].kind == "module"), None)
        if first is None:
            return []
        return list(self._build(self.entries[first].args, self._env, self._externals(None)))

    def rng(self) -> Any:
        """torch's RNG state at the step's first module call (CPU tensor, and (device, CUDA state))."""
        first = next((e for e in self.entries if e.rng is not None), None)
        return first.rng if first is not None else None

    # ------------------------------------------------------------------ run
    def run(self, recorder: Any = None, changes: Optional[Changes] = None) -> Dict[str, Any]:
        t0 = time.perf_counter()
        out: Dict[str, Any] = {"method": self.method_kind, "step": self.step, "losses": [], "same_loss": None,
                               "grads_finite": None, "error": None}
        params = _unique([p for r in self.roots for p in r.parameters()]
                         + [p for o in self.optimizers for g in o.param_groups for p in g["params"]])
        saved_grads = [p.grad for p in params]
        # the replay's forward writes the buffers (BatchNorm statistics) in place: it writes copies, and the
        # script's own buffer tensors are put back untouched afterwards. A graph of the script still to be
        # differentiated may have saved them (a GAN's generator graph, built before the discriminator's
        # failing step): an in-place write, even one that restores the values, would break its backward
        swapped = _swap_buffers(self.roots)
        rng_after = rng_now()
        ctx = changes.context() if changes is not None and changes.context is not None else \
            contextlib.nullcontext()
        try:
            for p in params:
                p.grad = None
            with self._quiet(), ctx, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the step's own warnings were shown when it first ran
                if recorder is not None:
                    recorder.start()
                    recorder.set_stage("forward")
                try:
                    try:
                        out["losses"] = self._run_entries(recorder, self._externals(changes))
                    except RuntimeError as e:
                        if self._leaf_graphs or "second time" not in str(e):
                            raise
                        self._leaf_graphs = True  # (see _externals) and once more, for this step's later replays too
                        for p in params:
                            p.grad = None
                        out["losses"] = self._run_entries(recorder, self._externals(changes))
                finally:
                    if recorder is not None:
                        recorder.stop()
            out["grads_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in params
                                      if p.grad is not None and p.grad.is_floating_point())
            if changes is None and not self.targets:
                out["same_loss"] = self._same_losses(out["losses"])
        except Exception as e:  # the caller falls back to another way to localize
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            if not (changes is not None and changes.keep_grads and out["error"] is None):
                for p, g in zip(params, saved_grads):
                    p.grad = g
            for bufs, name, b in swapped:
                bufs[name] = b
            set_rng(rng_after)
        if recorder is not None:
            out["localization"] = recorder.result()
            out["reproduced"] = bool(out["localization"].get("reproduced")) and out["error"] is None \
                and out["same_loss"] is not False
        out["seconds"] = round(time.perf_counter() - t0, 4)
        return out

    def _externals(self, changes: Optional[Changes]) -> List[torch.Tensor]:
        vals = list(self.ext)
        if self._leaf_graphs and (changes is None or not changes.keep_grads):
            # an external with a graph made before the step's tape (a GAN's fake = G(z), built in D's step
            # and backpropagated in G's): its graph was freed by the step's own backward, so a replay that
            # localizes or tests a change reads it as a leaf (the backward stops there; G's own ops are not
            # replayed). Only after a replay with the graphs failed on them: an external made inside the step
            # (a loss a module stored as an attribute) keeps its graph, and a non-finite one stays evidence.
            vals = [v.detach().requires_grad_(True) if v.grad_fn is not None and bool(torch.isfinite(v).all())
                    else v for v in vals]
        if changes is not None and changes.inputs is not None:
            vals = [v if v.requires_grad else changes.inputs(v, i) for i, v in enumerate(vals)]
        return vals

    def _run_entries(self, rec: Any, ext: List[torch.Tensor]) -> List[torch.Tensor]:
        env: Dict[tuple, torch.Tensor] = {}
        self._env = env
        losses: List[torch.Tensor] = []
        for i in self.needed:
            e = self.entries[i]
            if e.rng is not None:
                set_rng(e.rng)
            if rec is not None:
                rec.set_call_site(BOUNDARY, e.site)
            with _modes(e):
                if e.kind == "backward":
                    tensors = self._build(e.args, env, ext)
                    a, k = self._build(e.kwargs[0], env, ext), self._build(e.kwargs[1], env, ext)
                    losses += [t.detach() for t in tensors]
                    if rec is not None:
                        for t in tensors:
                            rec.mark_loss(t)
                        rec.set_stage("backward")
                    _call(self._backward, (tensors, *a), k)  # through the trampoline: backward ops
                    # are named at the user's `loss.backward()` line, not where the replay was started
                    if rec is not None:
                        rec.set_stage("forward")
                    continue
                res = _call(e.fn, self._build(e.args, env, ext), self._build(e.kwargs or {}, env, ext))
            for j, t in enumerate(tensor_leaves(res)):
                env[(i, j)] = t
        for r in self.targets:
            t = env.get((r.entry, r.slot))
            if t is None:
                raise ReplayError("a replayed call returned a different structure than when recorded")
            losses.append(t.detach())
            if rec is not None:
                rec.mark_loss(t)
        return losses

    def _build(self, tmpl: Any, env: Dict[tuple, torch.Tensor], ext: List[torch.Tensor]) -> Any:
        if isinstance(tmpl, Ref):
            try:
                return env[(tmpl.entry, tmpl.slot)]
            except KeyError:
                raise ReplayError("a replayed call returned a different structure than when recorded") from None
        if isinstance(tmpl, Ext):
            return ext[tmpl.i]
        t = type(tmpl)
        if t is tuple or t is list:
            return t(self._build(o, env, ext) for o in tmpl)
        if t is dict:
            return {k: self._build(v, env, ext) for k, v in tmpl.items()}
        return tmpl

    def _same_losses(self, losses: List[torch.Tensor]) -> bool:
        rec = [t for e in self.entries if e.kind == "backward" for t in (e.loss or [])]
        if len(rec) != len(losses):
            return False
        for a, b in zip(rec, losses):
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if a.is_floating_point():
                if not bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all()):
                    return False
            elif not torch.equal(a, b):
                return False
        return True


@contextlib.contextmanager
def _modes(e: Entry):
    with contextlib.ExitStack() as st:
        if e.inference:
            st.enter_context(torch.inference_mode())
        else:
            st.enter_context(torch.set_grad_enabled(e.grad))
        for dev, dtype in e.autocast or ():
            st.enter_context(torch.autocast(dev, dtype=dtype))
        yield


def _walk(tmpl: Any, kind: type, out: list) -> list:
    if isinstance(tmpl, kind):
        out.append(tmpl)
    elif type(tmpl) in (tuple, list):
        for o in tmpl:
            _walk(o, kind, out)
    elif type(tmpl) is dict:
        for o in tmpl.values():
            _walk(o, kind, out)
    return out


def _refs(tmpl: Any) -> List[Ref]:
    return _walk(tmpl, Ref, [])


def _exts(tmpl: Any) -> List[Ext]:
    return _walk(tmpl, Ext, [])


def _unique(ts: List[torch.Tensor]) -> List[torch.Tensor]:
    seen, out = set(), []
    for t in ts:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def replay_of(watcher: Any, step: Optional[int] = None, target: Optional[torch.Tensor] = None) -> tuple:
    """(StepReplay or None, why not) for a watcher's tape: the step ``step`` (its losses), or the
    recorded calls that made ``target`` (a value an evaluation read)."""
    tape = watcher.tape
    if tape is None:
        return None, "no step tape (not recorded in this mode)"
    targets = None
    if target is not None:
        ref = tape.ref_of(target)
        if ref is None:
            return None, "the value was not made by calls the evaluation tape recorded"
        targets = [ref]
    else:
        why = tape.why_not(step)
        if why is None and is_distributed():
            why = "torch.distributed: the ranks re-run the script together"
        if why is not None:
            return None, why
    rep = StepReplay(tape, list(watcher.monitor.roots), watcher.optimizers(), watcher._orig["backward"],
                     watcher.quiet, targets=targets)
    return (rep, None) if rep.problem is None else (None, rep.problem)


def _swap_buffers(roots: Sequence[torch.nn.Module]) -> List[tuple]:
    """Every buffer of ``roots`` replaced in its module by a copy; returns (the module's buffer dict, name,
    the original tensor) to put back."""
    out, seen = [], set()
    for r in roots:
        for m in r.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            for name, b in m._buffers.items():
                if b is not None:
                    out.append((m._buffers, name, b))
                    m._buffers[name] = b.detach().clone()
    return out
