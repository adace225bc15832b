"""nanguard overhead benchmark for TensorFlow/Keras: ``model.fit`` step time with the callback.

Run from the repository root (TensorFlow installed)::

    python -m benchmarks.tf_overhead            # full run (~6 min on 2 CPU cores)
    python -m benchmarks.tf_overhead --quick    # smoke run (~1.5 min; numbers are rough)
    python -m benchmarks.tf_overhead --models cnn --seconds 120 --out /tmp/tf.json

What it measures: for each model (a small CNN, a small transformer) ONE Keras model with ONE Adam
optimizer is trained with ``model.fit`` in one process, in interleaved blocks of three
configurations (every round runs one block of each, in a fresh seeded-random order):

* ``plain``: ``model.fit(ds, steps_per_epoch=n)``;
* ``nanguard``: the same with ``callbacks=[nanguard.keras.NanGuard(report=None, quiet=True)]``
  (the in-graph check, one host read per step; localization on, never triggered);
* ``check_numerics``: the same inside ``tf.debugging.enable_check_numerics()`` (what TensorFlow
  offers: a CheckNumerics op after every float op; it aborts at the first NaN).

Each block is one ``fit`` call: the train function is re-traced at its start (the check is traced
into it, or check_numerics' ops are), and the step times are the intervals between consecutive
``on_train_batch_end`` calls after ``--warm`` untimed steps, so tracing is never timed but
everything fit does per step is (the callback's host read included). The headline is
``median(step time of config) / median(step time of plain)``, with a 95% interval from resampling
whole rounds; ``nanguard / check_numerics`` is the ratio of the two medians. Blocks during which
other processes used >= 5% of the CPU are left out when enough quiet ones remain (the same
hygiene as ``benchmarks/overhead.py``, see :mod:`benchmarks.timing`). ``graph_ops`` counts the ops
of each configuration's traced train step (its function library included): what the check adds.

Never used as a test: timings here are measurements, not assertions.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from .timing import QUIET, CpuMeter, keep_freed_memory, ratios, round_bootstrap  # noqa: E402

THREADS = 2
CONFIGS = ["plain", "nanguard", "check_numerics"]
LABELS = {"plain": "plain model.fit", "nanguard": "fit + nanguard.keras.NanGuard",
          "check_numerics": "fit under tf.debugging.enable_check_numerics"}
BUDGET = 1.03   # issue 11: the callback's step time against a plain fit


# =========================================================================== models

def make_cnn(batch: int = 64, n_batches: int = 8, seed: int = 0):
    """A small CNN on 32x32x3 images, 10 classes (~60k parameters)."""
    import keras
    import numpy as np
    keras.utils.set_random_seed(seed)
    L = keras.layers
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        L.Conv2D(32, 3, padding="same", activation="relu"), L.Conv2D(32, 3, padding="same", activation="relu"),
        L.MaxPooling2D(), L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPooling2D(),
        L.Conv2D(64, 3, padding="same", activation="relu"), L.GlobalAveragePooling2D(), L.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((batch * n_batches, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, batch * n_batches).astype("int32")
    return model, x, y, batch, "CNN: 4 conv (32-64 ch) + dense, 32x32x3, batch 64"


def make_transformer(batch: int = 16, seq: int = 64, vocab: int = 2000, d: int = 64, n_batches: int = 8,
                     seed: int = 0):
    """A small causal transformer (2 blocks, d=64, 4 heads), next-token loss (~300k parameters)."""
    import keras
    import numpy as np
    keras.utils.set_random_seed(seed)
    L = keras.layers
    tok = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, d)(tok) + L.Embedding(seq, d)(keras.ops.arange(seq))
    for _ in range(2):
        a = L.LayerNormalization()(h)
        h = h + L.MultiHeadAttention(4, d // 4)(a, a, use_causal_mask=True)
        m = L.LayerNormalization()(h)
        h = h + L.Dense(d)(L.Dense(4 * d, activation="gelu")(m))
    out = L.Dense(vocab)(L.LayerNormalization()(h))
    model = keras.Model(tok, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed + 1)
    toks = rng.integers(0, vocab, (batch * n_batches, seq + 1)).astype("int32")
    return model, toks[:, :-1], toks[:, 1:], batch, f"transformer: 2 blocks, d={d}, 4 heads, seq {seq}, " \
        f"vocab {vocab}, batch {batch}"


MAKERS: Dict[str, Callable] = {"cnn": make_cnn, "transformer": make_transformer}


# =========================================================================== one model

class Runner:
    """One compiled model, fitted in blocks under any configuration."""

    def __init__(self, name: str) -> None:
        import tensorflow as tf
        self.tf = tf
        self.model, x, y, self.batch, self.desc = MAKERS[name]()
        self.ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(self.batch, drop_remainder=True).repeat()
        self.n_params = int(sum(int(v.shape.num_elements() or 0) for v in self.model.trainable_variables))
        self.graph_ops: Dict[str, Optional[int]] = {}
        self.faults: List[float] = []   # minor page faults per timed step of the latest block

    def block(self, cfg: str, n_warm: int, n_timed: int) -> List[float]:
        """Step times (s) of one fit call: ``n_warm`` untimed steps, then ``n_timed`` timed ones."""
        import keras
        import nanguard.keras as nk
        tf = self.tf
        ends: List[float] = []
        flts: List[int] = []
        clock = time.perf_counter

        def mark(b, logs):
            ends.append(clock())
            flts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        timer = keras.callbacks.LambdaCallback(on_train_batch_end=mark)
        cbs: List[Any] = [timer]
        if cfg == "nanguard":
            cbs.insert(0, nk.NanGuard(report=None, quiet=True))
        if cfg not in self.graph_ops:  # counted before the callback's own on_train_end drops the function
            cbs.insert(0, keras.callbacks.LambdaCallback(on_train_end=lambda logs: self.graph_ops.setdefault(
                cfg, count_graph_ops(self.model.train_function))))
        self.model.train_function = None   # every block traces its own train step (untimed)
        if cfg == "check_numerics":
            tf.debugging.enable_check_numerics()
        try:
            self.model.fit(self.ds, epochs=1, steps_per_epoch=n_warm + n_timed + 1, verbose=0, callbacks=cbs,
                           shuffle=False)
        finally:
            if cfg == "check_numerics":
                tf.debugging.disable_check_numerics()
        diffs = [b - a for a, b in zip(ends, ends[1:])]
        self.faults = [b - a for a, b in zip(flts, flts[1:])][n_warm:]
        return diffs[n_warm:]


def _tf_functions(fn: Any, depth: int = 3) -> list:
    """The ``tf.function``s behind Keras' train function (a Python closure over them)."""
    if hasattr(fn, "_list_all_concrete_functions_for_serialization"):
        return [fn]
    out: list = []
    if depth > 0:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                out += _tf_functions(cell.cell_contents, depth - 1)
            except ValueError:   # an empty cell
                pass
    return out


