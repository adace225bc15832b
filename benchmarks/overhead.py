"""nanguard overhead benchmark: step time, memory, time-to-diagnosis.

Run from the repository root::

    python -m benchmarks.overhead            # full run (~5 min on 2 CPU cores)
    python -m benchmarks.overhead --quick    # smoke run (~1.5 min; numbers are rough)
    python -m benchmarks.overhead --out /tmp/results.json --models gpt --skip memory

What it measures (BENCHMARKS.md has a real run and its reading):

1. **Step time.** For each model (MLP, small CNN, small GPT) ONE model and ONE
   AdamW optimizer are trained, in one process, under seven configurations
   that are interleaved: every round runs a block of each configuration (one
   untimed step, then ``--block`` timed steps) in a fresh seeded-random order.
   The headline is ``median(step time of config) / median(step time
   unguarded)``, with a 95% interval from resampling whole rounds; the
   per-round paired ratio and the 25th-percentile ratio are cross-checks.

   * ``unguarded``: zero_grad, forward+loss, backward, ``opt.step()``;
   * ``guard``: ``nanguard.Guard(model, opt, quiet=True).step(batch, loss_fn)``
     (localize on, never triggered);
   * ``syncfree``: the same with ``sync_free=True`` (no host read in a healthy step; the
     default on CUDA with fused optimizers; on the CPU a masked update, the flags read late);
   * ``zerocode``: the unguarded loop inside ``nanguard.watch(report=None,
     quiet=True)`` (the global hooks of ``nanguard run``);
   * ``anomaly``: the unguarded loop inside ``torch.autograd.detect_anomaly()``;
   * ``naive``: unguarded + ``for p in params: p.grad.isfinite().all().item()``;
   * ``scaler``: unguarded + ``torch._amp_foreach_non_finite_check_and_unscale_``
     on the grads with scale 1.0 and one ``.item()`` (what GradScaler does);
   * ``recover``: ``Guard(..., recover="auto")`` (rollback snapshots on).

   Shared-machine hygiene: before each block the benchmark waits (bounded) for
   other processes to leave the CPU, and blocks during which they used >= 5% of
   it are left out of the headline (chosen by that external signal, never by
   the step times); glibc is told to keep freed memory (``--no-mallopt`` to
   disable), so steps do not page-fault their activations back in.

2. **Memory.** (a) exact: every tensor the guard's own code allocates during a
   step is counted with a ``TorchDispatchMode`` active only inside the guard's
   hooks, plus what it keeps between steps (pending norms, step history);
   (b) end to end: the steady-state peak RSS (VmHWM, reset after warm-up) of a
   separate subprocess per configuration (unguarded / guard / guard with
   ``recover="auto"`` snapshots), minus the RSS after ``import torch``; glibc
   there returns every block >= 64 KiB to the OS on free, so RSS follows live
   tensor bytes; (c) the bytes and copy time of one rollback snapshot
   (``nanguard.pytorch.recover.Snapshot``, else ``deepcopy`` of the state dicts).

3. **Time to diagnosis** (GPT): a log of a zero in the loss at step k. Seconds
   from the start of the failing step to the finished report (Guard with
   localize=True, catching NonFiniteError), in units of one unguarded step,
   versus the usual alternative: re-running the training from the start under
   ``torch.autograd.detect_anomaly()`` until the failure reappears.

Never used as a test: timings here are measurements, not assertions.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from .timing import QUIET, CpuMeter, keep_freed_memory, ratios, round_bootstrap

THREADS = 2
# The transformer's budget (1.02x) is the tight one: its step-time rounds get twice the time, so its
# interval is ~1.4x narrower than with the same time as the others.
SECONDS_WEIGHT = {"gpt": 2.0}
CONFIGS = ["unguarded", "guard", "syncfree", "zerocode", "anomaly", "naive", "scaler", "recover"]
LABELS = {
    "unguarded": "unguarded",
    "guard": "nanguard Guard.step",
    "syncfree": "nanguard Guard.step, sync_free=True",
    "zerocode": "nanguard zero-code (watch)",
    "anomaly": "torch detect_anomaly",
    "naive": "naive per-param isfinite().item()",
    "scaler": "GradScaler-style foreach check",
    "recover": "nanguard Guard.step, recover='auto'",
}
MEM_CONFIGS = ["unguarded", "guard", "guard_snapshots"]


def _setup() -> None:
    torch.set_num_threads(THREADS)
    warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")
    warnings.filterwarnings("ignore", message=".*anomaly.*")


# =========================================================================== step time


class Runner:
    """One model + one optimizer, stepped under any of the configurations."""

    def __init__(self, bench) -> None:
        import nanguard

        self.bench = bench
        self.model = bench.model
        self.opt = bench.make_optimizer()
        self.loss_fn = bench.loss_fn
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.i = 0
        self.guard = nanguard.Guard(self.model, self.opt, quiet=True)  # localize=True by default
        self.rguard = None  # Guard(recover="auto"), made on first use (it keeps snapshots)
        self.sguard = None  # Guard(sync_free=True), made on first use
        self._found = torch.zeros(1)
        self._inv = torch.ones(1)
        self.steps = {
            "unguarded": lambda: self.plain(None),
            "guard": self.guarded,
            "syncfree": self.sync_free,
            "zerocode": lambda: self.plain(None),
            "anomaly": lambda: self.plain(None),
            "naive": lambda: self.plain(self.naive_check),
            "scaler": lambda: self.plain(self.scaler_check),
            "recover": self.recovering,
        }

    def batch(self):
        b = self.bench.batches[self.i % len(self.bench.batches)]
        self.i += 1
        return b

    # ---- the step bodies
    def plain(self, check: Optional[Callable[[], None]]) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.batch())
        loss.backward()
        if check is not None:
            check()
        self.opt.step()

    def guarded(self) -> None:
        self.guard.step(self.batch(), self.loss_fn)

    def sync_free(self) -> None:
        if self.sguard is None:
            import nanguard
            self.sguard = nanguard.Guard(self.model, self.opt, quiet=True, sync_free=True)
        self.sguard.step(self.batch(), self.loss_fn)

    def recovering(self) -> None:
        if self.rguard is None:
            import nanguard
            self.rguard = nanguard.Guard(self.model, self.opt, quiet=True, recover="auto")
        self.rguard.step(self.batch(), self.loss_fn)

    def naive_check(self) -> None:
        for p in self.params:
            if p.grad is not None and not p.grad.isfinite().all().item():
                raise FloatingPointError("non-finite gradient")

    def scaler_check(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        self._found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found, self._inv)
        if self._found.item():
            raise FloatingPointError("non-finite gradient")

    # ---- a block of one configuration
    def context(self, cfg: str):
        if cfg == "zerocode":
            import nanguard
            return nanguard.watch(report=None, quiet=True)
        if cfg == "anomaly":
            return torch.autograd.detect_anomaly()
        return contextlib.nullcontext()

    def block(self, cfg: str, n_warm: int, n_timed: int, meter: Optional["CpuMeter"] = None,
              slow: float = float("inf")) -> List[float]:
        """Step times of one block. With a meter: a step slower than ``slow`` seconds while other
        processes hold the CPU ends the block early (it will be discarded as contended anyway)."""
        step = self.steps[cfg]
        times: List[float] = []
        clock = time.perf_counter
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.context(cfg):
                for k in range(n_warm + n_timed):
                    a = meter.sample() if meter is not None else None
                    t0 = clock()
                    step()
                    dt = clock() - t0
                    if k >= n_warm:
                        times.append(dt)
                    if dt > slow and meter.others(a, meter.sample()) >= QUIET:
                        break
        return times


def time_model(name: str, args, meter: CpuMeter) -> Dict[str, Any]:
    from .models import MAKERS

    bench = MAKERS[name]()
    r = Runner(bench)
    # Warm-up: a few plain steps (allocator, AdamW state), then one short block of each config.
    r.block("unguarded", 3, 0)
    warm = {c: min(r.block(c, 0, 2)) for c in CONFIGS}
    load_before = os.getloadavg()
    rng = random.Random(1234)
    blocks: List[Dict[str, Any]] = []
    waited = 0.0
    t_start = time.perf_counter()
    rounds = 0
    seconds = args.seconds * SECONDS_WEIGHT.get(name, 1.0)
    while True:
        elapsed = time.perf_counter() - t_start
        if args.rounds:
            if rounds >= args.rounds:
                break
        elif rounds >= args.max_rounds or elapsed > seconds * 1.5 or (
                rounds >= args.min_rounds and elapsed > seconds):
            break
        order = CONFIGS[:]
        rng.shuffle(order)
        for c in order:
            budget = args.max_wait - waited
            waited += meter.wait_quiet(QUIET / 2, min(args.block_wait, budget))
            a = meter.sample()
            ts = r.block(c, 1, args.block, meter, slow=3 * warm[c])
            blocks.append({"round": rounds, "config": c, "times": ts, "others_cpu": meter.others(a, meter.sample())})
        rounds += 1
    wall = time.perf_counter() - t_start
    blocks = [b for b in blocks if b["times"]]
    quiet = [b for b in blocks if b["others_cpu"] < QUIET]
    n_quiet = {c: sum(1 for b in quiet if b["config"] == c) for c in CONFIGS}
    use_quiet = min(n_quiet.values()) >= max(2, rounds // 4)
    # Valid: enough quiet blocks of every config (a persistently busy machine gives no number).
    valid = min(n_quiet.values()) >= (2 if args.quick else 4)
    chosen = quiet if use_quiet else blocks
    out: Dict[str, Any] = {
        "model": name, "desc": bench.desc, "n_params": bench.n_params,
        "n_param_tensors": len(r.params), "rounds": rounds, "timed_steps_per_block": args.block,
        "wall_s": round(wall, 1), "waited_for_quiet_s": round(waited, 1),
        "blocks_quiet": len(quiet), "blocks_total": len(blocks),
        "headline_uses": "quiet blocks" if use_quiet else "all blocks (too few quiet ones)",
        "valid": valid,
        "loadavg_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "configs": {},
    }
    out["configs"] = ratios(chosen, CONFIGS)
    out["configs_all_blocks"] = ratios(blocks, CONFIGS)
    out["ratio_ci95_by_round_bootstrap"] = round_bootstrap(chosen, CONFIGS)
    out["raw_blocks"] = [{"r": b["round"], "c": b["config"], "ms": [round(1e3 * t, 2) for t in b["times"]],
                          "others": round(b["others_cpu"], 3)} for b in blocks]
    out["guard_history_bytes_per_record"] = _history_record_bytes(r.guard)
    out["guard_parts_ms"] = guard_parts(r, meter=meter)
    out["guard_alloc"] = guard_alloc_count(r)
    out["snapshot"] = snapshot_cost(r, meter)
    return out


def _history_record_bytes(guard) -> Optional[int]:
    """Python heap bytes of one StepRecord in the guard's history (deep sizeof)."""
    recs = list(guard.monitor.history)
    if not recs:
        return None
    return int(_deep_sizeof(recs[-1]))


