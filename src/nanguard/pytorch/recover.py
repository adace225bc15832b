"""Stage 4, recover: diagnosis-driven actions that keep a run alive, loudly.

Actions (each a small function over the training objects):

* ``skip_step``  - drop the failing step's update: its gradients are discarded, so
  the weights and the optimizer state are untouched (for parameters trained by
  hand, without an optimizer, the gradients are zeroed instead). Buffers that
  the failing forward changed (BatchNorm statistics) are put back from the
  snapshot of the step's start, when one was kept.
* ``rollback``   - restore model (parameters and buffers), optimizer state,
  GradScaler and RNG from an in-memory snapshot, then skip the failing step.
  For a divergence (exploding gradients, learning rate too high) the target is
  the most recent snapshot whose own step had a loss within 50% of the best kept
  one and a gradient norm that was not a spike (> 10x the healthy median): the
  state before the divergence began. Otherwise (corrupted parameters, optimizer
  numerics, non-finite buffers after a bad batch) it is the most recent finite
  snapshot.
* ``lr_backoff`` - multiply every param group's ``lr`` by ``lr_factor`` (0.1), or
  lower, to half the stability limit when the diagnosis estimated one.
* ``clip``       - clip the gradient norm before every later update, at the 25th
  percentile of the healthy gradient norms in the history (spikes and skipped
  steps left out); a recurrence while clipping halves it.
* ``upcast``     - run the origin module (the report's ``origin.module``) in
  float32 from now on: its parameters and their optimizer state are cast, its
  inputs cast, autocast disabled inside it, and its output **kept float32**
  (casting it back would overflow again). A module further down that holds
  float16/bfloat16 parameters and receives a float32 input is upcast the same
  way when that first happens (recorded in the same recovery).
* ``loss_scale`` - float16 training without a GradScaler: the loss is multiplied
  by a dynamic scale before backward and the gradients divided by it before the
  check; an overflow halves the scale (and skips the step), 1000 good steps
  double it.

Policy (``recover="auto"``): the diagnosis' category picks the actions (see
``AUTO``; anything not listed, e.g. a rare log/sqrt/div domain error on some
batch, gets ``skip_step``). With a list of allowed actions the same table is
used, restricted to them (an action that is not allowed or not possible is
left out; a plain skip is used only if ``skip_step`` is allowed). Whatever the
category, weights that are already non-finite are never trained on: they are
rolled back to a healthy snapshot, or the run stops.

Budget: at most ``max_recoveries`` (10) recoveries in ``window`` (100) steps and
at most ``max_consecutive`` (3) failing steps in a row; for bad input data
(batches skipped without touching the weights) at most ``max_data_skips`` (50)
in the window and ``max_consecutive_data`` (8) in a row. Past it the run stops with the full diagnosis (``NonFiniteError``, or
exit status 3 for ``nanguard run``): a deterministic bug that recurs every step
is reported, not skipped forever. A plain rollback (nothing else changed) whose
replay of the same state, data and RNG fails again at the same point stops too. A recovery is never silent: each is an event
in the report (``recovery`` = ``{"action": ..., "ok": true, "actions": {...}}``),
a one-line notice on stderr, and the run ends with a recovery summary line.

Snapshots (only when ``rollback`` is allowed): CPU copies of every parameter,
buffer and optimizer-state tensor, plus the GradScaler state and the RNG state
(torch CPU/CUDA, ``random``, numpy). One snapshot costs
``sum(numel * element_size)`` of those tensors (e.g. a float32 model trained with
Adam: 12 bytes per parameter; the report gives ``snapshot_bytes``). At most
``1 + keep_snapshots + recent_snapshots`` are kept (defaults: the first step's,
one every ``snapshot_every=10`` steps keeping 3, and the last 2 steps'; the
per-step tier is dropped for models whose snapshot is over ``recent_max_bytes``,
256 MiB), i.e. at most 6x (3x above 256 MiB) the model + optimizer state, in
host memory; taking one is a device-to-host copy of that size (every step for
the per-step tier, else every 10th step); the per-step tier refills its oldest
snapshot in place (``Snapshot.refill``), so after the first steps it allocates
nothing. Under ``nanguard run`` the snapshot of a step is taken when that step
starts (its first training-mode forward of a watched model, else its backward or
its optimizer step), so edits the script makes between steps (a projection, a
re-normalisation) are part of it; and, once, just before the first update.

LR schedulers are never stepped or rewound by nanguard. A skipped or rolled-back
step still counts in the scheduler's own counter (the script calls
``scheduler.step()`` as usual, as with GradScaler's own skips). A rollback
restores the optimizer's per-parameter state (moments, step counts) but keeps
the current hyperparameters of every param group (``lr``, momentum...), which
belong to the scheduler. ``lr_backoff`` also scales the schedulers' ``base_lrs``
(and ``max_lrs``/``min_lrs``) and the groups' ``initial_lr``/``max_lr``/``min_lr``
of the schedulers attached to the optimizer, so later scheduler steps keep the
lower rate. GradScaler: under ``nanguard run`` a skipped step is left to the
script's ``scaler.update()`` (which sees the step's inf and halves the scale, as
for its own skips); ``Guard`` skips the step without an update (scale unchanged);
a rollback restores the scale and growth tracker first.

With no failure, recovery mode changes nothing: snapshots only copy, and no
action is armed, so training is bit-for-bit the same as without nanguard.
"""
from __future__ import annotations

