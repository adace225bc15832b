"""Evaluation and inference outside a training step: checked, and localized in-process.

:class:`EvalCheck` works for the :class:`~nanguard.pytorch.watch.Watcher`:

* **module outputs**: the outputs of an outermost module call under ``no_grad``/``inference_mode``/
  ``eval()`` are checked (one sync per such call); a non-finite output is an ``eval`` event, and
  that one module call is replayed at once under the op recorder (same arguments, same RNG state,
  same grad mode) to find the op and the line that made it;
* **values read by the script**: ``Tensor.item``, ``Tensor.tolist`` and ``float(tensor)`` are
  wrapped; a non-finite number read from a tensor with no autograd history (evaluation metrics,
  inference scores, an NLL computed under ``no_grad``; never the training loss, whose check is the
  step's) is an ``eval`` event at the user's line that read it. The number is already on the host:
  this adds no sync, only one Python wrapper per call;
* **the evaluation tape**: after an outermost module call under ``no_grad`` (and from the start of
  a script until it first trains or calls a module), the torch calls the script makes are recorded
  on a small ring (:class:`~nanguard.pytorch.tape.StepTape` in inference mode, at most
  ``_RING_CALLS`` calls per module call), so the event of a value read is replayed from the
  calls that made it: the op and line where NaN/Inf appeared outside any module.
* **reads inside a training step**: a value read (no autograd history) while grad is on and the step
  has inputs the check has not read yet (a training forward's batch, a loss) is often a term of the
  loss being built (actor-critic's normalized returns turned into a target with ``torch.tensor([R])``:
  the target's ``float()``). Its event is held until the step's check: a step that fails is the
  training event (its phase, op and line) and the held read is dropped; a step that passes lets the
  read through as an ``eval`` event (at the update, :meth:`suspend`, or at the next read of a later step).

Events are counted by evaluation call (``detected.eval_call``) and keep the training step count.
"""
from __future__ import annotations

import inspect
import math
import sys
import time
import warnings
from collections import deque
from typing import Any, Deque, Dict, Optional

import torch

from ..core.events import Detection
from .detect import all_finite, is_checkable, tensors_in
from .tape import StepTape, rng_now, set_rng

__all__ = ["EvalCheck"]

_TAPE_CALL = StepTape.call.__code__  # (on_read: a read made again by the tape's handler)


def _own_step_reads() -> list:
    """torch.optim's single-tensor optimizers read each parameter's step counter every update through
    ``torch.optim.optimizer._get_value`` (``x.item()``), which would call the read check's wrapper once
    a parameter. The modules that import it get one calling torch's own ``item`` instead (the same
    value; under ``torch.compile`` and TorchScript, torch's function): (module, theirs, ours) for each,
    put back at uninstall. A torch without that function: none (the update puts ``item`` back)."""
    base = sys.modules.get("torch.optim.optimizer")
    orig = getattr(base, "_get_value", None)
    if orig is None:
        return []
    item = torch._C.TensorBase.item

    def _get_value(x):
        if not torch.jit.is_scripting():  # (TorchScript drops this branch: scripted code gets torch's)
            if isinstance(x, torch.Tensor) and not torch.compiler.is_compiling():
                return item(x)
        return orig(x)
    out = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.optim.") and mod is not base and getattr(mod, "_get_value", None) is orig:
            mod._get_value = _get_value
            out.append((mod, orig, _get_value))
    return out


_OWN_TYPES: Dict[type, bool] = {}


def _torch_optimizer(opt: Any) -> bool:
    """``opt`` is one of torch.optim's own optimizer classes (not a subclass defined elsewhere)."""
    t = type(opt)
    own = _OWN_TYPES.get(t)
    if own is None:
        own = _OWN_TYPES[t] = t.__module__.startswith("torch.optim")
    return own


# EvalCheck._suspended while an optimizer updates (the wrappers in place ignore what they read then)
_ITEM = ("item put back",)
_IGNORED = ("wrappers kept",)


def optimised_input(args: tuple) -> bool:
    """An input of an outermost call is being optimised through it (a frozen network in eval mode scoring an
    image or a generator's output that requires grad: neural style transfer, a perceptual loss): with
    gradients on, the call is part of a training step, not an evaluation. (Callers test
    ``torch.is_grad_enabled() and (module.training or optimised_input(args))``: no call on a training step.)"""
    return any(t.requires_grad for t in tensors_in(args))