def _deep_sizeof(obj, seen=None) -> int:
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    n = sys.getsizeof(obj)
    if isinstance(obj, dict):
        n += sum(_deep_sizeof(k, seen) + _deep_sizeof(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set)):
        n += sum(_deep_sizeof(v, seen) for v in obj)
    elif hasattr(obj, "__dict__"):
        n += _deep_sizeof(vars(obj), seen)
    return n


def _tensors(obj) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _nbytes_unique(ts: List[torch.Tensor]) -> int:
    seen, n = set(), 0
    for t in ts:
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        n += s.nbytes()
    return n


def guard_alloc_count(r: Runner, steps: int = 3) -> Dict[str, Any]:
    """Bytes of every tensor the guard's own code allocates per step (a TorchDispatchMode that is
    active only inside the guard's hooks), and of the tensors it keeps between steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0
            self.n = 0
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {t.untyped_storage().data_ptr() for t in _tensors(list(args) + list((kwargs or {}).values()))}
            for t in _tensors(out if isinstance(out, (list, tuple)) else [out]):
                p = t.untyped_storage().data_ptr()
                if p and p not in ins:
                    nb = t.untyped_storage().nbytes()
                    self.bytes += nb
                    self.n += 1
                    self.largest = max(self.largest, nb)
                    ins.add(p)
            return out

    counter = Counter()
    mon = r.guard.monitor
    names = ["on_batch", "on_backward", "check", "end_step"]
    orig = {n: getattr(mon, n) for n in names}
    step_rng = r.guard.step_rng
    orig_rng = step_rng.capture
    rng_bytes = [0]

    def wrap(fn):
        def w(*a, **k):
            with counter:
                return fn(*a, **k)
        return w

    def rng_wrap():
        st = orig_rng()
        rng_bytes[0] += sum(t.nbytes for t in _tensors(st)) + _deep_sizeof(st.get("random"))
        return st

    for n in names:
        setattr(mon, n, wrap(orig[n]))
    step_rng.capture = rng_wrap  # an instance attribute over the method
    try:
        for _ in range(steps):
            r.guarded()
    finally:
        for n in names:
            delattr(mon, n)  # back to the class methods
        del step_rng.capture
    retained = _nbytes_unique([t for t in mon._pending_post.values()])
    model_state = _nbytes_unique(list(r.model.parameters()) + list(r.model.buffers()))
    grads = _nbytes_unique([p.grad for p in r.params if p.grad is not None])
    opt_state = _nbytes_unique(_tensors(list(r.opt.state.values())))
    return {
        "tensors_allocated_per_step": counter.n // steps,
        "tensor_bytes_allocated_per_step": counter.bytes // steps,
        "largest_tensor_bytes": counter.largest,
        "rng_capture_bytes_per_step": rng_bytes[0] // steps,
        "tensor_bytes_retained_between_steps": retained,
        "history_bytes_full": None,  # filled by the caller from the per-record size
        "model_bytes": model_state, "grad_bytes": grads, "optimizer_state_bytes": opt_state,
    }


def guard_parts(r: Runner, steps: int = 24, meter: Optional["CpuMeter"] = None) -> Dict[str, Any]:
    """Where the guard's time goes, in the training loop: median ms per step of each of its hooks,
    and of the norm passes inside them (gradients in ``check``, the post-update parameter slice in
    ``end_step``). Timers wrap the calls (a few us each); the first 4 steps are not counted."""
    import nanguard.pytorch.detect.monitor as D
    import nanguard.pytorch.detect.norms as DN

    clock = time.perf_counter
    acc: Dict[str, List[float]] = {}
    where = ["other"]
    mon = r.guard.monitor
    names = ["on_batch", "on_backward", "check", "end_step"]
    orig = {n: getattr(mon, n) for n in names}
    rng = r.guard.step_rng
    orig_norm = D.planned_norm

    def timed(label, fn):
        def w(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc.setdefault(label, []).append(clock() - t0)
        return w

    def hook(n):
        inner = timed(n, orig[n])

        def w(*a, **k):
            where[0] = n
            return inner(*a, **k)
        return w

    def norm(*a, **k):
        t0 = clock()
        out = orig_norm(*a, **k)
        label = {"check": "gradient norms (in check)", "end_step": "parameter slice norm (in end_step)"}.get(
            where[0], "other norms")
        acc.setdefault("_" + label, []).append(clock() - t0)
        return out

    for n in names:
        setattr(mon, n, hook(n))
    rng.capture = timed("rng capture (replay)", rng.capture)  # an instance attribute over the method
    D.planned_norm = DN.planned_norm = norm  # the monitor's own calls, and _norm's
    try:
        if meter is not None:
            meter.wait_quiet(QUIET / 2, 5.0)
        per_step: Dict[str, List[float]] = {}
        for i in range(steps):
            before = {k: sum(v) for k, v in acc.items()}
            r.guarded()
            if i >= 4:
                for k, v in acc.items():
                    per_step.setdefault(k.lstrip("_"), []).append(sum(v) - before.get(k, 0.0))
    finally:
        for n in names:
            delattr(mon, n)
        del rng.capture
        D.planned_norm = DN.planned_norm = orig_norm
    return {k: round(1e3 * statistics.median(v), 3) for k, v in per_step.items()}


def snapshot_cost(r: Runner, meter: Optional["CpuMeter"] = None) -> Dict[str, Any]:
    """Bytes and seconds of one rollback snapshot (CPU copy of model + optimizer state); best of 3."""
    try:
        from nanguard.pytorch.recover import Snapshot, RecoveryPolicy  # noqa: F401
        t_take = t_fin = float("inf")
        for _ in range(3):
            if meter is not None:
                meter.wait_quiet(QUIET / 2, 3.0)
            t0 = time.perf_counter()
            snap = Snapshot(0, [r.model], [r.opt])
            t_take = min(t_take, time.perf_counter() - t0)
            t0 = time.perf_counter()
            snap.finite()
            t_fin = min(t_fin, time.perf_counter() - t0)
        nb = int(snap.nbytes)
        pol = RecoveryPolicy()
        method = "nanguard.pytorch.recover.Snapshot"
        every = getattr(pol, "snapshot_every", 10)
        recent = getattr(pol, "recent_n", 0) if nb <= getattr(pol, "recent_max_bytes", 0) else 0
        # first step's + periodic + per-step (small models) + the one pinned after a step-size cut
        keep = 1 + getattr(pol, "keep", 3) + recent + 1
        per_step = 1.0 if recent else 1.0 / max(every, 1)
        del snap
    except Exception as e:  # recovery module absent: the documented cost of a snapshot
        t0 = time.perf_counter()
        sd = (copy.deepcopy(r.model.state_dict()), copy.deepcopy(r.opt.state_dict()))
        t_take = time.perf_counter() - t0
        t_fin = 0.0
        nb = _nbytes_unique(_tensors(list(sd)))
        method = f"deepcopy(model.state_dict()) + deepcopy(opt.state_dict()) ({type(e).__name__})"
        every, keep, per_step = 10, 3, 0.1
        del sd
    return {"method": method, "bytes": nb, "take_s": round(t_take, 4), "finite_check_s": round(t_fin, 4),
            "snapshot_every": every, "max_kept": keep, "bytes_kept": nb * keep,
            "snapshots_per_step": per_step, "seconds_per_step": round((t_take + t_fin) * per_step, 4)}


# =========================================================================== memory: RSS subprocesses


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mem_child(model: str, cfg: str, steps: int, snap_warm: int = 36) -> None:
    """Runs in a subprocess: peak RSS of `steps` training steps under one configuration.

    The baseline is the RSS after ``import torch`` and the benchmark models, so a guarded
    run's overhead includes everything nanguard adds: the modules a healthy run loads, numpy.random
    (which the per-step RNG capture imports on its first call) and its runtime data.
    """
    _setup()
    from .models import MAKERS

    rss0 = _rss_now()
    import_bytes = None
    if cfg != "unguarded":
        import nanguard
        import nanguard.pytorch.guard  # noqa: F401  (what a healthy step needs: the replay, diagnosis and
        # experiments are imported at the first failure, so a healthy run's peak does not hold them)
        import numpy.random  # noqa: F401  (imported by the guard's first RNG capture)
        if cfg == "guard_snapshots":
            import nanguard.pytorch.recover  # noqa: F401
        import_bytes = _rss_now() - rss0
    bench = MAKERS[model]()
    opt = bench.make_optimizer()
    snapshot_method = None
    if cfg == "unguarded":
        def step(b):
            opt.zero_grad(set_to_none=True)
            bench.loss_fn(b).backward()
            opt.step()
    else:
        recover = None
        kept: List[Any] = []
        if cfg == "guard_snapshots":
            try:
                from nanguard.pytorch.recover import RecoveryPolicy
                recover = RecoveryPolicy(quiet=True)  # the defaults of recover="auto"
                snapshot_method = "nanguard.pytorch.recover.RecoveryPolicy() defaults (recover='auto')"
            except Exception:
                snapshot_method = "emulated: deepcopy(model+optimizer state_dict), 3 kept"
        guard = nanguard.Guard(bench.model, opt, quiet=True, recover=recover)

        def step(b):
            if cfg == "guard_snapshots" and recover is None:
                kept.append((copy.deepcopy(bench.model.state_dict()), copy.deepcopy(opt.state_dict())))
                del kept[:-3]
            guard.step(b, bench.loss_fn)
    # First steps: one-off allocations (oneDNN/BLAS workspaces), AdamW state. With snapshots, run
    # until every tier of the default policy is full (first step's + 3 periodic every 10 + last 2).
    warm = snap_warm if cfg == "guard_snapshots" else 4
    for i in range(warm):
        step(bench.batches[i % len(bench.batches)])
    hwm_reset = _reset_peak_rss()
    for i in range(warm, warm + steps):
        step(bench.batches[i % len(bench.batches)])
    peak = _peak_rss() if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"model": model, "config": cfg, "steps": steps, "warmup_steps": warm, "rss_baseline": rss0,
                      "peak_rss": peak, "training_peak": peak - rss0, "nanguard_import_bytes": import_bytes,
                      "peak_window": "steady state (VmHWM reset after warm-up)" if hwm_reset else
                      "whole process (ru_maxrss)", "snapshot_method": snapshot_method}))


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) so that one-off warm-up peaks do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_mem_children(models: List[str], steps: int, reps: int, snap_warm: int = 36) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Every allocation >= 64 KiB is its own mmap, returned to the OS when freed: the peak RSS then
    # follows the peak of live tensor bytes (run-to-run noise ~0.1 MB instead of ~10 MB).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    for m in models:
        res: Dict[str, List[dict]] = {c: [] for c in MEM_CONFIGS}
        for _ in range(reps):
            for c in MEM_CONFIGS:
                p = subprocess.run([sys.executable, "-m", "benchmarks.overhead", "--_mem-child", m, c, str(steps),
                                    str(snap_warm)],
                                   cwd=root, env=env, capture_output=True, text=True, timeout=300)
                if p.returncode != 0:
                    res[c].append({"error": p.stderr[-2000:]})
                    continue
                res[c].append(json.loads(p.stdout.strip().splitlines()[-1]))
        summ: Dict[str, Any] = {"runs": res}
        ok = {c: [x["training_peak"] for x in v if "training_peak" in x] for c, v in res.items()}
        okp = {c: [x["peak_rss"] for x in v if "peak_rss" in x] for c, v in res.items()}
        if all(ok.values()):
            base = statistics.median(ok["unguarded"])
            basep = statistics.median(okp["unguarded"])
            for c in MEM_CONFIGS:
                tp = statistics.median(ok[c])
                summ[c] = {"training_peak_mb": round(tp / 2**20, 1), "peak_rss_mb": round(statistics.median(okp[c]) / 2**20, 1),
                           "overhead_mb": round((tp - base) / 2**20, 2),
                           "overhead_pct_of_training_peak": round(100 * (tp - base) / base, 2),
                           "overhead_pct_of_process_peak": round(100 * (statistics.median(okp[c]) - basep) / basep, 2)}
            summ["snapshot_method"] = next((x.get("snapshot_method") for x in res["guard_snapshots"]
                                            if x.get("snapshot_method")), None)
            imp = [x["nanguard_import_bytes"] for x in res["guard"] if x.get("nanguard_import_bytes")]
            summ["guard"]["of_which_imports_mb"] = round(statistics.median(imp) / 2**20, 2) if imp else None
        out[m] = summ
    return out


# =========================================================================== time to diagnosis


def time_to_diagnosis(k: int, step_s: Optional[float], meter: CpuMeter, max_wait: float) -> Dict[str, Any]:
    import nanguard
    from .models import faulty_lm_loss, make_gpt

    out: Dict[str, Any] = {"fault_step": k, "fault": "log(softmax(1e4*logits)) underflows to log(0) = -inf "
                           "in a hand-written LM loss at step k"}
    out["locate_available"] = _has("nanguard.pytorch.locate")
    out["diagnose_available"] = _has("nanguard.core.diagnosis")

    # --- nanguard: train with the guard; the failing step raises with the finished report.
    bench = make_gpt()
    opt = bench.make_optimizer()
    state: Dict[str, int] = {}
    loss_fn = faulty_lm_loss(bench.model, k, state)
    fd, report = tempfile.mkstemp(suffix=".json", prefix="nanguard-bench-")
    os.close(fd)
    guard = nanguard.Guard(bench.model, opt, quiet=True, localize=True, report=report)
    healthy: List[float] = []
    t_diag = None
    err = None
    t_train0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(k + 1):
            state["step"] = i
            b = bench.batches[i % len(bench.batches)]
            if i == k:
                meter.wait_quiet(QUIET / 2, max_wait)
                m0 = meter.sample()
            t0 = time.perf_counter()
            try:
                guard.step(b, loss_fn)
            except nanguard.NonFiniteError as e:
                t_diag = time.perf_counter() - t0
                others = meter.others(m0, meter.sample())
                err = e
                break
            healthy.append(time.perf_counter() - t0)
    t_train = time.perf_counter() - t_train0
    one = step_s or statistics.median(healthy[len(healthy) // 2:] or healthy)  # the later, warm steps
    out["one_step_s"] = round(one, 4)
    out["one_step_source"] = "unguarded median (step-time section)" if step_s else "guarded healthy steps"
    if err is not None:
        ev = err.event
        loc = ev.localization or {}
        out["nanguard"] = {
            "caught_at_step": ev.step, "phase": ev.phase,
            "origin": {k2: (ev.origin or {}).get(k2) for k2 in ("op", "module", "file", "line", "function")},
            "cause": (ev.cause or {}).get("category"),
            "replay_reproduced": loc.get("reproduced"), "replay_s": loc.get("seconds"),
            "failing_step_to_report_s": round(t_diag, 3),
            "in_steps": round(t_diag / one, 1),
            "report_written": os.path.getsize(report) > 0 if os.path.exists(report) else False,
            "others_cpu_during": round(others, 3),
            "training_before_fault_s": round(t_train - t_diag, 2),
        }
    else:
        out["nanguard"] = {"error": "the injected fault was not caught"}
    try:
        os.unlink(report)
    except OSError:
        pass
    del guard, bench, opt
    gc.collect()

    # --- the usual alternative: re-run from the start under detect_anomaly until the failure reappears.
    bench = make_gpt()
    opt = bench.make_optimizer()
    state = {}
    loss_fn = faulty_lm_loss(bench.model, k, state)
    msg = None
    steps_run = 0
    times: List[float] = []
    meter.wait_quiet(QUIET / 2, max_wait)
    m0 = meter.sample()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly():
            for i in range(k + 1):
                state["step"] = i
                steps_run += 1
                ts = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(bench.batches[i % len(bench.batches)])
                try:
                    loss.backward()
                except RuntimeError as e:
                    msg = str(e).splitlines()[0]
                    times.append(time.perf_counter() - ts)
                    break
                opt.step()
                times.append(time.perf_counter() - ts)
    t_rerun = time.perf_counter() - t0
    med = statistics.median(times)
    out["anomaly_rerun"] = {
        "steps_rerun": steps_run, "caught": msg is not None, "message": msg,
        "rerun_s": round(t_rerun, 3), "in_steps": round(t_rerun / one, 1),
        "median_step_s": round(med, 4), "per_step_ratio": round(med / one, 3),
        "others_cpu_during": round(meter.others(m0, meter.sample()), 3),
        "in_steps_from_median": round(steps_run * med / one, 1),
    }
    return out


def _has(mod: str) -> bool:
    import importlib
    try:
        importlib.import_module(mod)
        return True
    except Exception:
        return False


# =========================================================================== output


def machine() -> Dict[str, Any]:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import nanguard
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "nanguard": nanguard.__version__}


def _mb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MB"


def print_tables(res: Dict[str, Any]) -> None:
    m = res["machine"]
    print(f"\nnanguard overhead benchmark  ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
          f"{m['torch_threads']} threads{', QUICK' if res['quick'] else ''})")
    timing = res.get("timing", {})
    if timing:
        names = list(timing)
        print("\nStep time: ratio to unguarded = median (paired-by-round median / 25th-percentile ratio)")
        hdr = f"{'configuration':36s}" + "".join(f"{n:>26s}" for n in names)
        print(hdr)
        print("-" * len(hdr))
        row = f"{'unguarded step (median ms)':36s}"
        for n in names:
            row += f"{(timing[n]['configs']['unguarded']['median_ms'] or float('nan')):>23.1f} ms"
        print(row)
        for c in CONFIGS[1:]:
            row = f"{LABELS[c]:36s}"
            for n in names:
                d = timing[n]["configs"][c]
                row += (f"{d['ratio']:>11.3f}x ({d['ratio_paired']:.3f}/{d['ratio_p25']:.3f})"
                        if d.get("ratio") is not None and d.get("ratio_paired") is not None else f"{'-':>26s}")
            print(row)
        row = f"{'guard ratio, 95% CI (round bootstrap)':36s}"
        for n in names:
            ci = timing[n].get("ratio_ci95_by_round_bootstrap", {}).get("guard")
            row += f"{(f'{ci[0]:.3f} - {ci[1]:.3f}' if ci else '-'):>26s}"
        print(row)
        row = f"{'timed steps per config':36s}"
        for n in names:
            row += f"{timing[n]['configs']['unguarded']['n']:>26d}"
        print(row)
        row = f"{'quiet blocks used / all blocks':36s}"
        for n in names:
            t = timing[n]
            row += f"{(str(t['blocks_quiet']) if t['headline_uses'] == 'quiet blocks' else 'all') + ' / ' + str(t['blocks_total']):>26s}"
        print(row)
        bad = [n for n in names if not timing[n].get("valid", True)]
        if bad:
            print(f"WARNING: too few quiet blocks for {', '.join(bad)}: other processes held the CPU; "
                  f"those ratios are not valid, re-run when the machine is idle")
        parts = {n: timing[n].get("guard_parts_ms") or {} for n in names}
        keys = [k for k in ("gradient norms (in check)", "check", "parameter slice norm (in end_step)", "end_step",
                            "rng capture (replay)", "on_backward", "on_batch") if any(k in p for p in parts.values())]
        if keys:
            print("\nGuard time per step in the training loop, ms (median; % of the unguarded step)")
            for k in keys:
                row = f"{'  ' + k if 'norm' in k else k:36s}"
                for n in names:
                    v = parts[n].get(k)
                    u = timing[n]["configs"]["unguarded"]["median_ms"]
                    row += f"{(f'{v:.3f} ({100 * v / u:.2f}%)' if v is not None and u else '-'):>26s}"
                print(row)
        print("\nModels: " + "; ".join(f"{n}: {timing[n]['desc']}, {timing[n]['n_params'] / 1e6:.2f}M params "
                                      f"in {timing[n]['n_param_tensors']} tensors" for n in names))
    mem = res.get("memory", {})
    if mem:
        print("\nMemory (default guard: exact tensor bytes; end-to-end: peak RSS of a subprocess per config)")
        names = list(mem)
        hdr = f"{'':44s}" + "".join(f"{n:>18s}" for n in names)
        print(hdr)
        print("-" * len(hdr))

        def line(label, f):
            row = f"{label:44s}"
            for n in names:
                try:
                    v = f(mem[n])
                except Exception:
                    v = "-"
                row += f"{v:>18s}"
            print(row)
        line("guard tensors allocated / step", lambda d: f"{d['exact']['tensors_allocated_per_step']}")
        line("guard tensor bytes allocated / step", lambda d: f"{d['exact']['tensor_bytes_allocated_per_step'] / 1024:.1f} KB")
        line("guard RNG capture / step (localize)", lambda d: f"{d['exact']['rng_capture_bytes_per_step'] / 1024:.1f} KB")
        line("guard tensor bytes kept between steps", lambda d: f"{d['exact']['tensor_bytes_retained_between_steps']} B")
        line("guard step history (200 records)", lambda d: f"{d['exact']['history_bytes_full'] / 1024:.0f} KB")
        line("model+grads+AdamW state", lambda d: _mb(d['exact']['model_bytes'] + d['exact']['grad_bytes']
                                                       + d['exact']['optimizer_state_bytes']))
        line("unguarded training peak RSS", lambda d: f"{d['rss']['unguarded']['training_peak_mb']:.1f} MB")
        line("guard: RSS overhead (% training peak)", lambda d: f"{d['rss']['guard']['overhead_mb']:+.2f} MB "
             f"({d['rss']['guard']['overhead_pct_of_training_peak']:+.1f}%)")
        line("  of which imported code", lambda d: f"{d['rss']['guard']['of_which_imports_mb']:.2f} MB")
        line("guard: exact overhead (% training peak)", lambda d: f"{100 * d['exact_overhead_bytes'] / (d['rss']['unguarded']['training_peak_mb'] * 2**20):.3f}%")
        line("one rollback snapshot", lambda d: _mb(d['snapshot']['bytes']))
        line("snapshots kept at most (policy)", lambda d: f"{d['snapshot']['max_kept']} = " + _mb(d['snapshot']['bytes_kept']))
        line("guard+snapshots: RSS overhead", lambda d: f"{d['rss']['guard_snapshots']['overhead_mb']:+.1f} MB "
             f"({d['rss']['guard_snapshots']['overhead_pct_of_training_peak']:+.0f}%)")
        line("snapshot copy+check time / step", lambda d: f"{100 * d['snapshot']['seconds_per_step'] / d['step_s']:.1f}%")
    diag = res.get("diagnosis")
    if diag:
        print(f"\nTime to diagnosis (GPT, fault injected at step {diag['fault_step']}; "
              f"one step = {1e3 * diag['one_step_s']:.0f} ms, {diag['one_step_source']})")
        ng, an = diag.get("nanguard", {}), diag.get("anomaly_rerun", {})
        if "failing_step_to_report_s" in ng:
            o = ng["origin"]
            print(f"  nanguard Guard (localize): {ng['failing_step_to_report_s']:.2f} s = {ng['in_steps']:.1f} steps "
                  f"from the failing step to the report; origin op={o.get('op')} at "
                  f"{os.path.basename(o.get('file') or '?')}:{o.get('line')}, phase={ng['phase']}, "
                  f"cause={ng['cause']}, diagnose module: {'yes' if diag['diagnose_available'] else 'TODO (absent)'}")
        else:
            print(f"  nanguard: {ng}")
        print(f"  re-run under detect_anomaly:  {an.get('rerun_s', float('nan')):.2f} s = {an.get('in_steps', float('nan')):.1f} steps "
              f"({an.get('steps_rerun')} steps re-run, median {an.get('per_step_ratio')}x a step: "
              f"{an.get('in_steps_from_median')} steps without contention bursts); it says: {an.get('message')}")
        busy = [k for k, d in (("nanguard", ng), ("re-run", an)) if (d.get("others_cpu_during") or 0) >= QUIET]
        if busy:
            print(f"  WARNING: other processes held the CPU during: {', '.join(busy)} (seconds are inflated)")
        if an.get("per_step_ratio"):
            print(f"  (a re-run grows with k: ~(k+1) x {an['per_step_ratio']:.2f} steps; nanguard's cost does not)")
    print(f"\ntotal wall time: {res['wall_s']:.0f} s")


# =========================================================================== main


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fast smoke mode (few reps; numbers are rough)")
    ap.add_argument("--out", default=None, help="JSON output path (default benchmarks/results.json; "
                                                "benchmarks/results_quick.json with --quick)")
    ap.add_argument("--models", default="mlp,cnn,gpt", help="comma list of mlp,cnn,gpt")
    ap.add_argument("--seconds", type=float, default=None, help="time budget of the step-time rounds per model (x2 for gpt)")
    ap.add_argument("--rounds", type=int, default=None, help="fixed number of rounds (overrides --seconds)")
    ap.add_argument("--block", type=int, default=None, help="timed steps per block")
    ap.add_argument("--fault-step", type=int, default=None, help="step k of the injected fault")
    ap.add_argument("--no-mallopt", action="store_true", help="keep glibc's default of returning freed memory "
                                                               "to the OS (noisier step times on a VM)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: timing,memory,diagnosis")
    ap.add_argument("--_mem-child", nargs=4, metavar=("MODEL", "CONFIG", "STEPS", "SNAP_WARM"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._mem_child:
        m, c, st, sw = args._mem_child
        mem_child(m, c, int(st), int(sw))
        return 0
    _setup()
    mallopt = False if args.no_mallopt else keep_freed_memory()
    q = args.quick
    args.block = args.block or (2 if q else 4)
    args.seconds = args.seconds if args.seconds is not None else (6.0 if q else 60.0)
    args.min_rounds, args.max_rounds = (2, 3) if q else (8, 60)
    args.max_wait = 5.0 if q else 60.0   # per model: total seconds we may wait for a quiet machine
    args.block_wait = 1.0 if q else 5.0  # ...and per block
    meter = CpuMeter()
    k = args.fault_step if args.fault_step is not None else (3 if q else 20)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "results_quick.json" if q else "results.json")
    t0 = time.time()
    res: Dict[str, Any] = {"machine": machine(), "quick": q, "command": "python -m benchmarks.overhead"
                           + (" --quick" if q else "") + (f" --models {args.models}" if args.models != "mlp,cnn,gpt" else ""),
                           "allocator": ("glibc mallopt(M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=1 GiB)"
                                         if mallopt else "glibc default"),
                           "timing": {}, "memory": {}}
    if "timing" not in skip or "memory" not in skip:
        for m in models:
            print(f"[{time.time() - t0:5.0f}s] step time: {m} ...", file=sys.stderr, flush=True)
            tm = time_model(m, args, meter)
            hist_rec = tm.pop("guard_history_bytes_per_record")
            alloc = tm.pop("guard_alloc")
            snap = tm.pop("snapshot")
            alloc["history_bytes_full"] = (hist_rec or 0) * 200
            res["timing"][m] = tm
            res["memory"][m] = {"exact": alloc, "snapshot": snap,
                                "step_s": tm["configs"]["unguarded"]["median_ms"] / 1e3,
                                "exact_overhead_bytes": alloc["tensor_bytes_allocated_per_step"]
                                + alloc["rng_capture_bytes_per_step"] + alloc["tensor_bytes_retained_between_steps"]
                                + alloc["history_bytes_full"]}
            gc.collect()
        if "timing" in skip:
            res["timing"] = {}
    if "memory" not in skip:
        print(f"[{time.time() - t0:5.0f}s] memory: peak RSS subprocesses ...", file=sys.stderr, flush=True)
        rss = run_mem_children(models, steps=2 if q else 4, reps=1, snap_warm=12 if q else 36)
        for m in models:
            res["memory"].setdefault(m, {})["rss"] = rss[m]
    else:
        res["memory"] = {}
    if "diagnosis" not in skip:
        print(f"[{time.time() - t0:5.0f}s] time to diagnosis (gpt, k={k}) ...", file=sys.stderr, flush=True)
        step_s = None
        if "gpt" in res["timing"] and res["timing"]["gpt"].get("valid"):
            step_s = res["timing"]["gpt"]["configs"]["unguarded"]["median_ms"] / 1e3
        res["diagnosis"] = time_to_diagnosis(k, step_s, meter, 2.0 if q else 20.0)
    res["wall_s"] = round(time.time() - t0, 1)
    res["budgets"] = budgets(res)
    print_tables(res)
    for b in res["budgets"]:
        verdict = {True: "MET", False: "NOT MET", None: f"NOT JUDGED ({b.get('why_not_judged')})"}
        print(f"budget {b['what']}: {b['value']} (limit {b['limit']}) -> {verdict[b['met']]}")
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"results: {out_path}")
    return 0


def budgets(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for m, lim in (("gpt", 1.02), ("mlp", 1.05)):
        t = res.get("timing", {}).get(m)
        if t:
            v = t["configs"]["guard"]["ratio"]
            ci = t.get("ratio_ci95_by_round_bootstrap", {}).get("guard")
            what = f"guard step-time ratio on {m}" + (f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})" if ci else "")
            ok = t.get("valid", True) and v is not None and not res.get("quick")
            out.append({"what": what, "value": v, "limit": lim, "met": (v <= lim) if ok else None,
                        "why_not_judged": None if ok else ("quick mode: a few samples only" if res.get("quick")
                                                           else "other processes held the CPU; re-run")})
    for m, d in res.get("memory", {}).items():
        try:
            base = d["rss"]["unguarded"]["training_peak_mb"] * 2**20
            exact = d["exact_overhead_bytes"] / base
            rss = d["rss"]["guard"]["overhead_pct_of_training_peak"] / 100
            out.append({"what": f"guard memory overhead on {m} (exact / RSS)",
                        "value": f"{100 * exact:.3f}% / {100 * rss:+.2f}%", "limit": "5%",
                        "met": exact < 0.05 and rss < 0.05})
        except Exception:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
