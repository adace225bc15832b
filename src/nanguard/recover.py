"""Stage 4, recover: diagnosis-driven actions that keep a run alive, loudly.

Actions (each a small function over the training objects):

* ``skip_step``  - drop the update and the bad gradients; weights untouched.
* ``rollback``   - restore model, optimizer, GradScaler and RNG state from an
  in-memory snapshot (CPU copies, taken every ``snapshot_every`` steps; the
  cost is one copy of the parameters, buffers and optimizer state per kept
  snapshot), then skip the failing step.
* ``lr_backoff`` - multiply every param group's ``lr`` by ``factor``.
* ``clip``       - turn on gradient-norm clipping before every later update, with
  ``max_norm`` taken from the healthy gradient-norm history.
* ``upcast``     - run the origin module in float32 from now on (parameters and
  their optimizer state cast, inputs cast, autocast disabled inside it).
* ``loss_scale`` - float16 training without a scaler: scale the loss before
  backward and unscale the gradients before the update, dynamically.

Policy (``recover="auto"``): the diagnosis picks the action (see ``AUTO``);
a budget (at most ``max_recoveries`` in ``window`` steps, and at most
``max_consecutive`` failing steps in a row) stops the run with the full
diagnosis when recovery is not working, so a deterministic bug that recurs
every step is reported, not skipped forever. A recovery is never silent: each
one is an event in the report (with ``recovery`` filled in) and a one-line
notice on stderr.

LR schedulers: nanguard does not step or rewind them. A skipped or rolled-back
step still counts in the scheduler's own counter (as GradScaler's skips do),
and an ``lr_backoff`` also scales the ``base_lrs`` / ``initial_lr`` of the
schedulers it can see attached to the optimizer so that the next scheduler
step keeps the lower rate.
"""
from __future__ import annotations

import copy
import math
from collections import deque
from typing import Any, Dict, List, Optional, Sequence

import torch

ACTIONS = ("skip_step", "rollback", "lr_backoff", "clip", "upcast", "loss_scale")

# category -> actions, in order. Unlisted categories get skip_step (a rare domain
# error on some batch), bounded by the budget.
AUTO: Dict[str, List[str]] = {
    "bad_input_data": ["skip_step"],
    "low_precision_overflow": ["upcast"],
    "low_precision_underflow": ["upcast"],
    "gradient_explosion": ["rollback", "clip"],
    "lr_too_high": ["rollback", "lr_backoff"],
    "param_corruption": ["rollback"],
    "optimizer_numerics": ["rollback"],
    "loss_scale_collapse": [],  # the scaler is already skipping: recovery cannot help, stop
}


# --------------------------------------------------------------------------- snapshots

class Snapshot:
    """CPU copy of model(s), optimizer(s), scaler and RNG at the start of one step."""

    def __init__(self, step: int, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any],
                 scaler: Any = None, loss: Optional[float] = None) -> None:
        from .replay import capture_rng
        self.step = step
        self.loss = loss
        self.modules = [{k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()}
                        for m in modules]
        self.optimizers = [_cpu_copy(o.state_dict()) for o in optimizers]
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None and _enabled(scaler) else None
        self.rng = capture_rng()
        self.nbytes = sum(_nbytes(d) for d in self.modules) + sum(_nbytes(d) for d in self.optimizers)

    def finite(self) -> bool:
        return all(bool(torch.isfinite(v).all()) for d in self.modules for v in d.values()
                   if v.is_floating_point())

    def restore(self, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any], scaler: Any = None) -> None:
        with torch.no_grad():
            for m, sd in zip(modules, self.modules):
                own = m.state_dict()
                for k, v in sd.items():
                    if k in own:
                        own[k].copy_(v.to(own[k].device, own[k].dtype))
        for o, sd in zip(optimizers, self.optimizers):
            lrs = [g["lr"] for g in o.param_groups]
            o.load_state_dict(sd)
            for g, lr in zip(o.param_groups, lrs):  # keep any lr change made since (backoff)
                g["lr"] = lr
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(self.scaler)


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _enabled(scaler) -> bool:
    try:
        return bool(scaler.is_enabled())
    except Exception:
        return False


# --------------------------------------------------------------------------- actions

