"""The PyTorch bench: runs the core's experiment specs on a :class:`~.step.ReplayableStep`."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...core.experiments import Bench, Experiment, Spec
from ...core.experiments.investigate import run_with
from ...core.experiments.kinds import describe
from ...core.experiments.rows import rows_to_drop
from ...core.experiments.planner import GUARD_TEXT
from ...core.experiments.tested import DEEPEST_LR_FACTOR, still_diverging
from ..recover.lr_backoff import schedule_peaks
from ..recover.upcast import find_modules
from .history import consecutive, replay_history
from .modes import UNARY, CaptureInput, DomainGuard, ExactInput, PromoteMode
from .samples import complement, indices_at
from .step import Outcome, ReplayableStep, StepChanges
from .trial import LOW_PRECISION, Trial

_DTYPE_ERRORS = ("dtype", "scalar type", "same type", "Half", "BFloat16")


class TorchBench(Bench):
    """Experiments on ``step`` (the failing step). ``roots``: the watched models; ``kept``: earlier
    steps by number and ``snapshots`` (objects with ``step`` and ``restore``) for history replays;
    ``step_seconds``: one ordinary training step's wall time (reported with the cost); ``origin``: the
    event's origin (its source line for ``domain_guard``); ``rates``: each earlier step's learning rates
    (:func:`.history.step_rates`), a history replay's schedule."""

    def __init__(self, step: ReplayableStep, roots: Sequence[torch.nn.Module], *, step_seconds: Optional[float],
                 kept: Optional[Dict[int, ReplayableStep]] = None, snapshots: Sequence[Any] = (),
                 origin: Optional[Dict[str, Any]] = None, rates: Optional[Dict[int, List[float]]] = None) -> None:
        self.step, self.roots = step, list(roots)
        self.rates = dict(rates or {})
        self.origin = origin or {}
        self._step_s = step_seconds
        self.kept = dict(kept or {})
        self.snapshots = list(snapshots)
        self.replay_s: Optional[float] = None

    # ------------------------------------------------------------------ what it can do
    def step_seconds(self) -> Optional[float]:
        return self._step_s

    def capabilities(self, origin: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        origin = origin or {}
        n = getattr(self.step, "step", None)
        snaps = []
        if n is not None and self.step.scaler is None and self.step.optimizers:
            kept = dict(self.kept)
            kept[n] = self.step
            snaps = [s.step for s in self.snapshots
                     if s.step < n and s.finite() and consecutive(kept, s.step, n) is not None]
        return {"batch_size": self.step.batch_size(), "module_chain": self.module_chain(origin.get("module"), origin.get("module_type")),
                "float64": True, "op_patch": True, "compiled": self.compiled(), "snapshots": snaps,
                "lrs": [float(g["lr"]) for o in self.step.optimizers for g in o.param_groups],
                "lr_peaks": schedule_peaks(self.step.optimizers) if snaps else []}

    def module_chain(self, path: Optional[str], module_type: Optional[str] = None) -> List[str]:
        """The origin's module path, then its parents, up to the root model (""). With several roots, a root
        itself ("") is named by its type (``module_type``): the first root is not always the one (a style
        transfer's ``nn.MSELoss`` called on its own beside the network)."""
        if path == "" and module_type and len(self.roots) > 1 and \
                any(type(r).__name__ == module_type for r in self.roots):
            path = f"{module_type}:"
        if path is None or not find_modules(self.roots, path):
            return []
        prefix, _, rest = path.rpartition(":") if ":" in path else ("", "", path)
        parts = rest.split(".") if rest else []
        chain = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]
        return [f"{prefix}:{c}" if prefix else c for c in chain]

    def compiled(self) -> bool:
        return any(type(r).__name__ == "OptimizedModule" or hasattr(r, "_orig_mod") for r in self.roots) or \
            hasattr(getattr(self.step, "loss_fn", None), "_torchdynamo_orig_callable")

    # ------------------------------------------------------------------ running one
    def run(self, spec: Spec, replays_left: float = 0.0) -> Experiment:
        return run_with(self, spec, replays_left, _RUNNERS, "PyTorch")

    def _replay(self, e: Experiment, changes: Optional[StepChanges] = None) -> Outcome:
        o = self.step.run(changes=changes)
        e.replays += 1
        size = self.step.batch_size() if (changes is not None and changes.keep_rows is not None) else None
        e.work += (len(changes.keep_rows) / size) if size else 1.0  # a replay on some rows: that share of one
        self.replay_s = o.seconds if self.replay_s is None else min(self.replay_s, o.seconds)
        return o

    def _settle(self, e: Experiment, o: Outcome) -> None:
        e.finite, e.error = o.finite, o.error

    def _drop_samples(self, e: Experiment, replays_left: float) -> None:
        size = self.step.batch_size()
        if not size:
            e.error = "the batch has no row dimension"
            return

        def fails(keep: List[int]) -> Optional[bool]:
            o = self._replay(e, StepChanges(keep_rows=keep))
            return None if o.finite is None else (not o.finite)
        # the budget is counted in work (replays of the whole batch), never seconds: a bisection's
        # replays run on halves, quarters... of the rows, so the budget left pays for 4x as many
        rows = rows_to_drop(e, size, max(2, int(4 * replays_left) - 1), fails)
        if rows is None:
            return
        self._settle(e, self._replay(e, StepChanges(keep_rows=complement(rows, size))))
        e.details["rows"] = list(rows)
        idx = indices_at(self.step.dataset_indices(), rows, size)
        if idx is not None:
            e.details["dataset_indices"] = idx
        e.change = describe("drop_samples", {"rows": list(rows)})

    def _upcast_module(self, e: Experiment, replays_left: float) -> None:
        mods = find_modules(self.roots, e.params.get("module"))
        if not mods:
            e.error = f"module {e.params.get('module')!r} not found"
            return
        o = self._upcast_run(e, mods, promote=False)
        if o.finite is None and o.error and any(s in o.error for s in _DTYPE_ERRORS):
            o = self._upcast_run(e, mods, promote=True)  # a float32 output met a float16 op outside modules
        self._settle(e, o)

    def _grads_aside(self) -> Trial:
        """A trial whose first change sets every gradient aside (restored last, once the dtypes are back)."""
        t = Trial()
        ps = {id(p): p for r in self.roots for p in r.parameters()}
        ps.update({id(p): p for o in self.step.optimizers for g in o.param_groups for p in g["params"]})
        saved = [(p, p.grad) for p in ps.values()]
        for p, _ in saved:
            p.grad = None

        def back() -> None:
            for p, g in saved:
                p.grad = g
        t.on_close(back)
        return t

    def _upcast_run(self, e: Experiment, mods: List[torch.nn.Module], promote: bool) -> Outcome:
        with self._grads_aside() as t:
            for mod in mods:
                t.cast_module(mod, torch.float32, only=LOW_PRECISION)
                t.wrap_forward(mod, torch.float32)
            down = t.upcast_downstream(self.roots, {id(m) for mod in mods for m in mod.modules()}, torch.float32)
            if promote:
                with PromoteMode():
                    o = self._replay(e)
            else:
                o = self._replay(e)
            if down:
                e.details["downstream"] = list(down)
        return o

    def _float64_step(self, e: Experiment, replays_left: float) -> None:
        with self._grads_aside() as t:
            for r in self.roots:
                t.cast_module(r, torch.float64)
            with PromoteMode(torch.float64):
                self._settle(e, self._replay(e, StepChanges(cast=torch.float64)))

    def _origin_input_f64(self, e: Experiment, replays_left: float) -> None:
        op, file, line = e.params.get("op") or "", self.origin.get("file"), self.origin.get("line")
        if op not in UNARY:
            e.error = f"{op} is not a one-input op"
            return
        cap = CaptureInput(op, file, line)
        with self._grads_aside() as t:
            for r in self.roots:
                t.cast_module(r, torch.float64)
            with PromoteMode(torch.float64), cap:
                self._replay(e, StepChanges(cast=torch.float64))
        if not any(x is not None for x in cap.inputs):
            e.error = f"{op} was not called at the origin in the float64 replay"
            return
        sub = ExactInput(op, file, line, cap.inputs)
        with sub:
            o = self._replay(e)
        e.details["calls_substituted"] = sub.used
        self._settle(e, o)

    def _domain_guard(self, e: Experiment, replays_left: float) -> None:
        op = e.params.get("op") or ""
        e.params["guard"] = GUARD_TEXT.get(op, "clamped")
        e.change = describe("domain_guard", e.params)
        g = DomainGuard(op, self.origin.get("file"), self.origin.get("line"))
        with g:
            o = self._replay(e)
        if not g.guarded and self.origin.get("file") and not self._frames_visible():
            # a step replayed from a tape runs the user's calls from nanguard's frames: guard every call
            g = DomainGuard(op, None, None)
            with g:
                o = self._replay(e)
            e.details["every_call"] = True
        if not g.guarded:
            e.error = f"{op} was not called from the origin's line in the replay"
            return
        e.details["calls_guarded"] = g.guarded
        self._settle(e, o)

    def _frames_visible(self) -> bool:
        """The user's source lines are on the Python stack during a replay (a Guard's loss_fn), not only
        recorded (a step tape)."""
        return not hasattr(self.step, "replay")

    def _determinism(self, e: Experiment, replays_left: float) -> None:
        a = self._replay(e)
        b = self._replay(e)
        e.details.update(first_finite=a.finite, second_finite=b.finite,
                         identical=a.fingerprint == b.fingerprint and a.finite == b.finite)
        e.finite = None if (a.finite is None or b.finite is None) else bool(a.finite and b.finite)
        e.error = a.error or b.error

    def _eager(self, e: Experiment, replays_left: float) -> None:
        compiled = self._replay(e)
        stance = getattr(torch.compiler, "set_stance", None)
        if stance is None:
            e.error = "this torch has no torch.compiler.set_stance"
            return
        with stance("force_eager"):
            eager = self._replay(e)
        e.details["compiled_finite"] = compiled.finite
        self._settle(e, eager)

    def _history(self, e: Experiment, **change: Any) -> Dict[str, Any]:
        start, end = e.params.get("from_step"), e.params.get("to_step")
        snap = next((s for s in self.snapshots if s.step == start), None)
        kept = dict(self.kept)
        kept[getattr(self.step, "step", end)] = self.step
        steps = consecutive(kept, start, end) if snap is not None else None
        if steps is None:
            e.error = f"no snapshot and kept batches from step {start}"
            return {}
        res = replay_history(snap, steps, self.roots, self.step.optimizers, rates=self.rates, **change)
        e.replays += res.get("replays", 0)
        e.work += res.get("replays", 0)
        e.finite, e.error = res.get("finite"), res.get("error")
        if res.get("failed_at") is not None:
            e.details["failed_at"] = res["failed_at"]
        e.details["steps"] = res.get("replays", 0)
        if res.get("schedule"):
            e.details["schedule"] = True
        losses = [x for x in res.get("losses") or [] if isinstance(x, float)]
        if losses:
            e.details["losses"] = [losses[0], losses[-1]]
        return res

    def _lr_replay(self, e: Experiment, replays_left: float) -> None:
        """The learning rate lowered by the planned factor; with ``deeper`` (the planner's), if the replay
        still fails and the budget left pays for one more, x0.1 further (a fix printed, or applied, must
        be one that passed)."""
        factor = float(e.params.get("factor") or 0.1)
        lrs = [float(g["lr"]) for o in self.step.optimizers for g in o.param_groups]
        tried = []
        while True:
            before = e.work
            self._history(e, lr_factor=factor)
            tried.append({"factor": factor, "finite": e.finite, **({"failed_at": e.details["failed_at"]}
                                                                    if "failed_at" in e.details else {})})
            growing = e.finite is True and still_diverging(e.details)  # finite, but not passed
            if growing:
                tried[-1]["still_diverging"] = True
            if (e.finite is not False and not growing) or not e.params.get("deeper") or len(tried) >= 2 or factor * 0.1 < DEEPEST_LR_FACTOR or \
                    e.work + (e.work - before) > replays_left:
                break
            factor *= 0.1
            e.details.pop("failed_at", None)
        e.params["factor"] = factor
        e.details["lr"] = [x * factor for x in lrs]
        if len(tried) > 1:
            e.details["tried"] = tried
            e.change = describe("lr_replay", e.params)

    def _clip_replay(self, e: Experiment, replays_left: float) -> None:
        self._history(e, max_norm=float(e.params.get("max_norm") or 1.0))


# kind (nanguard.core.experiments.kinds.KINDS) -> the bench method that runs it
_RUNNERS: Dict[str, Callable[[TorchBench, Experiment, float], None]] = {
    "drop_samples": TorchBench._drop_samples,
    "upcast_module": TorchBench._upcast_module,
    "float64_step": TorchBench._float64_step,
    "origin_input_f64": TorchBench._origin_input_f64,
    "domain_guard": TorchBench._domain_guard,
    "determinism": TorchBench._determinism,
    "eager": TorchBench._eager,
    "lr_replay": TorchBench._lr_replay,
    "clip_replay": TorchBench._clip_replay,
}


