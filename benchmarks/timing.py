"""Timing helpers shared by the overhead benchmarks (PyTorch ``overhead.py``, TensorFlow ``tf_overhead.py``):
a quiet-machine meter, glibc's allocator setting, and median ratios with a round bootstrap.

A block is ``{"round": r, "config": c, "times": [seconds...], "others_cpu": share}``; ratios are
against the first config of the list (the unguarded one). No framework is imported here.
"""
from __future__ import annotations

import math
import os
import random
import statistics
import time
from typing import Any, Dict, List

__all__ = ["keep_freed_memory", "quantile", "CpuMeter", "QUIET", "ratios", "round_bootstrap"]


def keep_freed_memory() -> bool:
    """glibc malloc: keep freed memory in the process (no trimming; no mmap below 32 MiB).

    By default glibc hands large freed blocks back to the OS, and the next step faults them
    in again: on this VM 2-13k page faults per step, adding 5-15% of noise that has nothing to
    do with what is measured. A caching allocator (jemalloc/tcmalloc, as PyTorch's CPU tuning
    guide recommends, or this) removes it; it applies to every configuration alike.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except Exception:
        return False



def quantile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)



class CpuMeter:
    """CPU time used by *other* processes on this machine (``/proc/stat`` minus this process).

    A shared machine (other jobs, test suites) can slow a 2-thread step 10x in bursts. The
    benchmark waits for a quiet machine before each block and flags the blocks during which
    others used CPU; the headline ratios use the quiet blocks (selected by this external
    signal, never by the step times themselves, so no configuration is favoured).
    """

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.ncpu = os.cpu_count() or 1
        try:
            self.sample()
            self.ok = True
        except (OSError, ValueError, IndexError):
            self.ok = False

    @staticmethod
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        busy = sum(v) - v[3] - v[4]  # all but idle and iowait
        with open("/proc/self/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        return time.perf_counter(), busy, int(st[11]) + int(st[12])  # utime + stime, all threads

    def others(self, a, b) -> float:
        """Share of the machine's CPU capacity used by other processes between samples a and b."""
        if not self.ok:
            return 0.0
        dt = max(b[0] - a[0], 1e-6)
        return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (dt * self.hz * self.ncpu))

    def wait_quiet(self, threshold: float, max_wait: float, probe: float = 0.5) -> float:
        """Sleep until other processes use < threshold of the machine (or max_wait passes)."""
        if not self.ok or max_wait <= 0:
            return 0.0
        t0 = time.perf_counter()
        while True:
            a = self.sample()
            time.sleep(probe)
            if self.others(a, self.sample()) < threshold or time.perf_counter() - t0 >= max_wait:
                return time.perf_counter() - t0


QUIET = 0.05  # a block is "quiet" when other processes used < 5% of the machine's CPU during it



def round_bootstrap(blocks: List[Dict[str, Any]], configs: List[str], n: int = 300) -> Dict[str, List[float]]:
    """95% interval of each config's median ratio to the first config's, resampling whole rounds (keeps
    the pairing)."""
    base_cfg = configs[0]
    rounds = sorted({b["round"] for b in blocks})
    by_round = {r: [b for b in blocks if b["round"] == r] for r in rounds}
    rng = random.Random(7)
    acc: Dict[str, List[float]] = {c: [] for c in configs[1:]}
    for _ in range(n):
        pick = [b for _r in (rng.choice(rounds) for _ in rounds) for b in by_round[_r]]
        samples: Dict[str, List[float]] = {c: [] for c in configs}
        for b in pick:
            samples[b["config"]].extend(b["times"])
        if not samples[base_cfg]:
            continue
        base = statistics.median(samples[base_cfg])
        for c in configs[1:]:
            if samples[c]:
                acc[c].append(statistics.median(samples[c]) / base)
    out = {}
    for c, rs in acc.items():
        if rs:
            rs.sort()
            out[c] = [round(rs[int(0.025 * len(rs))], 4), round(rs[min(len(rs) - 1, int(0.975 * len(rs)))], 4)]
    return out


def ratios(blocks: List[Dict[str, Any]], configs: List[str]) -> Dict[str, Any]:
    """Per config: median step time, its ratio to the first config's, the per-round paired ratio and
    the 25th-percentile ratio (cross-checks)."""
    base_cfg = configs[0]
    samples: Dict[str, List[float]] = {c: [] for c in configs}
    by_round: Dict[int, Dict[str, float]] = {}
    for b in blocks:
        samples[b["config"]].extend(b["times"])
        by_round.setdefault(b["round"], {})[b["config"]] = statistics.median(b["times"])
    if not samples[base_cfg]:
        return {c: {"n": 0, "median_ms": None, "ratio": None, "ratio_paired": None, "ratio_p25": None}
                for c in configs}
    base = statistics.median(samples[base_cfg])
    base25 = quantile(samples[base_cfg], 0.25)
    out = {}
    for c in configs:
        xs = samples[c]
        if not xs:
            out[c] = {"n": 0, "median_ms": None, "ratio": None, "ratio_paired": None, "ratio_p25": None}
            continue
        paired = [d[c] / d[base_cfg] for d in by_round.values() if c in d and base_cfg in d]
        out[c] = {
            "n": len(xs), "median_ms": round(1e3 * statistics.median(xs), 3),
            "p25_ms": round(1e3 * quantile(xs, 0.25), 3), "p75_ms": round(1e3 * quantile(xs, 0.75), 3),
            "ratio": round(statistics.median(xs) / base, 4),
            "ratio_paired": round(statistics.median(paired), 4) if paired else None,
            "ratio_p25": round(quantile(xs, 0.25) / base25, 4),
        }
    return out