def skip_step(optimizers: Sequence[Any]) -> Dict[str, Any]:
    """Drop the gradients, so the coming ``optimizer.step()`` changes nothing."""
    n = 0
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad = None
                    n += 1
    return {"grads_dropped": n}


def lr_backoff(optimizers: Sequence[Any], factor: float = 0.1) -> Dict[str, Any]:
    """Scale every param group's learning rate (and visible schedulers' base rates) by ``factor``."""
    if not 0 < factor < 1:
        raise ValueError(f"lr_backoff factor must be in (0, 1), got {factor}")
    before, after = [], []
    for o in optimizers:
        for g in o.param_groups:
            lr = g.get("lr")
            if isinstance(lr, torch.Tensor):
                before.append(float(lr))
                lr.mul_(factor)
                after.append(float(lr))
            elif lr is not None:
                before.append(float(lr))
                g["lr"] = lr * factor
                after.append(g["lr"])
            if "initial_lr" in g:
                g["initial_lr"] = g["initial_lr"] * factor
        for sched in _schedulers_of(o):
            if hasattr(sched, "base_lrs"):
                sched.base_lrs = [b * factor for b in sched.base_lrs]
    return {"lr_before": before, "lr_after": after, "factor": factor}


def _schedulers_of(opt) -> list:
    try:
        from torch.optim.lr_scheduler import LRScheduler
    except ImportError:  # older torch
        from torch.optim.lr_scheduler import _LRScheduler as LRScheduler
    return _referrers_of_type(opt, LRScheduler)


def _referrers_of_type(obj, cls) -> list:
    import gc
    out = []
    for r in gc.get_referrers(obj):
        if isinstance(r, dict):
            for rr in gc.get_referrers(r):
                if isinstance(rr, cls) and getattr(rr, "optimizer", None) is obj:
                    out.append(rr)
    return out