import copy
import math
import weakref
from collections import deque
from typing import Any, Dict, List, Optional, Sequence

import torch

ACTIONS = ("skip_step", "rollback", "lr_backoff", "clip", "upcast", "loss_scale")

# category -> actions, in order. Unlisted categories get skip_step (a rare domain
# error on some batch), bounded by the budget. The failing update is always dropped.
AUTO: Dict[str, List[str]] = {
    "bad_input_data": ["skip_step"],
    "low_precision_overflow": ["upcast"],
    "low_precision_underflow": ["upcast", "loss_scale"],  # loss_scale: only if upcast is impossible
    "gradient_explosion": ["rollback", "clip"],
    "lr_too_high": ["rollback", "lr_backoff"],
    "param_corruption": ["rollback"],
    "optimizer_numerics": ["rollback"],
    "loss_scale_collapse": [],  # the scaler is already skipping: recovery cannot help, stop
}
DEFAULT_ACTIONS = ["skip_step"]
# Categories whose rollback target is the healthiest snapshot (a divergence may have
# begun steps before the failure); for the others, the most recent finite snapshot.
_DIVERGENCE = ("gradient_explosion", "lr_too_high")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- snapshots

class Snapshot:
    """CPU copy of model(s), optimizer(s), GradScaler and RNG state at one step boundary."""

    def __init__(self, step: int, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any],
                 scaler: Any = None, loss: Optional[float] = None) -> None:
        from .rng import capture_rng
        self.step = step
        self.prev_loss = loss  # loss of the step before (a fallback when the history has no record)
        self.modules = [(id(m), {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()})
                        for m in modules]
        self.optimizers = [(id(o), _cpu_copy(o.state_dict())) for o in optimizers]
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None and _enabled(scaler) else None
        self.rng = capture_rng(plain=False)
        self.nbytes = sum(_nbytes(d) for _, d in self.modules) + sum(_nbytes(d) for _, d in self.optimizers)
        self._finite: Optional[bool] = None

    def refill(self, step: int, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any],
               scaler: Any = None, loss: Optional[float] = None) -> bool:
        """Become the snapshot of ``step`` by copying into this snapshot's own tensors (no allocation).

        Used for the per-step tier, whose oldest snapshot is dropped anyway: the copy is the same
        bytes, minus a fresh allocation (and, with the default glibc allocator, its page faults) of
        the whole model + optimizer state every step. False (nothing usable left) when the
        structure changed (new optimizer state, other shapes): the caller takes a fresh one.
        """
        from .rng import capture_rng
        mods = [(id(m), m.state_dict()) for m in modules]
        opts = [(id(o), o.state_dict()) for o in optimizers]
        if [i for i, _ in mods] != [i for i, _ in self.modules] or \
                [i for i, _ in opts] != [i for i, _ in self.optimizers]:
            return False
        with torch.no_grad():
            if not all(_copy_into(dst, src) for (_, dst), (_, src) in zip(self.modules, mods)) or \
                    not all(_copy_into(dst, src) for (_, dst), (_, src) in zip(self.optimizers, opts)):
                return False
        self.step, self.prev_loss = step, loss
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None and _enabled(scaler) else None
        self.rng = capture_rng(plain=False)
        self._finite = None
        return True

    def finite(self) -> bool:
        if self._finite is None:
            self._finite = _all_finite(v for _, d in self.modules for v in d.values())
        return self._finite

    def restore_buffers(self, modules: Sequence[torch.nn.Module]) -> int:
        """Put the buffers (e.g. BatchNorm running statistics) back; returns how many were restored."""
        saved, n = dict(self.modules), 0
        with torch.no_grad():
            for m in modules:
                sd = saved.get(id(m))
                if sd is None:
                    continue
                for name, b in m.named_buffers():
                    if name in sd and b is not None:
                        b.copy_(sd[name].to(b.device, b.dtype))
                        n += 1
        return n

    def repair_nonfinite(self, modules: Sequence[torch.nn.Module]) -> int:
        """Put back only the non-finite elements of the parameters/buffers (from this snapshot); returns
        how many elements were restored, or -1 when a non-finite element has no finite saved value."""
        saved, n = dict(self.modules), 0
        plan = []
        for m in modules:
            sd = saved.get(id(m))
            if sd is None:
                continue
            own = m.state_dict(keep_vars=True)
            for k, t in own.items():
                t = t.data if isinstance(t, torch.nn.Parameter) else t
                if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.device.type == "meta":
                    continue
                bad = ~torch.isfinite(t)
                if not bool(bad.any()):
                    continue
                v = sd.get(k)
                if v is None or v.shape != t.shape:
                    return -1
                v = v.to(t.device, t.dtype)
                if not bool(torch.isfinite(v[bad]).all()):
                    return -1
                plan.append((t, bad, v))
        with torch.no_grad():
            for t, bad, v in plan:
                t[bad] = v[bad]
                n += int(bad.sum())
        return n

    def restore(self, modules: Sequence[torch.nn.Module], optimizers: Sequence[Any], scaler: Any = None) -> None:
        """Put everything back exactly as it was (optimizer hyperparameters excepted, see module doc)."""
        from .rng import restore_rng
        saved = dict(self.modules)
        with torch.no_grad():
            for m in modules:
                sd = saved.get(id(m))
                if sd is None:
                    continue
                own = m.state_dict(keep_vars=True)
                for k, v in sd.items():
                    if k in own:
                        t = own[k]
                        t = t.data if isinstance(t, torch.nn.Parameter) else t
                        t.copy_(v.to(t.device, t.dtype))
        saved_o = dict(self.optimizers)
        for o in optimizers:
            sd = saved_o.get(id(o))
            if sd is None:
                continue
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
            o.load_state_dict(_clone(sd))  # a copy: load_state_dict may alias the tensors it is given
            for g, h in zip(o.param_groups, hyper):  # the scheduler's (and lr_backoff's) hyperparameters
                g.update(h)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        restore_rng(self.rng)


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


