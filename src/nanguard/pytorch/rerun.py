"""The localization re-run of ``nanguard run``: the child process that re-runs the script to step N.

``python -m nanguard.pytorch.rerun --step N --out F [--rng R] [--config JSON] [--bundle B] -- script args``

The script runs under the same global hooks as the first run (:class:`~nanguard.pytorch.watch.Watcher`),
from the same initial RNG state (``--rng``), counting steps the same way; at the
start of step N the op recorder is armed. The child writes one JSON object to
``--out`` and exits as soon as it knows the answer: ``reproduced`` true (with
the recorder's ``localization``) when step N fails again, false with a
``reason`` otherwise. The parent side is :func:`nanguard.pytorch.replay.rerun_localize`.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from typing import Any, Dict, List, Optional

import torch
from torch.nn.modules import module as torch_module

from ..core.config import GuardConfig
from ..core.events import Detection
from .bundle import save_bundle
from .observer import WatchObserver
from .replay import CHILD_CONFIG_KEYS, fill_names, make_recorder
from .rng import restore_rng
from .watch import Watcher
from .zerocode import pre_step_state

class RerunChild(WatchObserver):
    """Re-runs the script up to the failing step ``step`` and records that step's ops: the observer of
    the Watcher it builds (:class:`~nanguard.pytorch.observer.WatchObserver`)."""

    def __init__(self, step: int, out: str, config: Dict[str, Any], bundle: Optional[str] = None) -> None:
        self.step, self.out, self.config, self.bundle = step, out, config, bundle
        self.rec: Any = None
        self.params: Dict[str, torch.Tensor] = {}   # name -> tensor maps the recorder holds
        self.buffers: Dict[str, torch.Tensor] = {}
        self.t_arm: Optional[float] = None
        self.pre: Optional[Dict[str, Any]] = None   # the state at the start of step N (for the bundle)
        self.batch: Any = None
        self._data_pause: Any = None
        self.watcher = Watcher(GuardConfig(on_nonfinite="warn", **{k: v for k, v in config.items()
                                                                   if k in CHILD_CONFIG_KEYS}), observer=self)

    def run(self, script: str, args: List[str], rng_file: Optional[str]) -> int:
        if rng_file:
            restore_rng(torch.load(rng_file, weights_only=True))
        sys.argv = [script] + args
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        self.watcher.install()
        if self.bundle:
            torch_module.register_module_forward_pre_hook(self.grab_batch)
        try:
            runpy.run_path(script, run_name="__main__")
        except BaseException:
            pass
        self.watcher.finish()
        self.dump({"reproduced": False, "reason": f"the re-run finished without a non-finite value at step "
                                                  f"{self.step}"})
        return 0

    # ------------------------------------------------------------------ the Watcher's hooks
    @property
    def recorder(self) -> Any:
        """The op recorder armed at step N: its own reads of non-finite values are not evaluation
        events (they would fill the run's max_events before step N's detection, which would then be
        dropped)."""
        return self.rec

    def step_start(self, watcher: Any, step: int) -> None:
        N = self.step
        if step == N and self.rec is None:
            if self.bundle:
                self.pre = pre_step_state(self.watcher)
            try:
                rec = make_recorder(list(self.watcher.monitor.roots), self.watcher.optimizers(), self.params,
                                    self.buffers, data_rows=self.watcher.data.rows_of)
                rec.start()
                rec.set_stage("forward")
                self.rec, self.t_arm = rec, time.time()  # (``recorder``: the watcher's checks stand aside)
            except Exception as e:
                self.dump({"reproduced": None, "error": f"could not arm the recorder: {type(e).__name__}: {e}"})
        elif step > N + 1:
            self.dump({"reproduced": False, "reason": f"step {N} ran again without a non-finite value"})

    def data_begin(self, watcher: Any) -> None:  # a batch is data: the DataLoader runs unrecorded
        if self.rec is not None and self._data_pause is None:
            self._data_pause = self.rec.paused()
            self._data_pause.__enter__()

    def data_end(self, watcher: Any) -> None:
        if self._data_pause is not None:
            p, self._data_pause = self._data_pause, None
            p.__exit__(None, None, None)

    def backward_begin(self, watcher: Any, ts: List[torch.Tensor]) -> None:
        rec = self.rec
        if rec is not None:
            for t in ts:
                rec.mark_loss(t)
            rec.set_stage("backward")

    def backward_end(self, watcher: Any) -> None:
        if self.rec is not None:
            self.rec.set_stage("forward")

    def optimizer_begin(self, watcher: Any) -> None:
        if self.rec is not None:
            self.rec.set_stage("optimizer")

    def optimizer_end(self, watcher: Any) -> None:
        # With several optimizers (a GAN), the next model's forward follows this update within the
        # same iteration: record it as forward. (With one, the stage stays until the next backward,
        # which is how an update's non-finite output is read as an optimizer-phase sink.)
        if self.rec is not None and len(self.watcher.monitor.views) > 1:
            self.rec.set_stage("forward")

    def detection(self, watcher: Any, det: Detection, opt: Any) -> None:
        if det.phase == "eval":
            return
        if det.step == self.step:
            self.dump({"reproduced": True, "detection": {"step": det.step, "phase": det.phase,
                                                         "detected": det.detected}})
        elif det.step < self.step:
            self.dump({"reproduced": False,
                       "reason": f"the re-run failed earlier, at step {det.step} ({det.phase})"})

    def grab_batch(self, module: torch.nn.Module, args: Any) -> None:
        # The outermost module call of a training forward in the failing step: that is the batch.
        if self.rec is not None and self.batch is None and self.watcher._depth() == 1 \
                and torch.is_grad_enabled():
            self.batch = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in args]

    # ------------------------------------------------------------------ the answer
    def dump(self, payload: Dict[str, Any]) -> None:
        """Write the answer to ``--out`` and end the process (the rest of the script does not run)."""
        rec = self.rec
        if rec is not None:
            try:
                rec.stop()
            except Exception:
                pass
            fill_names(self.params, self.buffers, list(self.watcher.monitor.roots), self.watcher.optimizers())
            try:
                payload["localization"] = rec.result()
            except Exception as e:
                payload["localization"] = None
                payload["error"] = f"recorder failed: {type(e).__name__}: {e}"
        if self.t_arm is not None:
            payload["instrumented_seconds"] = round(time.time() - self.t_arm, 3)
        if self.bundle and payload.get("reproduced") and self.pre is not None:
            try:
                det = payload.get("detection") or {}
                payload["bundle"] = save_bundle(self.bundle, step=self.step, phase=str(det.get("phase")),
                                                batch=self.batch, config=self.config, **self.pre)
            except Exception as e:
                payload["bundle_error"] = f"{type(e).__name__}: {e}"
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, default=str)
        os.replace(tmp, self.out)
        sys.stdout.flush()
        os._exit(0)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanguard.pytorch.rerun")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rng")
    ap.add_argument("--config", default="{}")
    ap.add_argument("--bundle", help="write a repro bundle of the failing step here")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    rest = a.rest[1:] if a.rest and a.rest[0] == "--" else a.rest
    return RerunChild(a.step, a.out, json.loads(a.config), a.bundle).run(rest[0], rest[1:], a.rng)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
