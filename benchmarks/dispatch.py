"""Host cost on dispatch-bound steps: what nanguard adds per step when the kernels are cheap.

On a GPU the kernels are fast and the host's Python dispatch sets the pace, so a fixed cost per module
call or per op (hooks, wrappers, the step tape, bookkeeping) is what users see. This benchmark makes
the kernels cheap on the CPU instead (one thread, tiny dimensions, many layers) and measures::

    python -m benchmarks.dispatch                 # ~4 min: timings and counts
    python -m benchmarks.dispatch --counts-only   # seconds: the noise-free counts only
    python -m benchmarks.dispatch --counts-only --profile --models gpt   # + calls added per function
    python -m benchmarks.dispatch --models gpt --rounds 40

* **Timing**: per model, the configurations (unguarded, Guard, Guard ``sync_free=True``, Guard
  ``recover="auto"``, zero-code = ``nanguard.watch``, the hooks of ``nanguard run``) run in interleaved
  blocks, a fresh random order every round; each block's CPU time per step (``time.process_time``:
  one thread, so another process's load does not count, only cache and frequency effects do). The
  headline is the median over rounds of the per-round ratio to the unguarded block of the same round,
  with the interquartile range of those ratios.
* **Floor** (``floor``): the unguarded step plus the bare tensor work of a per-step check, written
  inline with no bookkeeping: the batch's ``aminmax``, the gradients' fused norm (nanguard's
  :func:`~nanguard.pytorch.detect.norms.planned_norm`), one ``stack`` and one host read of
  [loss, norm, batch range, last update's slice norm], and after the update the norm of one of 4
  parameter slices. No history, no early warning, no RNG capture, no replay: what any check of every
  step costs here, the reference the Guard's figure is read against (measured 1.024-1.039x on the
  three models: the CPU runs these kernels too, where a GPU runs them asynchronously).
* **Counts** (independent of the machine's noise): for one healthy step of each configuration, the
  Python function calls made (``sys.setprofile``): all of them, and those in nanguard's own code.
  Python calls are not the cost (halving them did not move the ratios): the instructions a step
  executes, counted under valgrind by :mod:`benchmarks.instructions`, are the load-independent figure
  to cut (the tiny GPT's Guard: two norms over 148 small tensors were 1.7 of its 2.4 M; now +1.1 M in all).

Models (1 thread, ~5-20 ms a step):
  gpt:  GPT 12 layers, 2 heads, 32 dims, context 16, batch 2 (nanoGPT shape, dispatch-bound);
  cnn:  16 3x3 convolutions of 8 channels with BatchNorm+ReLU on 8x8 inputs, batch 4;
  lstm: an LSTMCell loop over 32 time steps, hidden 32, batch 4, a linear head per step.

Never used as a test: timings here are measurements, not assertions.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .models import Bench, GPTConfig, make_gpt
from .overhead import Runner

CONFIGS = ["unguarded", "floor", "guard", "syncfree", "recover", "zerocode"]


class ConvStack(nn.Module):
    def __init__(self, depth: int = 16, ch: int = 8) -> None:
        super().__init__()
        layers: List[nn.Module] = [nn.Conv2d(3, ch, 3, padding=1)]
        for _ in range(depth - 1):
            layers += [nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(ch, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


class CellLoop(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(d_in, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        c = torch.zeros_like(h)
        outs = []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(self.head(h))
        return torch.cat(outs, dim=1)


def make_tiny_gpt() -> Bench:
    b = make_gpt(batch=2, cfg=GPTConfig(vocab_size=64, block_size=16, n_layer=12, n_head=2, n_embd=32))
    b.name, b.desc = "gpt", "GPT 12L/2H/32d, vocab 64, ctx 16, batch 2"
    return b


def make_conv_stack() -> Bench:
    torch.manual_seed(0)
    model = ConvStack()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(4)]
    return Bench("cnn", model, batches, lambda b: F.cross_entropy(model(b[0]), b[1]),
                 "16 x (BN-ReLU-conv3x3, 8 ch), 8x8 input, batch 4")


def make_cell_loop() -> Bench:
    torch.manual_seed(0)
    model = CellLoop()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 32, 8, generator=g), torch.randn(4, 32, generator=g)) for _ in range(4)]
    return Bench("lstm", model, batches, lambda b: F.mse_loss(model(b[0]), b[1]),
                 "LSTMCell loop, 32 steps, hidden 32, batch 4")


MAKERS: Dict[str, Callable[[], Bench]] = {"gpt": make_tiny_gpt, "cnn": make_conv_stack, "lstm": make_cell_loop}


def cpu_block(r: Runner, cfg: str, n: int) -> float:
    """CPU seconds per step of ``n`` steps of ``cfg`` (after one untimed step). On a GPU: wall seconds,
    synchronized before and after the block only (the host's dispatch sets the pace; the process's
    CPU time would count the driver's own threads)."""
    step = r.steps[cfg]
    cuda = r.bench.meta.get("device") == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with r.context(cfg):
            step()
            if cuda:
                torch.cuda.synchronize()
            t0 = clock()
            for _ in range(n):
                step()
            if cuda:
                torch.cuda.synchronize()
            return (clock() - t0) / n


def host_syncs(r: Runner, cfg: str, n: int = 4) -> Dict[str, float]:
    """Host reads per step (:class:`nanguard.pytorch.syncs.HostSyncCounter`: value-reading ops, and on
    CUDA PyTorch's own synchronizing-call warnings)."""
    from nanguard.pytorch.syncs import HostSyncCounter
    step = r.steps[cfg]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with r.context(cfg):
            step()
            with HostSyncCounter() as c:
                for _ in range(n):
                    step()
    return {"host_reads": c.count / n, "cuda_syncs": c.cuda_syncs / n}


def on_device(b: Bench, dev: str) -> Bench:
    """The same model and batches on ``dev`` (the loss functions close over the model object)."""
    if dev != "cpu":
        b.model.to(dev)
        b.batches = [tuple(t.to(dev) for t in x) if isinstance(x, (tuple, list)) else x.to(dev) for x in b.batches]
    b.meta["device"] = dev
    return b


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched, and the tensors (and bytes) they allocate: an output whose
    storage is none of its inputs' is a new allocation (views and in-place ops allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.tensors = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        ins = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                self.tensors += 1
                self.bytes += t.untyped_storage().nbytes()
        return out


def count_calls(r: Runner, cfg: str, by_function: Dict[str, int] | None = None) -> Dict[str, int]:
    """What one healthy step of ``cfg`` does (after two warm steps), counted, not timed: the Python
    calls made (all, and those in nanguard's code), the C functions nanguard's code calls
    (``getstate``, ``Tensor.item``, torch functions...), and the aten ops dispatched with the
    tensors and bytes they allocate (a second step, under a TorchDispatchMode). ``by_function``: filled
    with the Python calls per function (``file:name``, nanguard's and torch's paths shortened)."""
    step = r.steps[cfg]
    counts = {"calls": 0, "nanguard_calls": 0, "nanguard_c_calls": 0}

    def prof(frame, event, arg):
        if event == "call":
            counts["calls"] += 1
            if "/nanguard/" in frame.f_code.co_filename:
                counts["nanguard_calls"] += 1
            if by_function is not None:
                key = _where(frame.f_code)
                by_function[key] = by_function.get(key, 0) + 1
        elif event == "c_call" and "/nanguard/" in frame.f_code.co_filename:
            counts["nanguard_c_calls"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with r.context(cfg):
            step()
            step()
            sys.setprofile(prof)
            try:
                step()
            finally:
                sys.setprofile(None)
            mode = _OpCounter()
            with mode:
                step()
    counts.update(ops=mode.ops, tensors=mode.tensors, bytes=mode.bytes)
    return counts


def _where(code: Any) -> str:
    fn = code.co_filename
    for root, short in (("/nanguard/", ""), ("/torch/", "torch/")):
        if root in fn:
            return f"{short}{fn.rsplit(root, 1)[-1]}:{code.co_name}"
    return f"{fn.rsplit('/', 1)[-1]}:{code.co_name}"


def floor_step(r: Runner) -> Callable[[], None]:
    """The ``floor`` configuration (see the module docstring): the check's tensor work and nothing else."""
    from nanguard.pytorch.detect.norms import NormPlan, planned_norm
    params = [p for p in r.model.parameters() if p.requires_grad]
    k = 4
    slices = [params[i::k] for i in range(k)]
    plans: Dict[str, Any] = {"grads": None, "slices": [NormPlan(sl) for sl in slices]}
    state: Dict[str, Any] = {"i": 0, "post": None}

    def step() -> None:
        b = r.batch()
        r.opt.zero_grad(set_to_none=True)
        loss = r.loss_fn(b)
        loss.backward()
        grads = [p.grad for p in params]
        dev = grads[0].device
        if plans["grads"] is None:
            plans["grads"] = NormPlan(grads)
        x = next((t for t in pytree.tree_leaves(b) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        parts = [loss.detach().float(), planned_norm(grads, plans["grads"], dev).float()]
        if x is not None:
            parts += [m.float() for m in torch.aminmax(x)]
        if state["post"] is not None:
            parts.append(state["post"].float())
        if not all(map(math.isfinite, torch.stack(parts).tolist())):  # the one host read
            raise FloatingPointError("non-finite")
        r.opt.step()
        c = state["i"] % k
        state["i"] += 1
        with torch.no_grad():
            state["post"] = planned_norm(slices[c], plans["slices"][c], dev)
    return step


def run_model(name: str, rounds: int, block: int, counts_only: bool, dev: str = "cpu",
              profile: bool = False) -> Dict[str, Any]:
    r = Runner(on_device(MAKERS[name](), dev))
    r.steps["floor"] = floor_step(r)
    out: Dict[str, Any] = {"model": name, "desc": r.bench.desc, "counts": {}, "ratios": {}, "syncs": {},
                           "by_function": {}}
    for c in CONFIGS:
        per: Dict[str, int] | None = {} if profile else None
        out["counts"][c] = count_calls(r, c, per)
        out["syncs"][c] = host_syncs(r, c)
        if per is not None:
            out["by_function"][c] = per
    if profile:  # the Python calls each configuration adds per function, over the unguarded step
        base = out["by_function"]["unguarded"]
        out["by_function"] = {c: {k: v - base.get(k, 0) for k, v in per.items() if v != base.get(k, 0)}
                              for c, per in out["by_function"].items() if c != "unguarded"}
    if counts_only:
        return out
    for c in CONFIGS:  # warm every path (allocator, optimizer state, snapshots)
        cpu_block(r, c, 3)
    rng = random.Random(1234)
    per: Dict[str, List[float]] = {c: [] for c in CONFIGS}
    for _ in range(rounds):
        order = CONFIGS[:]
        rng.shuffle(order)
        for c in order:
            per[c].append(cpu_block(r, c, block))
    base = per["unguarded"]
    out["unguarded_ms"] = round(1e3 * statistics.median(base), 3)
    for c in CONFIGS[1:]:
        rs = sorted(x / b for x, b in zip(per[c], base))
        q = statistics.quantiles(rs, n=4) if len(rs) >= 4 else [rs[0], statistics.median(rs), rs[-1]]
        out["ratios"][c] = {"median": round(statistics.median(rs), 4), "iqr": [round(q[0], 4), round(q[2], 4)],
                            "ms": round(1e3 * statistics.median(per[c]), 3),
                            "min_ratio": round(min(per[c]) / min(base), 4)}  # the least disturbed blocks
    return out


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dispatch", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,cnn,lstm")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--block", type=int, default=10, help="timed steps per block")
    ap.add_argument("--counts-only", action="store_true")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--device", default="cpu", help="cpu (kernels made cheap on the host) or cuda")
    ap.add_argument("--profile", action="store_true",
                    help="also list the Python calls each configuration adds per function (in --out too)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"load_before": os.getloadavg()[0], "torch": torch.__version__, "device": args.device, "models": []}
    for name in args.models.split(","):
        m = run_model(name, args.rounds, args.block, args.counts_only, args.device, args.profile)
        res["models"].append(m)
        print(f"\n{name}: {m['desc']}" + (f"; unguarded {m['unguarded_ms']} ms CPU/step" if "unguarded_ms" in m else ""))
        b = m["counts"]["unguarded"]
        for c in CONFIGS:
            k = m["counts"][c]
            line = (f"  {c:10s} python calls {k['calls']:5d} (+{k['calls'] - b['calls']:4d}; nanguard's "
                    f"{k['nanguard_calls']:4d}, +{k['nanguard_c_calls']:4d} C)  aten ops +{k['ops'] - b['ops']:4d}, "
                    f"allocs +{k['tensors'] - b['tensors']:4d} / +{(k['bytes'] - b['bytes']) / 1024:7.1f} KiB")
            y = m["syncs"][c]
            line += f"  host reads {y['host_reads']:.1f}" + (f" (cuda syncs {y['cuda_syncs']:.1f})" if args.device == "cuda" else "")
            if c in m["ratios"]:
                x = m["ratios"][c]
                line += (f"   {'wall' if args.device == 'cuda' else 'CPU'} time {x['median']:.3f}x "
                         f"(IQR {x['iqr'][0]:.3f}-{x['iqr'][1]:.3f}; fastest blocks {x['min_ratio']:.3f}x)")
            print(line)
            for fn, n in sorted(m["by_function"].get(c, {}).items(), key=lambda kv: -abs(kv[1]))[:25]:
                print(f"      {n:+5d}  {fn}")
    res["load_after"] = os.getloadavg()[0]
    print(f"\nload average before/after: {res['load_before']:.2f} / {res['load_after']:.2f} (timings under load "
          "are noisy: the counts are the figure that does not depend on it)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
