"""Stage 2 driver: replay the failing step under op-level instrumentation.

Two ways, one recorder (:class:`nanguard.pytorch.locate.OpRecorder`):

* **Explicit API** (:class:`nanguard.Guard`): the guard has the step function,
  the batch and the RNG state of the step, and the parameters are still the
  pre-update ones when the check fails, so it re-runs the step in-process.
* **Zero-code** (``nanguard run``): the training step is inline code in the
  user's script and cannot be called again, so nanguard re-runs the script in a
  child process, from the same initial RNG state, counting steps exactly as the
  first run did, and arms the recorder at the start of the failing step. Cost:
  the script's run time up to the failing step, plus one instrumented step.
  Ops before that step run at full speed (only the cheap hooks are on).
  A non-deterministic script may not fail the same way: the report then says
  "could not reproduce" and gives no guessed origin.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .rng import capture_rng, restore_rng


# --------------------------------------------------------------------------- recorder factory


def make_recorder(roots, optimizers, named_params=None, named_buffers=None):
    """Build an OpRecorder for the given modules/optimizers (None if locate is unavailable)."""
    from .locate import OpRecorder
    params: Dict[str, torch.Tensor] = {} if named_params is None else named_params
    buffers: Dict[str, torch.Tensor] = {} if named_buffers is None else named_buffers
    fill_names(params, buffers, roots, optimizers)
    return OpRecorder(named_params=params, named_buffers=buffers, roots=list(roots),
                      optimizers=list(optimizers))


def fill_names(params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor], roots, optimizers) -> None:
    """Fill name -> tensor maps in place (the recorder may hold the same dicts)."""
    roots = list(roots)
    multi = len(roots) > 1
    for r in roots:
        prefix = (type(r).__name__ + ":") if multi else ""
        for n, p in r.named_parameters():
            params.setdefault(prefix + n, p)
        for n, b in r.named_buffers():
            buffers.setdefault(prefix + n, b)
    known = {id(p) for p in params.values()}
    for oi, opt in enumerate(optimizers):
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                if id(p) not in known:
                    params[f"optimizer{oi}.param_groups[{gi}][{pi}]"] = p


# --------------------------------------------------------------------------- zero-code child

CHILD_TIMEOUT_S = 600.0


def rerun_localize(script: str, argv: List[str], step: int, rng_file: Optional[str],
                   config: Dict[str, Any], timeout: float = CHILD_TIMEOUT_S,
                   bundle: Optional[str] = None, extra_env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Re-run ``script`` in a child process and localize step ``step``. Never raises."""
    t0 = time.time()
    fd, out = tempfile.mkstemp(prefix="nanguard-loc-", suffix=".json")
    os.close(fd)
    errf = out + ".stderr"
    cmd = [sys.executable, "-m", "nanguard.pytorch.replay", "--step", str(step), "--out", out,
           "--config", json.dumps(config)]
    if rng_file:
        cmd += ["--rng", rng_file]
    if bundle:
        cmd += ["--bundle", bundle]
    cmd += ["--", script] + list(argv)
    res: Dict[str, Any] = {"method": "rerun", "step": step}
    try:
        env = dict(os.environ)
        env["NANGUARD_REPLAY_CHILD"] = "1"
        env.update(extra_env or {})  # torch.distributed: the children's own rendezvous (pytorch.distributed)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(errf, "w") as ef:
            p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=ef, stdin=subprocess.DEVNULL,
                               timeout=timeout, cwd=os.getcwd(), env=env)
        res["returncode"] = p.returncode
        if os.path.getsize(out) > 0:
            with open(out) as f:
                res.update(json.load(f))
        else:
            res["error"] = "the re-run ended without reaching the failing step"
            res["stderr_tail"] = _tail(errf)
    except subprocess.TimeoutExpired:
        res["error"] = f"the re-run timed out after {timeout:.0f}s"
    except Exception as e:  # localization is best effort; detection already happened
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        for f in (out, errf):
            try:
                os.unlink(f)
            except OSError:
                pass
    res["seconds"] = round(time.time() - t0, 3)
    return res