def _all_finite(tensors) -> bool:
    from .detect import finite_flag  # one aminmax pass per large tensor, no full-size temporaries
    return all(bool(finite_flag(v)) for v in tensors
               if (v.is_floating_point() or v.is_complex()) and v.device.type != "meta")


def _copy_into(dst: Any, src: Any) -> bool:
    """Copy ``src`` (a state dict) into the same-shaped ``dst`` in place; False on any mismatch
    (``dst`` is then partly overwritten and must be dropped)."""
    if isinstance(src, torch.Tensor):
        if not isinstance(dst, torch.Tensor) or dst.shape != src.shape or dst.dtype != src.dtype:
            return False
        dst.copy_(src.detach())
        return True
    if isinstance(src, dict):
        if not isinstance(dst, dict) or dst.keys() != src.keys():
            return False
        for k, v in src.items():
            if isinstance(v, (torch.Tensor, dict, list, tuple)):
                if not _copy_into(dst[k], v):
                    return False
            else:
                dst[k] = copy.deepcopy(v)
        return True
    if isinstance(src, list):
        if not isinstance(dst, list) or len(dst) != len(src):
            return False
        for i, v in enumerate(src):
            if isinstance(v, (torch.Tensor, dict, list, tuple)):
                if not _copy_into(dst[i], v):
                    return False
            else:
                dst[i] = copy.deepcopy(v)
        return True
    if isinstance(src, tuple):  # immutable: only tensors inside can be refilled
        return isinstance(dst, tuple) and len(dst) == len(src) and all(
            _copy_into(d, v) if isinstance(v, (torch.Tensor, dict, list, tuple)) else d == v
            for d, v in zip(dst, src))
    return dst == src


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
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


def state_finite(modules: Sequence[torch.nn.Module], optimizers: Sequence[Any] = ()) -> bool:
    """True when every floating parameter and buffer of ``modules`` and every parameter of ``optimizers``
    is finite (one pass, at a failure only)."""
    ts = [t for m in modules for t in list(m.parameters()) + list(m.buffers())]
    ts += [p for o in optimizers for g in o.param_groups for p in g["params"]]
    with torch.no_grad():
        return _all_finite(t for t in ts if isinstance(t, torch.Tensor))


def _opt_state_finite(optimizers: Sequence[Any]) -> bool:
    """True when every floating tensor of the optimizers' per-parameter state is finite."""
    for o in optimizers:
        for st in getattr(o, "state", {}).values():
            for v in (st.values() if isinstance(st, dict) else ()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    return False
    return True


# --------------------------------------------------------------------------- actions

def skip_step(optimizers: Sequence[Any], modules: Sequence[torch.nn.Module] = ()) -> Dict[str, Any]:
    """Drop the gradients, so the coming ``optimizer.step()`` changes nothing.

    Optimizer-managed gradients are set to None (built-in optimizers then skip the
    parameter entirely: no momentum, no weight decay). Without an optimizer (updates
    written by hand from ``p.grad``) the gradients of ``modules`` are zeroed instead.
    """
    n = 0
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad = None
                    n += 1
    if not optimizers:
        with torch.no_grad():
            for m in modules:
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
                        n += 1
    return {"grads_dropped": n}


def lr_backoff(optimizers: Sequence[Any], factor: float = 0.1) -> Dict[str, Any]:
    """Scale every param group's learning rate (and attached schedulers' base rates) by ``factor``."""
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
            for k in ("initial_lr", "max_lr", "min_lr"):
                if isinstance(g.get(k), (int, float)):
                    g[k] = g[k] * factor
        for sched in _schedulers_of(o):
            for attr in ("base_lrs", "max_lrs", "min_lrs", "_last_lr"):
                v = getattr(sched, attr, None)
                if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
                    setattr(sched, attr, [x * factor for x in v])
    return {"lr_before": before, "lr_after": after, "factor": factor}


def _schedulers_of(opt) -> list:
    from torch.optim import lr_scheduler as ls
    classes = tuple(c for c in (getattr(ls, "LRScheduler", None), getattr(ls, "_LRScheduler", None),
                                getattr(ls, "ReduceLROnPlateau", None)) if c is not None)
    return _referrers_of_type(opt, classes)


def _referrers_of_type(obj, cls) -> list:
    import gc
    out = []
    for r in gc.get_referrers(obj):
        if isinstance(r, cls) and getattr(r, "optimizer", None) is obj and r not in out:
            out.append(r)  # Python >= 3.11 may keep instance attributes without a __dict__ object
        elif isinstance(r, dict):
            for rr in gc.get_referrers(r):
                if isinstance(rr, cls) and getattr(rr, "optimizer", None) is obj and rr not in out:
                    out.append(rr)
    return out


def healthy_grad_norms(history: Sequence[dict]) -> List[float]:
    """Gradient norms of the steps that were applied, finite, and not spikes (> 10x the median)."""
    norms = [h["grad_norm"] for h in history
             if isinstance(h.get("grad_norm"), (int, float)) and math.isfinite(h["grad_norm"])
             and h["grad_norm"] > 0 and not h.get("skipped")]
    if not norms:
        return []
    med = sorted(norms)[len(norms) // 2]
    return sorted(n for n in norms if n <= 10 * med)


def clip_max_norm(history: Sequence[dict], default: float = 1.0, quantile: float = 0.25) -> float:
    """A ``max_norm`` from the healthy gradient-norm history: its lower quartile (robust to the spike,
    and tight enough that a run sitting next to a cliff stays off it)."""
    norms = healthy_grad_norms(history)
    if not norms:
        return default
    return float(norms[int(quantile * (len(norms) - 1))])


def clip_grads(optimizers: Sequence[Any], max_norm: float) -> None:
    params = [p for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
    if params:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def upcast_module(module: torch.nn.Module, optimizers: Sequence[Any]) -> Dict[str, Any]:
    """Run ``module`` in float32 from now on: params + their optimizer state cast, inputs cast,
    autocast off inside. The output stays float32 (casting it back would overflow again)."""
    before = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()})
    module.float()  # in place on the same Parameter objects: the optimizer keeps them
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
            args = tuple(_to32(a) for a in args)
            kwargs = {k: _to32(v) for k, v in kwargs.items()}
            dev = next((t.device.type for t in list(module.parameters())[:1]), None) or _device_of(args) or "cpu"
            with torch.autocast(device_type=dev, enabled=False):
                return orig(*args, **kwargs)

        module.forward = forward
        module._nanguard_upcast = True
    return {"dtype_before": before, "dtype_after": "float32"}


def _device_of(args) -> Optional[str]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


def _to32(x):
    if isinstance(x, torch.Tensor) and x.dtype in _LOW_PRECISION:
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_to32(v) for v in x)
    if isinstance(x, dict):
        return {k: _to32(v) for k, v in x.items()}
    return x