class EvalCheck:
    def __init__(self, watcher: Any) -> None:
        self.w = watcher
        self.calls = 0                     # outermost evaluation module calls so far
        self._rng: Any = None
        self._last: Optional[Dict[str, Any]] = None   # the failing call (or value read), kept for its replay
        self._orig: Dict[str, Any] = {}
        self._had: Dict[str, bool] = {}
        self._wrapped: Dict[str, Any] = {}
        self._suspended: Any = False  # while an optimizer updates: _ITEM (torch's item put back) or _IGNORED
        self._update_code: Any = None  # the code of the step function of the optimizer that is updating
        self._held: Optional[tuple] = None  # (detection, tensor) of a read inside an open training step
        self._optim: list = []  # (torch.optim module, its _get_value, ours) while installed
        # (step, loss value as read back, a weak reference to the norm the script's clip returned then) of the
        # latest training failure
        self._failed: Optional[tuple] = None
        self._failed_steps: Deque[int] = deque(maxlen=8)  # the steps of the latest training failures
        self.masked_modules: set = set()  # module types whose -inf outputs a replay proved an intentional mask

    def install(self) -> None:
        """Wrap ``Tensor.item``, ``Tensor.tolist`` and ``Tensor.__float__`` (values read by the script)."""
        if self._orig:
            return
        check = self

        def wrap(name: str) -> Any:
            orig = getattr(torch.Tensor, name)

            def read(t, *a, **k):
                v = orig(t, *a, **k)
                # finite first: optimizers read their step counters with .item() on every parameter
                if (v.__class__ is float and math.isfinite(v)) or _all_finite(v):
                    return v
                if not check._suspended and not check.busy and t.grad_fn is None and not t.requires_grad \
                        and t.is_floating_point() \
                        and not torch.compiler.is_compiling():
                    check.on_read(t, name, v)
                return v
            read.__name__, read.__qualname__, read.__doc__ = orig.__name__, orig.__qualname__, orig.__doc__
            return orig, read

        for name in _READS:
            self._had[name] = name in torch.Tensor.__dict__
            orig, read = wrap(name)
            self._orig[name], self._wrapped[name] = orig, read
            setattr(torch.Tensor, name, read)
        self._optim = _own_step_reads()

    def uninstall(self) -> None:
        self._restore()
        for mod, orig, own in self._optim:
            if mod.__dict__.get("_get_value") is own:
                mod._get_value = orig
        self._orig, self._wrapped, self._suspended, self._optim = {}, {}, False, []

    def _restore(self) -> None:
        for name, orig in self._orig.items():
            if self._had.get(name):
                setattr(torch.Tensor, name, orig)
            else:
                try:
                    delattr(torch.Tensor, name)
                except AttributeError:
                    pass

    def suspend(self, opt: Any = None) -> None:
        """While an optimizer updates, its reads are no evaluation values: they are ignored until
        :meth:`resume` (after the update, or at the next module call or backward if the update raised).
        A single-tensor optimizer reads each parameter's step counter with ``.item()`` every update.
        ``opt`` one of torch.optim's own: those reads already skip the wrapper (:func:`_own_step_reads`),
        nothing is put back. Any other: torch's own ``item`` is put back for the update; only ``item``
        (setting ``__float__`` on ``torch.Tensor`` rebuilds every subclass's number slots), and each
        put-back costs the update's tensor method lookups afterwards (~45 K instructions). The methods
        are the class's: a value another thread reads during that update is not checked."""
        if self._held is not None:  # the step's check passed (a failing one stopped or recovered before)
            self.settle()
        try:  # the optimizer's own step function (torch wraps it for its hooks)
            self._update_code = inspect.unwrap(type(opt).step).__code__ if opt is not None else None
        except Exception:
            self._update_code = None
        if self._wrapped and not self._suspended:
            if self._optim and _torch_optimizer(opt):
                self._suspended = _IGNORED  # its step counters are read with torch's own item (_own_step_reads)
                return
            read = self._wrapped.get("item")
            # only where the wrapper is still in place: a patch made over it (a sync counter's) stays
            if read is not None and torch.Tensor.__dict__.get("item") is read:
                torch.Tensor.item = self._orig["item"]
                self._suspended = _ITEM
            else:
                self._suspended = _IGNORED

    def resume_if_raised(self) -> None:
        """A module call or backward while suspended: the update raised (its post hook never ran) and is over,
        unless it is still running and calls the model itself (a natural-gradient step's Fisher-vector
        products): its own reads stay ignored then."""
        code = self._update_code
        f = sys._getframe(2) if code is not None else None
        while f is not None:
            if f.f_code is code:
                return
            f = f.f_back
        self.resume()

    def resume(self) -> None:
        if self._suspended:
            put_back, self._suspended = self._suspended is _ITEM, False
            if put_back and torch.Tensor.__dict__.get("item") is self._orig["item"]:
                torch.Tensor.item = self._wrapped["item"]

    @property
    def busy(self) -> bool:
        return self.w.busy

    # ------------------------------------------------------------------ values read by the script
    def on_read(self, t: torch.Tensor, how: str, value: Any) -> None:
        w = self.w
        if w.disabled or w._replaying:
            return
        caller = sys._getframe(2)
        if caller.f_code is _TAPE_CALL:
            # the step tape's handler calls the method again for the script's own read (the wrapper is
            # the class's method, so torch hands it to the mode): that outer read is the one reported
            return
        f = self._failed
        if f is not None and t.numel() == 1 and not w.monitor.step_open() and (
                (f[2] is not None and f[2]() is t) or (w.monitor.steps_watched <= f[0] + 1 and _first_bad(value) == f[1])):
            # the failed step's own numbers read back after it: its loss (a callback's outputs["loss"].item()),
            # the norm the script's clip returned for it (a Trainer logs grad_norm steps later)
            return
        tape = w.tape
        user = tape.frames.site_of(caller)[0] if tape is not None else None
        det = Detection(w.monitor.steps_watched, "eval",
                        {"read": f"Tensor.{how}", "value": _first_bad(value), "shape": list(t.shape),
                         "file": user[0] if user else None, "line": user[1] if user else None,
                         "eval_call": max(self.calls - 1, 0)})
        if self._held is not None and self._held[0].step != det.step:
            self.settle()  # held in an earlier step (one with no optimizer update to settle it)
        if torch.is_grad_enabled() and w.monitor.step_open():
            if self._held is None:  # the first read of the step: settled by the step's check
                self._held = (det, t)
            return
        self._last = {"read": t}
        w._handle(self._update_made(det), None)

    def _update_made(self, det: Detection) -> Detection:
        """A non-finite evaluation value computed from weights the last update made non-finite (its check is read
        at the next step's sync, after this value): that update's failure (a custom optimizer's 0/0), not an
        evaluation's ('could not reproduce')."""
        post = self.w._guarded(self.w.monitor.flush)
        return post if post is not None else det

    def note_failure(self, det: Detection) -> None:
        """A training step failed (reported, or recovered and skipped): its loss read back once the step is
        over is that failure, not an evaluation's."""
        if det.phase == "eval":
            return
        loss = det.detected.get("loss") if isinstance(det.detected, dict) else None
        bad = _first_bad(loss) if isinstance(loss, float) else loss if isinstance(loss, str) else None
        clips = getattr(self.w, "clips", None)
        self._failed = (det.step, bad, getattr(clips, "returned", None))
        self._failed_steps.append(det.step)

    def settle(self) -> None:
        """The step's check is done (or the run ends): a read held in the step (see the module docstring)
        is dropped when the step failed (a training event at its step), else reported now."""
        held, self._held = self._held, None
        if held is None:
            return
        det, t = held
        w = self.w
        if getattr(w, "_skip_current", None) or det.step in self._failed_steps or \
                any(d.step == det.step and d.phase != "eval" for d in w.detections):
            return  # the step failed: reported (warn mode), or recovered and its update skipped
        self._last = {"read": t}
        w._handle(self._update_made(det), None)

    # ------------------------------------------------------------------ intentional masks
    def masked(self, det: Detection, loc: Optional[Dict[str, Any]] = None) -> bool:
        """An evaluation output whose non-finite values are -inf the program wrote on purpose (an actor's
        invalid actions, ``masked_fill(~valid, -inf)``, handed to a ``Categorical``) is information, not a
        failure: with ``loc``, when its replay reproduced them, no NaN among them, from a non-finite
        constant (not an op that made them); without, when the same module's output was proven so before
        (no replay again). Such a detection goes to the report's information rows; returns whether it did."""
        d = det.detected
        if d.get("output_nan") or "module" not in d:
            return False
        o = ((loc or {}).get("localization") or {}).get("origin") or {}
        if loc is None:
            if d["module"] not in self.masked_modules:
                return False
            d["intentional_mask"] = "as in this module's earlier call"
        else:
            out = o.get("output") or {}
            if not (loc.get("reproduced") and o.get("kind") == "constant" and not out.get("nan")
                    and not out.get("posinf")):
                return False
            self.masked_modules.add(d["module"])
            d["intentional_mask"] = f"{o.get('file')}:{o.get('line')}"
        det.info_only = True
        self.w.info.append(det)
        return True

    # ------------------------------------------------------------------ module outputs
    def root_pre(self, module: torch.nn.Module, args: tuple) -> None:
        """An evaluation call starts (the watcher calls this only for those): its RNG state, for a replay."""
        self._rng = rng_now()

    def output(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Optional[Detection]:
        self.calls += 1
        ts = tensors_in(output)
        flag = all_finite(ts)
        if flag is None or bool(flag):
            return None
        nan = sum(int(torch.isnan(t).sum()) for t in ts if is_checkable(t))
        inf = sum(int(torch.isinf(t).sum()) for t in ts if is_checkable(t))
        mon = self.w.monitor
        bad_params = mon.names.nonfinite_params([[p for p in module.parameters() if is_checkable(p)]])
        self._last = {"module": module, "args": args, "kwargs": dict(kwargs or {}), "rng": self._rng,
                      "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled()}
        return self._update_made(Detection(mon.steps_watched, "eval",
                                           {"module": type(module).__name__, "output_nan": nan, "output_inf": inf,
                                            "nonfinite_params": bad_params[:20], "grad_enabled": torch.is_grad_enabled(),
                                            "training": module.training, "eval_call": self.calls - 1}))

    def replay(self, make_recorder: Any) -> Optional[Dict[str, Any]]:
        """Replay the failing evaluation call under a recorder (from ``make_recorder(roots)``), or the
        calls the evaluation tape recorded for a non-finite value the script read."""
        last, self._last = self._last, None
        if last is None:
            return None
        if "read" in last:
            return self._replay_read(last["read"], make_recorder)
        t0 = time.perf_counter()
        module = last["module"]
        after = rng_now()
        buffers = list(module.buffers())
        saved = [b.detach().clone() for b in buffers]
        rec = make_recorder([module])
        try:
            if last["rng"] is not None:
                set_rng(last["rng"])
            with self.w.quiet(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rec.start()
                try:
                    ctx = torch.inference_mode() if last["inference"] else torch.set_grad_enabled(last["grad"])
                    with ctx:
                        out = module(*last["args"], **last["kwargs"])
                    for t in tensors_in(out):
                        rec.mark_loss(t)
                finally:
                    rec.stop()
            res = rec.result()
        except Exception as e:
            return {"method": "replay-eval", "reproduced": False, "error": f"{type(e).__name__}: {e}"[:300],
                    "seconds": round(time.perf_counter() - t0, 4)}
        finally:
            with torch.no_grad():
                for b, s in zip(buffers, saved):
                    b.copy_(s)
            set_rng(after)
        return {"method": "replay-eval", "reproduced": bool(res.get("reproduced")), "localization": res,
                "seconds": round(time.perf_counter() - t0, 4)}

    def _replay_read(self, t: torch.Tensor, make_recorder: Any) -> Dict[str, Any]:
        rep = self.w.read_replay(t)
        if rep is None:
            return {"method": "replay-eval", "reproduced": False, "reason": self.w.replay_unavailable}
        out = rep.run(recorder=make_recorder(list(rep.roots)))
        res = {"method": "replay-eval", "reproduced": bool(out.get("reproduced")),
               "localization": out.get("localization"), "seconds": out.get("seconds")}
        if not res["reproduced"]:
            res["reason"] = out.get("error") or "the replayed calls gave a finite value"
        return res


_READS = ("item", "tolist", "__float__")


def _all_finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        try:  # a flat list of numbers (what a check's tolist() reads every step): one C loop
            return all(map(math.isfinite, v))
        except (TypeError, OverflowError):  # nested lists (or complex numbers): element by element
            return all(_all_finite(x) for x in v)
    return True


def _first_bad(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, list):
        for x in v:
            b = _first_bad(x)
            if isinstance(b, str):
                return b
    return None