def rerun_localize_all(det: Any, script: str, argv: Sequence[str], rng_file: Optional[str],
                       config: Dict[str, Any], bundle: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """``nanguard run``'s localization of ``det``, on every rank at once when distributed."""
    from .distributed import is_origin, rerun_env
    env = rerun_env()
    if env is None:
        return None
    return rerun_localize(script, list(argv), det.step, rng_file, config,
                          bundle=bundle if is_origin(det) else None, extra_env=env)


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _child_main(argv: List[str]) -> int:
    """``python -m nanguard.pytorch.replay --step N --out F [--rng R] -- script args``"""
    import argparse
    import runpy

    from ..core.config import GuardConfig
    from .watch import Watcher

    ap = argparse.ArgumentParser(prog="nanguard.pytorch.replay")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rng")
    ap.add_argument("--config", default="{}")
    ap.add_argument("--bundle", help="write a repro bundle of the failing step here")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    rest = a.rest[1:] if a.rest and a.rest[0] == "--" else a.rest
    script, args = rest[0], rest[1:]
    N = a.step
    cfg = json.loads(a.config)

    watcher = Watcher(GuardConfig(on_nonfinite="warn", **{k: v for k, v in cfg.items()
                                                          if k in ("min_loss_scale", "max_consecutive_skips",
                                                                   "param_check_every")}))
    state: Dict[str, Any] = {"rec": None, "params": {}, "buffers": {}, "t_arm": None, "pre": None,
                             "batch": None}

    def dump(payload: Dict[str, Any]) -> None:
        rec = state["rec"]
        if rec is not None:
            try:
                rec.stop()
            except Exception:
                pass
            fill_names(state["params"], state["buffers"], list(watcher.monitor.roots), _opts(watcher))
            try:
                payload["localization"] = rec.result()
            except Exception as e:
                payload["localization"] = None
                payload["error"] = f"recorder failed: {type(e).__name__}: {e}"
        if state["t_arm"] is not None:
            payload["instrumented_seconds"] = round(time.time() - state["t_arm"], 3)
        if a.bundle and payload.get("reproduced") and state["pre"] is not None:
            try:
                from .bundle import save_bundle
                det = payload.get("detection") or {}
                payload["bundle"] = save_bundle(a.bundle, step=N, phase=str(det.get("phase")),
                                                batch=state["batch"], config=cfg, **state["pre"])
            except Exception as e:
                payload["bundle_error"] = f"{type(e).__name__}: {e}"
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, default=str)
        os.replace(tmp, a.out)
        sys.stdout.flush()
        os._exit(0)

    def on_step_start(step: int) -> None:
        if step == N and state["rec"] is None:
            if a.bundle:
                state["pre"] = _pre_step_state(watcher)
            try:
                rec = make_recorder(list(watcher.monitor.roots), _opts(watcher), state["params"],
                                    state["buffers"])
                rec.start()
                rec.set_stage("forward")
                state["rec"], state["t_arm"] = rec, time.time()
            except Exception as e:
                dump({"reproduced": None, "error": f"could not arm the recorder: {type(e).__name__}: {e}"})
        elif step > N + 1:
            dump({"reproduced": False, "reason": f"step {N} ran again without a non-finite value"})

    def on_backward_begin(ts):
        rec = state["rec"]
        if rec is not None:
            for t in ts:
                rec.mark_loss(t)
            rec.set_stage("backward")

    def on_backward_end():
        if state["rec"] is not None:
            state["rec"].set_stage("forward")

    def on_optimizer_begin():
        if state["rec"] is not None:
            state["rec"].set_stage("optimizer")

    def on_detection(det, opt):
        if det.phase == "eval":
            return
        if det.step == N:
            dump({"reproduced": True, "detection": {"step": det.step, "phase": det.phase,
                                                    "detected": det.detected}})
        elif det.step < N:
            dump({"reproduced": False, "reason": f"the re-run failed earlier, at step {det.step} ({det.phase})"})

    watcher.on_step_start = on_step_start
    watcher.on_backward_begin = on_backward_begin
    watcher.on_backward_end = on_backward_end
    def on_optimizer_end():
        # With several optimizers (a GAN), the next model's forward follows this update within the
        # same iteration: record it as forward. (With one, the stage stays until the next backward,
        # which is how an update's non-finite output is read as an optimizer-phase sink.)
        if state["rec"] is not None and len(watcher.monitor.views) > 1:
            state["rec"].set_stage("forward")

    watcher.on_optimizer_begin = on_optimizer_begin
    watcher.on_optimizer_end = on_optimizer_end
    watcher.on_detection = on_detection

    if a.rng:
        restore_rng(torch.load(a.rng, weights_only=True))
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    watcher.install()
    from torch.nn.modules import module as mm

    def grab_batch(module, args):
        # The outermost module call of a training forward in the failing step: that is the batch.
        if state["rec"] is not None and state["batch"] is None and watcher._depth() == 1 \
                and torch.is_grad_enabled():
            state["batch"] = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in args]
    if a.bundle:
        mm.register_module_forward_pre_hook(grab_batch)
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        pass
    watcher.finish()
    dump({"reproduced": False, "reason": f"the re-run finished without a non-finite value at step {N}"})
    return 0


def _pre_step_state(watcher) -> Dict[str, Any]:
    """Model/optimizer/scaler/RNG state at the start of the failing step (for the repro bundle)."""
    roots = list(watcher.monitor.roots)
    model_state: Dict[str, torch.Tensor] = {}
    for r in roots:
        prefix = (type(r).__name__ + ":") if len(roots) > 1 else ""
        model_state.update({prefix + k: v.detach().clone() for k, v in r.state_dict().items()})
    scaler = watcher.scalers[0] if watcher.scalers else None
    return {"model_state": model_state, "optimizer_states": [o.state_dict() for o in _opts(watcher)],
            "scaler_state": scaler.state_dict() if scaler is not None else None, "rng": capture_rng()}


def _opts(watcher) -> list:
    return [v.opt_ref() for v in watcher.monitor.views.values() if v.opt_ref() is not None]


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