def clip_max_norm(history: Sequence[dict], default: float = 1.0) -> float:
    """A ``max_norm`` from the healthy gradient-norm history: its median (robust to the spike)."""
    norms = sorted(h["grad_norm"] for h in history
                   if h.get("grad_norm") is not None and math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0
                   and not h.get("skipped"))
    if not norms:
        return default
    return float(norms[len(norms) // 2])


def clip_grads(optimizers: Sequence[Any], max_norm: float) -> None:
    params = [p for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
    if params:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def upcast_module(module: torch.nn.Module, optimizers: Sequence[Any]) -> Dict[str, Any]:
    """Run ``module`` in float32 from now on: params + their optimizer state cast, inputs cast,
    autocast off inside. The output stays float32 (casting it back would overflow again)."""
    before = sorted({str(p.dtype) for p in module.parameters()})
    module.float()
    params = set(id(p) for p in module.parameters())
    for o in optimizers:
        for p, st in o.state.items():
            if id(p) in params:
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                        st[k] = v.float()
    if not getattr(module, "_nanguard_upcast", False):
        orig = module.forward

        def forward(*args, **kwargs):
            dev = next((p.device.type for p in module.parameters()), "cpu")
            args = tuple(_to32(a) for a in args)
            kwargs = {k: _to32(v) for k, v in kwargs.items()}
            with torch.autocast(device_type=dev, enabled=False):
                return orig(*args, **kwargs)

        module.forward = forward
        module._nanguard_upcast = True
    return {"dtype_before": before, "dtype_after": "float32"}


def _to32(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_to32(v) for v in x)
    return x


def find_module(roots: Sequence[torch.nn.Module], path: Optional[str]) -> Optional[torch.nn.Module]:
    """The module at ``path`` (as in named_modules()) under one of the roots."""
    if path is None:
        return None
    for r in roots:
        prefix = ""
        if ":" in path:  # "RootType:sub.path" when several roots were watched
            prefix, path_ = path.split(":", 1)
            if type(r).__name__ != prefix:
                continue
        else:
            path_ = path
        try:
            return r.get_submodule(path_) if path_ else r
        except AttributeError:
            continue
    return None


class DynamicLossScale:
    """Loss scaling for float16 training that has no GradScaler (the ``loss_scale`` action)."""

    def __init__(self, init: float = 2.0 ** 16, growth_interval: int = 2000) -> None:
        self.scale = init
        self.good_steps = 0
        self.growth_interval = growth_interval

    def unscale(self, optimizers: Sequence[Any]) -> bool:
        """Divide grads by the scale; True when they are finite (the step may go on)."""
        grads = [p.grad for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return True
        torch._foreach_mul_(grads, 1.0 / self.scale)
        ok = all(bool(torch.isfinite(g).all()) for g in grads)
        if ok:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2
        else:
            self.scale /= 2
            self.good_steps = 0
        return ok


# --------------------------------------------------------------------------- policy

class BudgetExceeded(Exception):
    pass


class RecoveryPolicy:
    """Chooses and applies recovery actions, within a budget; records every action."""

    def __init__(self, allowed: Optional[Sequence[str]] = None, *, auto: bool = True, max_recoveries: int = 10,
                 window: int = 100, max_consecutive: int = 3, snapshot_every: int = 10, keep_snapshots: int = 3,
                 lr_factor: float = 0.1, quiet: bool = False) -> None:
        bad = [a for a in (allowed or []) if a not in ACTIONS]
        if bad:
            raise ValueError(f"unknown recovery action(s) {bad}; choose from {', '.join(ACTIONS)}")
        self.allowed = list(allowed) if allowed else list(ACTIONS)
        self.auto = auto
        self.max_recoveries, self.window, self.max_consecutive = max_recoveries, window, max_consecutive
        self.snapshot_every, self.keep = snapshot_every, keep_snapshots
        self.lr_factor = lr_factor
        self.quiet = quiet
        self.snapshots: deque = deque(maxlen=keep_snapshots)
        self.events: List[Any] = []
        self.recovery_steps: List[int] = []
        self.clip_norm: Optional[float] = None
        self.loss_scaler: Optional[DynamicLossScale] = None
        self.quarantined: List[int] = []
        self.first_cause: Optional[Dict[str, Any]] = None

    @classmethod
    def from_spec(cls, spec: Any) -> "RecoveryPolicy":
        """``"auto"``, ``"skip_step,clip"``, a list of action names, or a RecoveryPolicy."""
        if isinstance(spec, RecoveryPolicy):
            return spec
        if spec is True or spec == "auto":
            return cls()
        if isinstance(spec, str):
            spec = [s.strip() for s in spec.split(",") if s.strip()]
        if isinstance(spec, (list, tuple)):
            return cls(allowed=list(spec))
        raise ValueError(f"recover must be 'auto', a comma list or a list of actions, got {spec!r}")

    # ---------------------------------------------------------------- budget
    def _check_budget(self, step: int) -> Optional[str]:
        recent = [s for s in self.recovery_steps if s > step - self.window]
        if len(recent) >= self.max_recoveries:
            return (f"recovery budget exhausted: {len(recent)} recoveries in the last {self.window} steps "
                    f"(limit {self.max_recoveries})")
        run = 1
        for s in reversed(self.recovery_steps):
            if s == step - run:
                run += 1
            else:
                break
        if run > self.max_consecutive:
            return (f"the failure recurred {run} steps in a row (limit {self.max_consecutive}): a deterministic "
                    f"bug, not a rare bad batch; recovery would only hide it")
        return None

    def choose(self, category: str) -> List[str]:
        acts = AUTO.get(category, ["skip_step"])
        return [a for a in acts if a in self.allowed]

    # ---------------------------------------------------------------- snapshots
    def maybe_snapshot(self, step: int, modules, optimizers, scaler, loss: Optional[float]) -> None:
        if "rollback" not in self.allowed or self.snapshot_every <= 0 or step % self.snapshot_every:
            return
        if loss is not None and not math.isfinite(loss):
            return
        snap = Snapshot(step, modules, optimizers, scaler, loss)
        if snap.finite():
            self.snapshots.append(snap)

    def best_snapshot(self) -> Optional[Snapshot]:
        """The kept snapshot with the lowest recorded loss (a divergence may have begun before the last one)."""
        good = [s for s in self.snapshots if s.finite()]
        if not good:
            return None
        with_loss = [s for s in good if s.loss is not None and math.isfinite(s.loss)]
        if with_loss:
            return min(with_loss, key=lambda s: (s.loss, -s.step))
        return good[-1]

    # ---------------------------------------------------------------- apply
    def apply(self, event, *, step: int, modules, optimizers, scaler, roots, history) -> Optional[Dict[str, Any]]:
        """Apply the actions for ``event``. Returns the recovery record, or None to stop (budget/no action)."""
        cat = (event.cause or {}).get("category", "other")
        why = self._check_budget(step)
        if why:
            event.cause.setdefault("evidence", {})["recovery_stopped"] = why
            return None
        actions = self.choose(cat) if self.auto else [a for a in self.allowed if a in ("skip_step",)]
        if not actions:
            return None
        done: Dict[str, Any] = {}
        names = []
        for a in actions:
            if a == "rollback":
                snap = self.best_snapshot()
                if snap is None:
                    if cat in ("param_corruption", "optimizer_numerics"):
                        return None  # nothing healthy to go back to
                    continue
                snap.restore(modules, optimizers, scaler)
                done["rollback"] = {"to_step": snap.step, "snapshot_bytes": snap.nbytes}
                names.append("rollback")
            elif a == "clip":
                self.clip_norm = clip_max_norm(history)
                done["clip"] = {"max_norm": self.clip_norm}
                names.append("clip")
            elif a == "lr_backoff":
                done["lr_backoff"] = lr_backoff(optimizers, self.lr_factor)
                names.append("lr_backoff")
            elif a == "upcast":
                mod = find_module(roots, (event.origin or {}).get("module"))
                if mod is None:
                    continue
                done["upcast"] = dict(upcast_module(mod, optimizers), module=(event.origin or {}).get("module"))
                names.append("upcast")
            elif a == "loss_scale":
                self.loss_scaler = self.loss_scaler or DynamicLossScale()
                done["loss_scale"] = {"scale": self.loss_scaler.scale}
                names.append("loss_scale")
        if not names and "skip_step" not in self.allowed:
            return None
        done["skip_step"] = skip_step(optimizers)
        names.append("skip_step")
        samples = (event.origin or {}).get("source_rows") or (event.origin or {}).get("samples")
        if cat == "bad_input_data" and samples:
            self.quarantined.extend(int(s) for s in samples if isinstance(s, int))
            done["quarantined_samples"] = list(samples)
        self.recovery_steps.append(step)
        rec = {"action": "+".join(_order(names)), "ok": True, "actions": done}
        event.recovery = rec
        self.events.append(event)
        if not self.quiet:
            from .report import print_line
            print_line(f"recovered at step {step}: {cat} -> {rec['action']} "
                       f"({len(self.recovery_steps)} recoveries so far)")
        return rec

    def before_update(self, optimizers) -> bool:
        """Called right before each optimizer update: clipping and loss-scale unscaling."""
        ok = True
        if self.loss_scaler is not None:
            ok = self.loss_scaler.unscale(optimizers)
            if not ok:
                skip_step(optimizers)
        if ok and self.clip_norm is not None:
            clip_grads(optimizers, self.clip_norm)
        return ok

    # ---------------------------------------------------------------- Guard adapter
    def bind_guard(self, guard) -> None:
        self.quiet = self.quiet or guard.quiet

    def before_step(self, guard) -> None:
        step = guard.monitor.steps_watched
        last = guard.monitor.history.last()
        self.maybe_snapshot(step, [guard.model], guard.optimizers, guard.scaler, last.loss if last else None)

    def after_step(self, guard) -> None:
        pass

    def decide(self, guard, event) -> Optional[str]:
        rec = self.apply(event, step=event.step, modules=[guard.model], optimizers=guard.optimizers,
                         scaler=guard.scaler, roots=[guard.model],
                         history=guard.monitor.history.raw_dicts())
        return "skip" if rec else None

    # ---------------------------------------------------------------- Watcher adapter (nanguard run)
    def attach(self, watcher) -> None:
        watcher.policy = self


def _order(names: List[str]) -> List[str]:
    order = {a: i for i, a in enumerate(("rollback", "upcast", "lr_backoff", "clip", "loss_scale", "skip_step"))}
    return sorted(dict.fromkeys(names), key=lambda a: order.get(a, 99))
