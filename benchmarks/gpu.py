"""GPU configuration of the overhead benchmark: GPT-2-small, bf16 autocast, fused AdamW.

Runs by itself: ``python -m benchmarks.gpu`` (needs CUDA; ``--smoke`` on the CPU). Configurations, interleaved in rounds of blocks like the CPU
suite, all on ONE model and ONE fused AdamW:

* ``unguarded``: zero_grad, forward+loss under ``torch.autocast(bfloat16)``, backward, ``opt.step()``;
* ``guard_sync``: ``Guard(..., sync_free=False)`` (one host read per step);
* ``guard``: ``Guard(...)``: sync-free, the default on CUDA with a fused optimizer;
* ``recover``: ``Guard(..., recover="auto")`` (sync-free, cost-based snapshots).

A block is timed on the host around ``n`` steps with ``torch.cuda.synchronize()`` only
before and after the block (a per-step sync would hide what sync-free saves). Reported:
the median ratio to ``unguarded`` with a round-bootstrap interval, and the host syncs per
step of each configuration counted with :class:`nanguard.pytorch.syncs.HostSyncCounter`
(``torch.cuda.set_sync_debug_mode("warn")`` warnings, plus the dispatch-level reads).

``--smoke`` runs the same code on the CPU with a tiny GPT (a check that it works, no
timings worth reading).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import torch

from .models import GPT, GPTConfig

CONFIGS = ["unguarded", "guard_sync", "guard", "recover"]


def gpt2_small(device: torch.device, smoke: bool = False, batch: int = 8):
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768) if not smoke else \
        GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        seq = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        batches.append((seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)))
    dtype = torch.bfloat16

    def loss_fn(b):
        x, y = b
        with torch.autocast(device.type, dtype=dtype):
            logits = model(x)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    desc = (f"GPT {cfg.n_layer}L/{cfg.n_head}H/{cfg.n_embd}d, vocab {cfg.vocab_size}, ctx {cfg.block_size}, "
            f"batch {batch}, bf16 autocast, fused AdamW")
    return model, opt, batches, loss_fn, desc


class GpuRunner:
    def __init__(self, device: torch.device, smoke: bool) -> None:
        import nanguard
        self.device = device
        self.model, self.opt, self.batches, self.loss_fn, self.desc = gpt2_small(device, smoke)
        self.i = 0
        self.guards = {
            "guard_sync": nanguard.Guard(self.model, self.opt, quiet=True, bundle=None, sync_free=False),
            "guard": nanguard.Guard(self.model, self.opt, quiet=True, bundle=None, sync_free=True),
        }
        self._recover = None

    def batch(self):
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b

    def step(self, cfg: str) -> None:
        if cfg == "unguarded":
            self.opt.zero_grad(set_to_none=True)
            self.loss_fn(self.batch()).backward()
            self.opt.step()
            return
        if cfg == "recover":
            if self._recover is None:
                import nanguard
                self._recover = nanguard.Guard(self.model, self.opt, quiet=True, bundle=None, recover="auto",
                                               sync_free=True)
            g = self._recover
        else:
            g = self.guards[cfg]
        g.step(self.batch(), self.loss_fn)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def block(self, cfg: str, n: int) -> float:
        self.step(cfg)  # untimed: a guard's pending reads from another configuration's block settle
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            self.step(cfg)
        self.sync()
        return (time.perf_counter() - t0) / n

    def syncs_per_step(self, cfg: str, n: int = 8) -> Dict[str, float]:
        from nanguard.pytorch.syncs import HostSyncCounter
        for _ in range(2):
            self.step(cfg)
        self.sync()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with HostSyncCounter() as c:
                for _ in range(n):
                    self.step(cfg)
        return {"host_reads": c.count / n, "cuda_syncs": c.cuda_syncs / n, "by_kind": c.by_kind}


def run(device: Optional[str] = None, smoke: bool = False, seconds: float = 120.0, block: int = 10,
        min_rounds: int = 5) -> Dict[str, Any]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    r = GpuRunner(dev, smoke)
    for c in CONFIGS:  # warm-up: allocator, kernels, optimizer state, first (synchronous) guard steps
        r.block(c, 2 if smoke else 5)
    rng = random.Random(1234)
    times: Dict[str, List[float]] = {c: [] for c in CONFIGS}
    rounds: List[Dict[str, float]] = []
    t0 = time.perf_counter()
    while len(rounds) < min_rounds or time.perf_counter() - t0 < seconds:
        order = CONFIGS[:]
        rng.shuffle(order)
        rd = {}
        for c in order:
            rd[c] = r.block(c, block)
            times[c].append(rd[c])
        rounds.append(rd)
        if smoke and len(rounds) >= min_rounds:
            break
    base = statistics.median(times["unguarded"])
    out: Dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke)",
                           "model": r.desc, "rounds": len(rounds), "steps_per_block": block,
                           "unguarded_step_ms": round(1e3 * base, 3), "configs": {}}
    for c in CONFIGS:
        boot = []
        rs = random.Random(7)
        for _ in range(300):
            pick = [rounds[rs.randrange(len(rounds))] for _ in rounds]
            boot.append(statistics.median(p[c] for p in pick) / statistics.median(p["unguarded"] for p in pick))
        boot.sort()
        out["configs"][c] = {"median_ms": round(1e3 * statistics.median(times[c]), 3),
                             "ratio": round(statistics.median(times[c]) / base, 4),
                             "ratio_ci95": [round(boot[int(0.025 * len(boot))], 4), round(boot[int(0.975 * len(boot)) - 1], 4)],
                             "syncs_per_step": r.syncs_per_step(c)}
    g = r.guards["guard"]
    out["sync_free"] = {"reads": g.monitor.lazy.reads, "forced_reads": g.monitor.lazy.forced,
                        "rewinds": g._lazy.rewinds if g._lazy else None}
    if r._recover is not None:
        st = r._recover.policy.store
        out["snapshots"] = {"interval_steps": st.interval(), "copy_s": st.copy_seconds, "step_s": st.step_seconds,
                            "kept": [s.step for s in st.all()]}
    return out


def print_gpu(res: Dict[str, Any]) -> None:
    print(f"\nGPU configuration: {res['model']} on {res['device']}; unguarded step {res['unguarded_step_ms']:.1f} ms, "
          f"{res['rounds']} rounds x {res['steps_per_block']} steps")
    print(f"{'configuration':16s}{'ratio':>10s}{'95% CI':>18s}{'host reads/step':>18s}{'CUDA syncs/step':>18s}")
    for c, d in res["configs"].items():
        s = d["syncs_per_step"]
        print(f"{c:16s}{d['ratio']:>9.3f}x{d['ratio_ci95'][0]:>9.3f}-{d['ratio_ci95'][1]:<8.3f}"
              f"{s['host_reads']:>18.2f}{s['cuda_syncs']:>18.2f}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny GPT on the CPU: checks that the code runs")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --smoke to check the code on the CPU)", file=sys.stderr)
        return 2
    res = run("cpu" if args.smoke else None, smoke=args.smoke, seconds=0 if args.smoke else args.seconds,
              block=2 if args.smoke else 10, min_rounds=2 if args.smoke else 5)
    print_gpu(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