def _wide_float_input(args) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.float64):
            return True
        if isinstance(a, (list, tuple)) and _wide_float_input(a):
            return True
    return False


def find_module(roots: Sequence[torch.nn.Module], path: Optional[str]) -> Optional[torch.nn.Module]:
    """The module at ``path`` (as in named_modules()) under one of the roots."""
    if path is None:
        return None
    for r in roots:
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
    """Loss scaling for float16 training that has no GradScaler (the ``loss_scale`` action).

    ``scale`` multiplies the loss before backward; :meth:`unscale` divides the
    gradients before the check (no sync). An overflow (:meth:`backoff`) halves the
    scale; every ``growth_interval`` good steps double it.
    """

    def __init__(self, init: float = 2.0 ** 8, growth_interval: int = 1000) -> None:
        self.scale = float(init)
        self.good_steps = 0
        self.growth_interval = growth_interval

    def unscale(self, optimizers: Sequence[Any]) -> None:
        grads = [p.grad for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def backoff(self) -> None:
        self.scale /= 2
        self.good_steps = 0

    def good_step(self) -> None:
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2


# --------------------------------------------------------------------------- policy

class RecoveryPolicy:
    """Chooses and applies recovery actions, within a budget; records every action."""

    def __init__(self, allowed: Optional[Sequence[str]] = None, *, auto: bool = True, max_recoveries: int = 10,
                 window: int = 100, max_consecutive: int = 3, max_data_skips: int = 50,
                 max_consecutive_data: int = 8,
                 snapshot_every: int = 10, keep_snapshots: int = 3, recent_snapshots: int = 2,
                 recent_max_bytes: int = 256 * 2 ** 20, lr_factor: float = 0.1, clip_quantile: float = 0.25,
                 quiet: bool = False) -> None:
        bad = [a for a in (allowed or []) if a not in ACTIONS]
        if bad:
            raise ValueError(f"unknown recovery action(s) {bad}; choose from {', '.join(ACTIONS)}")
        if not 0 < lr_factor < 1:
            raise ValueError(f"lr_factor must be in (0, 1), got {lr_factor}")
        self.allowed = list(allowed) if allowed else list(ACTIONS)
        self.auto = auto
        self.max_recoveries, self.window, self.max_consecutive = max_recoveries, window, max_consecutive
        self.max_data_skips, self.max_consecutive_data = max_data_skips, max_consecutive_data
        self.snapshot_every, self.keep, self.recent_n = snapshot_every, keep_snapshots, recent_snapshots
        self.recent_max_bytes = recent_max_bytes
        self.lr_factor, self.clip_quantile = lr_factor, clip_quantile
        self.quiet = quiet
        self.initial: Optional[Snapshot] = None
        self.snapshots: deque = deque(maxlen=max(keep_snapshots, 1))  # periodic tier
        if keep_snapshots <= 0:
            self.snapshot_every = 0
        self.recent: deque = deque(maxlen=max(recent_snapshots, 1))
        self._recent_on = recent_snapshots > 0
        self._last_snap_step: Optional[int] = None
        self.events: List[Any] = []
        self.recovery_steps: List[int] = []
        self.data_steps: List[int] = []
        self.counts: Dict[str, int] = {}
        self.clip_norm: Optional[float] = None
        self.loss_scaler: Optional[DynamicLossScale] = None
        self.quarantined: List[int] = []
        self.quarantined_batch_rows: List[int] = []
        self.upcast_modules: List[str] = []
        self.stopped: Optional[str] = None
        self.stopped_step: Optional[int] = None
        self._last_rec: Optional[tuple] = None
        self._last_rollback: Optional[Dict[str, Any]] = None
        self._element_repairs: set = set()  # steps whose param corruption was repaired element-wise
        self._version = 0  # bumped by every action that changes how training runs (lr, clip, dtype, scale)
        self._hooks: list = []
        self._watcher: Any = None

    @classmethod
    def from_spec(cls, spec: Any) -> "RecoveryPolicy":
        """``"auto"``, ``"skip_step,clip"``, a list of action names, or a RecoveryPolicy."""
        if isinstance(spec, RecoveryPolicy):
            return spec
        if spec is True or spec == "auto":
            return cls()
        if isinstance(spec, str):
            spec = [s.strip() for s in spec.split(",") if s.strip()]
        if isinstance(spec, (list, tuple)) and spec:
            return cls(allowed=list(spec))
        raise ValueError(f"recover must be 'auto', a comma list or a list of actions, got {spec!r}")

    # ---------------------------------------------------------------- budget
    def _check_budget(self, step: int, category: str) -> Optional[str]:
        data = category == "bad_input_data"
        steps = self.data_steps if data else self.recovery_steps
        limit = self.max_data_skips if data else self.max_recoveries
        recent = [s for s in steps if s > step - self.window]
        if len(recent) >= limit:
            what = "bad-data skips" if data else "recoveries"
            return (f"recovery budget exhausted: {len(recent)} {what} in the last {self.window} steps "
                    f"(limit {limit})")
        done = set(self.recovery_steps) | set(self.data_steps)
        run = 1
        while step - run in done:
            run += 1
        limit = self.max_consecutive_data if data else self.max_consecutive
        if run > limit:
            what = "batches in a row held non-finite data" if data else "the failure recurred"
            return (f"{what} {run} steps in a row (limit {limit}): " +
                    ("most of the data is bad, skipping would train on what is left" if data else
                     "a deterministic bug, not a rare bad batch; recovery would only hide it"))
        return None

    def _check_replay(self, step: int, category: str) -> Optional[str]:
        """A rollback that changed nothing else replays the same state and data (the RNG is restored too):
        the same failure at the same point of the replay means a rollback alone cannot fix it."""
        last = self._last_rollback
        if last is None or last["version"] != self._version or last["category"] != category:
            return None
        failed, target = last["step"], last["to_step"]
        if step - failed <= (failed - target) + 2:
            return (f"rolled back to step {target} at step {failed}, and replaying the same state and data "
                    f"failed again at step {step}: a rollback alone cannot fix this")
        return None

    def choose(self, category: str) -> List[str]:
        """The actions ``auto`` takes for ``category``, restricted to the allowed ones (skip_step is implied)."""
        acts = AUTO.get(category, DEFAULT_ACTIONS)
        return [a for a in acts if a in self.allowed]

    # ---------------------------------------------------------------- snapshots
    def all_snapshots(self) -> List[Snapshot]:
        seen, out = set(), []
        for s in ([self.initial] if self.initial else []) + list(self.snapshots) + \
                (list(self.recent) if self._recent_on else []):
            if id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return sorted(out, key=lambda s: s.step)

    def snapshot_bytes(self) -> int:
        return sum(s.nbytes for s in self.all_snapshots())

    def maybe_snapshot(self, step: int, modules, optimizers, scaler, loss: Optional[float] = None) -> None:
        """Take the snapshot of the state at the start of ``step`` if a tier wants it."""
        if "rollback" not in self.allowed or not modules or self._last_snap_step == step:
            return
        periodic = self.snapshot_every > 0 and step % self.snapshot_every == 0
        first = self.initial is None
        if not (periodic or first or self._recent_on):
            return
        reuse = self._reusable(periodic or first)
        if reuse is None:
            snap = Snapshot(step, modules, optimizers, scaler, loss)
        elif not state_finite(modules):  # checked before overwriting the oldest one
            self._last_snap_step = step
            return
        elif reuse.refill(step, modules, optimizers, scaler, loss):
            snap = reuse
            snap._finite = True  # a copy of the state just checked
        else:
            self.recent.remove(reuse)  # partly overwritten: not a snapshot of anything any more
            snap = Snapshot(step, modules, optimizers, scaler, loss)
        self._last_snap_step = step
        if not snap.finite():
            return
        if first:
            self.initial = snap
        if periodic:
            self.snapshots.append(snap)
        if self._recent_on:
            if snap.nbytes > self.recent_max_bytes:
                self._recent_on = False
                self.recent.clear()
            else:
                self.recent.append(snap)

    def _reusable(self, kept_elsewhere: bool) -> Optional[Snapshot]:
        """The per-step tier's oldest snapshot, when the next one pushes it out and no other tier
        holds it: its tensors can take the new state (Snapshot.refill)."""
        if kept_elsewhere or not self._recent_on or len(self.recent) < self.recent.maxlen:
            return None
        old = self.recent[0]
        if old is self.initial or any(old is s for s in self.snapshots):
            return None
        return old

    def best_snapshot(self, history: Sequence[dict] = (), step: Optional[int] = None,
                      divergence: bool = True) -> Optional[Snapshot]:
        """The snapshot to roll back to.

        ``divergence``: the most recent snapshot whose own step's loss (from the
        history) is within 50% of the lowest kept one and whose gradient norm was
        not a spike (> 10x the healthy median); else the most recent finite one.
        """
        snaps = [s for s in self.all_snapshots() if s.finite() and (step is None or s.step <= step)]
        if not snaps:
            return None
        if not divergence:
            return snaps[-1]
        rec: Dict[int, dict] = {}
        for h in history:
            rec.setdefault(h.get("step"), h)
        norms = healthy_grad_norms(history)
        med = norms[len(norms) // 2] if norms else None

        def health(s: Snapshot):
            h = rec.get(s.step)
            if h is None:
                return None
            loss, gn = h.get("loss"), h.get("grad_norm")
            if not isinstance(loss, (int, float)) or not math.isfinite(loss):
                return False
            if isinstance(gn, (int, float)) and (not math.isfinite(gn) or (med and gn > 10 * med)):
                return False
            return loss

        scored = [(s, health(s)) for s in snaps]
        known = [(s, l) for s, l in scored if l is not None and l is not False]
        if known:
            best = min(l for _, l in known)
            ok = [s for s, l in known if l <= best + 0.5 * abs(best)]
            return ok[-1]
        unknown = [s for s, l in scored if l is None and (step is None or s.step < step)]
        return unknown[-1] if unknown else None

    def _forget_after(self, step: int) -> None:
        """After a rollback: the snapshots of the abandoned trajectory go."""
        for dq in (self.snapshots, self.recent):
            keep = [s for s in dq if s.step <= step]
            dq.clear()
            dq.extend(keep)
        self._last_snap_step = None

    # ---------------------------------------------------------------- apply
    def apply(self, event, *, step: int, modules, optimizers, scaler, roots, history) -> Optional[Dict[str, Any]]:
        """Apply the actions for ``event``. Returns the recovery record, or None to stop (budget/no action)."""
        cause = event.cause if isinstance(event.cause, dict) else {}
        event.cause = cause
        cat = cause.get("category") or "other"
        origin = event.origin or {}
        modules, optimizers, roots = list(modules), list(optimizers), list(roots)
        if self._last_rec is not None and self._last_rec[0] == step:
            # A second optimizer of the step that already recovered: drop its update too.
            skip_step(optimizers, modules)
            return self._last_rec[1]
        why = self._check_budget(step, cat) or self._check_replay(step, cat)
        if why:
            return self._stop(event, step, why)
        params_ok = state_finite(modules, optimizers)
        acts = self.choose(cat) if self.auto else []
        if not params_ok and "rollback" in self.allowed and "rollback" not in acts and cat != "loss_scale_collapse":
            acts = ["rollback"] + acts  # never train on non-finite weights
        if self.loss_scaler is not None and event.phase == "backward" and params_ok:
            acts = ["loss_scale"]  # our own loss scale overflowed: back off (and skip), like GradScaler
        done: Dict[str, Any] = {}
        names: List[str] = []
        notes: List[str] = []
        for a in acts:
            if a == "rollback":
                snap = self.best_snapshot(history, step, divergence=cat in _DIVERGENCE)
                if snap is None:
                    notes.append("no healthy snapshot to roll back to")
                    continue
                if cat == "param_corruption" and event.phase == "params" and not params_ok \
                        and self._written_outside_update(cause) and _opt_state_finite(optimizers):
                    # Values made non-finite between updates (an in-place edit of the weights, not the
                    # optimizer): put back only those elements, keeping the rest of the edit and the
                    # training since the snapshot. Falls back to a full rollback if that is impossible.
                    n = snap.repair_nonfinite(modules)
                    if n > 0 and state_finite(modules, optimizers):
                        done["rollback"] = {"to_step": snap.step, "steps_lost": 0, "elements_only": True,
                                            "elements_restored": n, "snapshot_bytes": snap.nbytes,
                                            "snapshots_kept_bytes": self.snapshot_bytes()}
                        names.append("rollback")
                        params_ok = True
                        self._element_repairs.add(step)
                        continue
                snap.restore(modules, optimizers, scaler)
                self._forget_after(snap.step)
                done["rollback"] = {"to_step": snap.step, "steps_lost": step - snap.step,
                                    "snapshot_bytes": snap.nbytes, "snapshots_kept_bytes": self.snapshot_bytes()}
                names.append("rollback")
            elif a == "clip":
                if self.clip_norm is not None:  # clipping did not prevent it: tighten
                    self.clip_norm = self.clip_norm / 2
                    done["clip"] = {"max_norm": self.clip_norm, "tightened": True}
                else:
                    self.clip_norm = clip_max_norm(history, quantile=self.clip_quantile)
                    done["clip"] = {"max_norm": self.clip_norm, "from": f"{self.clip_quantile:.0%} quantile of "
                                    f"{len(healthy_grad_norms(history))} healthy gradient norms"}
                names.append("clip")
            elif a == "lr_backoff":
                factor = self._backoff_factor(cause, optimizers)
                done["lr_backoff"] = lr_backoff(optimizers, factor)
                names.append("lr_backoff")
            elif a == "upcast":
                path = origin.get("module")
                mod = find_module(roots, path)
                if mod is None:
                    notes.append("no origin module to upcast" if path is None else f"module {path!r} not found")
                    continue
                rec = dict(upcast_module(mod, optimizers), module=path)
                rec["downstream"] = []
                self._guard_downstream(roots, mod, optimizers, rec)
                self.upcast_modules.append(path)
                done["upcast"] = rec
                names.append("upcast")
            elif a == "loss_scale":
                own_overflow = self.loss_scaler is not None and event.phase == "backward"
                underflow = cat == "low_precision_underflow" and event.phase == "backward" and "upcast" not in names
                if not (own_overflow or underflow) or not optimizers or (scaler is not None and _enabled(scaler)):
                    continue
                if self.loss_scaler is None:
                    self.loss_scaler = DynamicLossScale()
                else:
                    self.loss_scaler.backoff()
                done["loss_scale"] = {"scale": self.loss_scaler.scale}
                names.append("loss_scale")
        if not params_ok and "rollback" not in names:
            return self._stop(event, step, "the parameters or buffers are non-finite and "
                              + ("rollback is not allowed" if "rollback" not in self.allowed
                                 else "there is no healthy snapshot to roll back to")
                              + ": training on them would only spread the NaN")
        if not names and ("skip_step" not in self.allowed or AUTO.get(cat) == []):
            why = (f"no allowed recovery action for {cat}" + (f" ({'; '.join(notes)})" if notes else ""))
            return self._stop(event, step, why)
        done["skip_step"] = skip_step(optimizers, modules)
        if "rollback" not in names:  # the failing forward's buffer updates (BatchNorm statistics) go too
            this = next((s for s in self.all_snapshots() if s.step == step), None)
            if this is not None and this.finite():
                done["skip_step"]["buffers_restored"] = this.restore_buffers(modules)
        names.append("skip_step")
        if cat == "bad_input_data":
            self._quarantine(event, done)
        if notes:
            done["notes"] = notes
        if any(a in names for a in ("lr_backoff", "clip", "upcast", "loss_scale")):
            self._version += 1
        if set(names) == {"rollback", "skip_step"} and not done["rollback"].get("elements_only"):
            # a pure rollback: the replay will be identical
            self._last_rollback = {"step": step, "to_step": done["rollback"]["to_step"], "category": cat,
                                   "version": self._version}
        (self.data_steps if cat == "bad_input_data" and names == ["skip_step"] else self.recovery_steps).append(step)
        self.counts[cat] = self.counts.get(cat, 0) + 1
        n = len(self.recovery_steps) + len(self.data_steps)
        rec = {"action": "+".join(_order(names)), "ok": True, "actions": done, "category": cat,
               "recovery_number": n}
        event.recovery = rec
        self.events.append(event)
        self._last_rec = (step, rec)
        if not self.quiet:
            from ..core.render.terminal import print_line
            extra = ""
            if "rollback" in done and done["rollback"].get("elements_only"):
                extra += (f", {done['rollback']['elements_restored']} non-finite element(s) restored from "
                          f"step {done['rollback']['to_step']}'s snapshot")
            elif "rollback" in done:
                extra += f", back to step {done['rollback']['to_step']}"
            if "lr_backoff" in done:
                extra += f", lr {_fmt(done['lr_backoff']['lr_before'])} -> {_fmt(done['lr_backoff']['lr_after'])}"
            if "clip" in done:
                extra += f", clip grad norm at {done['clip']['max_norm']:.3g}"
            if "upcast" in done:
                extra += f", module {done['upcast']['module']!r} now float32"
            if "quarantine" in done and done["quarantine"].get("rows"):
                extra += f", quarantined rows {done['quarantine']['rows']}"
            print_line(f"recovered at step {step}: {cat} -> {rec['action']}{extra} (recovery {n})")
        return rec

    def _written_outside_update(self, cause: Dict[str, Any]) -> bool:
        """The replay traced the corrupted parameter to a write by the program between updates (an
        in-place edit under no_grad, not the optimizer), or this is a recurrence of such a failure."""
        ev = cause.get("evidence") or {}
        wb = (ev.get("preexisting") or {}).get("written_by") or {}
        if wb.get("op") and wb.get("stage") != "optimizer":
            return True
        return ev.get("same_as_step") in self._element_repairs

    def _stop(self, event, step: int, why: str) -> None:
        cause = event.cause if isinstance(event.cause, dict) else {}
        cause.setdefault("evidence", {})["recovery_stopped"] = why
        self.stopped, self.stopped_step = why, step
        if not self.quiet:
            from ..core.render.terminal import print_line
            print_line(f"recovery stopped at step {step}: {why}")
        return None

    def _backoff_factor(self, cause: Dict[str, Any], optimizers) -> float:
        """``lr_factor``, or lower: to half the stability limit when the diagnosis estimated one."""
        factor = self.lr_factor
        ev = cause.get("evidence") or {}
        limit = ev.get("estimated_stable_lr_limit")
        lrs = [float(g["lr"]) for o in optimizers for g in o.param_groups
               if isinstance(g.get("lr"), (int, float, torch.Tensor))]
        if isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0 and lrs and max(lrs) > 0:
            factor = min(factor, 0.5 * limit / max(lrs))
        return max(factor, 1e-4)

    def _quarantine(self, event, done: Dict[str, Any]) -> None:
        origin = event.origin or {}
        ev = (event.cause or {}).get("evidence") or {}
        if ev.get("same_as_step") is not None:
            done["quarantine"] = {"same_as_step": ev["same_as_step"],
                                  "note": "not re-localized: assumed to be the same bad sample(s)"}
            return
        rows = [int(r) for r in (origin.get("source_rows") or []) if isinstance(r, int)]
        batch_rows = [int(r) for r in (origin.get("samples") or []) if isinstance(r, int)]
        q: Dict[str, Any] = {}
        if rows:
            q["rows"] = rows
            self.quarantined.extend(r for r in rows if r not in self.quarantined)
        if batch_rows:
            q["batch_rows"] = batch_rows
            self.quarantined_batch_rows.extend(batch_rows)
        if origin.get("tensor"):
            q["tensor"] = origin.get("tensor")
        done["quarantine"] = q
        done["quarantined_samples"] = rows or batch_rows

    def _guard_downstream(self, roots, upcast: torch.nn.Module, optimizers, rec: Dict[str, Any]) -> None:
        """Modules holding float16/bfloat16 parameters that receive the float32 output later: upcast them
        too, when that first happens (a pre-forward hook, only on those modules)."""
        inside = set(id(m) for m in upcast.modules())
        names = {}
        for r in roots:
            for name, m in r.named_modules():
                names.setdefault(id(m), name)
        pol = weakref.ref(self)
        for r in roots:
            for m in r.modules():
                if id(m) in inside or getattr(m, "_nanguard_upcast", False) or getattr(m, "_nanguard_dshook", None):
                    continue
                if not any(p.dtype in _LOW_PRECISION for p in m.parameters(recurse=False)):
                    continue

                def hook(mod, args, _name=names.get(id(m), "?")):
                    if getattr(mod, "_nanguard_upcast", False) or not _wide_float_input(args):
                        return None
                    upcast_module(mod, optimizers)
                    rec["downstream"].append(_name)
                    p = pol()
                    if p is not None:
                        p.upcast_modules.append(_name)
                    h = getattr(mod, "_nanguard_dshook", None)
                    if h is not None:
                        h.remove()
                    return tuple(_to32(a) for a in args)

                m._nanguard_dshook = m.register_forward_pre_hook(hook)
                self._hooks.append(m._nanguard_dshook)

    # ---------------------------------------------------------------- per-step hooks
    def scale_loss(self, loss):
        """The tensor to call backward on: the loss times the dynamic loss scale, once that is on."""
        if self.loss_scaler is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return loss
        return loss * self.loss_scaler.scale

    def before_check(self, optimizers) -> None:
        """Right before the per-step check: unscale the gradients of the dynamic loss scale (no sync)."""
        if self.loss_scaler is not None:
            self.loss_scaler.unscale(optimizers)

    def before_update(self, optimizers) -> bool:
        """Right before each optimizer update of a step that passed the check: clipping."""
        if self._watcher is not None and self.initial is None and optimizers:
            w = self._watcher()
            if w is not None:  # nanguard run: the state before the very first update
                self.maybe_snapshot(w.monitor.step_of(optimizers[0]), list(w.monitor.roots), w.optimizers(),
                                    w.scalers[0] if w.scalers else None)
        if self.loss_scaler is not None:
            self.loss_scaler.good_step()
        if self.clip_norm is not None:
            clip_grads(optimizers, self.clip_norm)
        return True

    # ---------------------------------------------------------------- end of run
    def summary(self) -> Optional[str]:
        """One line on what recovery did (None when it did nothing)."""
        if not self.events and not self.stopped:
            return None
        acts: Dict[str, int] = {}
        for e in self.events:
            for a in (e.recovery or {}).get("action", "").split("+"):
                if a:
                    acts[a] = acts.get(a, 0) + 1
        steps = [e.step for e in self.events]
        n = len(self.events)
        s = (f"recovery: {n or 'no'} recover{'y' if n == 1 else 'ies'}"
             + (f" ({', '.join(f'{a} x{c}' for a, c in acts.items())})" if acts else "")
             + (f" at step{'s' if n > 1 else ''} {', '.join(map(str, steps[:12]))}"
                f"{'...' if n > 12 else ''}" if steps else ""))
        if self.quarantined:
            s += f"; quarantined dataset rows {self.quarantined[:20]}"
        elif self.quarantined_batch_rows:
            s += f"; bad batch rows {sorted(set(self.quarantined_batch_rows))[:20]}"
        if self.upcast_modules:
            s += f"; float32 modules {self.upcast_modules}"
        if self.clip_norm is not None:
            s += f"; clipping at {self.clip_norm:.3g}"
        if self.loss_scaler is not None:
            s += f"; loss scale {self.loss_scaler.scale:g}"
        kept = self.all_snapshots()
        if kept:
            s += f"; {len(kept)} snapshots kept, {_bytes(self.snapshot_bytes())}"
        if self.stopped:
            s += f"; then stopped at step {self.stopped_step} (recovery would not help: see above)"
        return s

    def print_summary(self) -> None:
        line = self.summary()
        if line and not self.quiet:
            from ..core.render.terminal import print_line
            print_line(line)

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
        hist = [h for h in guard.monitor.history.raw_dicts() if h["step"] < event.step]
        rec = self.apply(event, step=event.step, modules=[guard.model], optimizers=guard.optimizers,
                         scaler=guard.scaler, roots=[guard.model], history=hist)
        return "skip" if rec else None

    # ---------------------------------------------------------------- Watcher adapter (nanguard run)
    def attach(self, watcher) -> None:
        watcher.policy = self
        self._watcher = weakref.ref(watcher)


def _order(names: List[str]) -> List[str]:
    order = {a: i for i, a in enumerate(("rollback", "upcast", "lr_backoff", "clip", "loss_scale", "skip_step"))}
    return sorted(dict.fromkeys(names), key=lambda a: order.get(a, 99))


def _fmt(xs: List[float]) -> str:
    return ", ".join(f"{x:.3g}" for x in xs[:4]) + ("..." if len(xs) > 4 else "")


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