def count_graph_ops(fn: Any) -> Optional[int]:
    """Ops of a traced train function (every concrete function and the functions they call)."""
    try:
        cfs = [cf for f in _tf_functions(fn) for cf in f._list_all_concrete_functions_for_serialization()]
    except Exception:
        return None
    if not cfs:
        return None
    seen, total = set(), 0
    stack = [cf.graph for cf in cfs]
    while stack:
        g = stack.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        total += len(g.get_operations())
        for f in getattr(g, "_functions", {}).values():
            sub = getattr(f, "graph", None)
            if sub is not None:
                stack.append(sub)
    return total


def faults_by_config(blocks: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Minor page faults per timed step, per configuration: the median, and the share of steps above 1000
    (~4 MB of fresh pages: a step whose large temporaries, e.g. a convolution's im2col buffer, were
    mmap'ed anew by the C allocator). Measured (issue 23): the same fit, plain or guarded, runs for blocks at
    ~5 faults per step and for others at 10-23k (10-20 ms of kernel time per step), depending on the
    allocator's state, not on the configuration; a ratio taken over blocks in different states is not the
    check's cost. Counts, not timings: free of the machine's noise."""
    out: Dict[str, Dict[str, float]] = {}
    for c in CONFIGS:
        fs = [f for b in blocks if b["config"] == c for f in b.get("faults") or []]
        if fs:
            out[c] = {"median": float(statistics.median(fs)), "share_above_1000": round(sum(f > 1000 for f in fs) / len(fs), 3)}
    return out


def time_model(name: str, args, meter: CpuMeter) -> Dict[str, Any]:
    r = Runner(name)
    warm = {c: min(r.block(c, 1, 2) or [float("inf")]) for c in CONFIGS}
    load_before = os.getloadavg()
    rng = random.Random(1234)
    blocks: List[Dict[str, Any]] = []
    waited, rounds = 0.0, 0
    t_start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - t_start
        if args.rounds:
            if rounds >= args.rounds:
                break
        elif rounds >= args.max_rounds or elapsed > args.seconds * 1.5 or (
                rounds >= args.min_rounds and elapsed > args.seconds):
            break
        order = CONFIGS[:]
        rng.shuffle(order)
        for c in order:
            waited += meter.wait_quiet(QUIET / 2, min(args.block_wait, args.max_wait - waited))
            a = meter.sample()
            ts = r.block(c, args.warm, args.block)
            blocks.append({"round": rounds, "config": c, "times": ts, "others_cpu": meter.others(a, meter.sample()),
                           "faults": list(r.faults)})
        rounds += 1
    blocks = [b for b in blocks if b["times"]]
    quiet = [b for b in blocks if b["others_cpu"] < QUIET]
    n_quiet = {c: sum(1 for b in quiet if b["config"] == c) for c in CONFIGS}
    use_quiet = min(n_quiet.values()) >= max(2, rounds // 4)
    chosen = quiet if use_quiet else blocks
    cfgs = ratios(chosen, CONFIGS)
    ng, cn = cfgs["nanguard"].get("median_ms"), cfgs["check_numerics"].get("median_ms")
    return {
        "model": name, "desc": r.desc, "n_params": r.n_params, "rounds": rounds,
        "timed_steps_per_block": args.block, "wall_s": round(time.perf_counter() - t_start, 1),
        "waited_for_quiet_s": round(waited, 1), "blocks_quiet": len(quiet), "blocks_total": len(blocks),
        "headline_uses": "quiet blocks" if use_quiet else "all blocks (too few quiet ones)",
        "valid": min(n_quiet.values()) >= (2 if args.quick else 4),
        "loadavg_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "warm_step_ms": {c: round(1e3 * v, 2) for c, v in warm.items()},
        "configs": cfgs, "configs_all_blocks": ratios(blocks, CONFIGS),
        "ratio_ci95_by_round_bootstrap": round_bootstrap(chosen, CONFIGS),
        "nanguard_vs_check_numerics": round(ng / cn, 4) if ng and cn else None,
        "graph_ops": r.graph_ops,
        "minor_faults_per_step": faults_by_config(chosen),
        "raw_blocks": [{"r": b["round"], "c": b["config"], "ms": [round(1e3 * t, 2) for t in b["times"]],
                        "faults": b.get("faults"),
                        "others": round(b["others_cpu"], 3)} for b in blocks],
    }


# =========================================================================== report

def machine() -> Dict[str, Any]:
    import keras
    import tensorflow as tf
    return {"python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__,
            "cpu_count": os.cpu_count(), "threads": THREADS, "platform": platform.platform()}


def budgets(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for m, t in res.get("timing", {}).items():
        v = t["configs"]["nanguard"]["ratio"]
        ci = t.get("ratio_ci95_by_round_bootstrap", {}).get("nanguard")
        ok = t.get("valid", True) and v is not None and not res.get("quick")
        out.append({"what": f"NanGuard callback step-time ratio on {m}"
                    + (f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""),
                    "value": v, "limit": BUDGET, "met": (v <= BUDGET) if ok else None,
                    "why_not_judged": None if ok else ("quick mode: a few samples only" if res.get("quick")
                                                       else "other processes held the CPU; re-run")})
    return out


def print_tables(res: Dict[str, Any]) -> None:
    for m, t in res.get("timing", {}).items():
        print(f"\n{m}: {t['desc']} ({t['n_params']:,} parameters); {t['rounds']} rounds, "
              f"{t['blocks_quiet']}/{t['blocks_total']} quiet blocks, headline on {t['headline_uses']}"
              + ("" if t["valid"] else "  [NOT VALID: too few quiet blocks]"))
        ci = t.get("ratio_ci95_by_round_bootstrap", {})
        for c in CONFIGS:
            d = t["configs"][c]
            if not d.get("n"):
                print(f"  {LABELS[c]:<46} no samples")
                continue
            rng = f"  95% CI {ci[c][0]:.3f}-{ci[c][1]:.3f}" if c in ci else ""
            print(f"  {LABELS[c]:<46} {d['median_ms']:8.2f} ms  x{d['ratio']:.3f} (paired x{d['ratio_paired']:.3f},"
                  f" p25 x{d['ratio_p25']:.3f}){rng}  graph ops {t['graph_ops'].get(c)}"
                  + (f"  faults/step {t['minor_faults_per_step'][c]['median']:.0f}"
                     f" ({100 * t['minor_faults_per_step'][c]['share_above_1000']:.0f}% > 1000)"
                     if c in t.get("minor_faults_per_step", {}) else ""))
        if t.get("nanguard_vs_check_numerics") is not None:
            print(f"  nanguard / check_numerics: x{t['nanguard_vs_check_numerics']:.3f}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tf_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fast smoke mode (few rounds; numbers are rough)")
    ap.add_argument("--out", default=None, help="JSON output path (default benchmarks/tf_results.json; "
                                                "benchmarks/tf_results_quick.json with --quick)")
    ap.add_argument("--models", default="cnn,transformer", help="comma list of cnn,transformer")
    ap.add_argument("--seconds", type=float, default=None, help="time budget of the rounds per model")
    ap.add_argument("--rounds", type=int, default=None, help="fixed number of rounds (overrides --seconds)")
    ap.add_argument("--block", type=int, default=None, help="timed steps per block")
    ap.add_argument("--warm", type=int, default=None, help="untimed steps per block after the traced one")
    ap.add_argument("--no-mallopt", action="store_true", help="keep glibc's default of returning freed memory")
    args = ap.parse_args(argv)
    mallopt = False if args.no_mallopt else keep_freed_memory()
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    q = args.quick
    args.block = args.block or (10 if q else 30)
    args.warm = args.warm if args.warm is not None else 2
    args.seconds = args.seconds if args.seconds is not None else (25.0 if q else 150.0)
    args.min_rounds, args.max_rounds = (2, 3) if q else (6, 40)
    args.max_wait = 5.0 if q else 60.0
    args.block_wait = 1.0 if q else 5.0
    meter = CpuMeter()
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "tf_results_quick.json" if q else "tf_results.json")
    t0 = time.time()
    res: Dict[str, Any] = {"machine": machine(), "quick": q,
                           "command": "python -m benchmarks.tf_overhead" + (" --quick" if q else ""),
                           "allocator": "glibc mallopt" if mallopt else "glibc default", "timing": {}}
    for m in [s.strip() for s in args.models.split(",") if s.strip()]:
        print(f"[{time.time() - t0:5.0f}s] step time: {m} ...", file=sys.stderr, flush=True)
        res["timing"][m] = time_model(m, args, meter)
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


if __name__ == "__main__":
    sys.exit(main())
