"""Instructions per healthy step (valgrind callgrind): the host-cost figure that other processes' load cannot move.

``benchmarks.dispatch``'s CPU times swing 0.95-1.30x on a loaded 2-core machine; the instructions a
step executes do not depend on the load (two runs agree within ~0.3 M of ~59 M on the tiny GPT).
This runs the dispatch benchmark's models under callgrind, counting ``--steps`` healthy steps of each
configuration after 24 warm ones in the same block (a zero-code watcher counted at its steady state:
its early warning's rules all filled; one process: the import and set-up run uninstrumented; the
garbage collector off while counting), and prints the instructions per step and the ratio to the
unguarded step::

    python -m benchmarks.instructions                          # gpt: unguarded, guard, zerocode (~5 min)
    python -m benchmarks.instructions --models gpt,cnn --configs unguarded,guard,zerocode,recover

Instructions are not time: a memory-bound copy costs more time per instruction than Python does,
so read this beside the timed benchmark, not instead of it. One artefact is removed: valgrind counts
each iteration of a ``rep movsb``/``rep stosb`` as an instruction (a byte each), and glibc's
``memcpy``/``memset`` use them for copies of a few KiB, so a 620 KB ``torch.cat`` of 148 small
tensors counted 0.55 M where the same bytes through the vector loop count ~0.08 M. The counted
process therefore runs with glibc's string-instruction thresholds raised (``GLIBC_TUNABLES``, the
same for every configuration; ``--rep-strings`` keeps glibc's defaults). Needs ``valgrind`` and a C
compiler (the client-request helper is compiled once into a temporary folder); never used as a test.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from typing import Any, Dict, List

_HELPER = r"""
#include <valgrind/callgrind.h>
void ng_start(void){ CALLGRIND_START_INSTRUMENTATION; }
void ng_stop(void){ CALLGRIND_STOP_INSTRUMENTATION; }
void ng_zero(void){ CALLGRIND_ZERO_STATS; }
void ng_dump(const char* s){ CALLGRIND_DUMP_STATS_AT(s); }
"""


def _helper(folder: str) -> str:
    src, lib = os.path.join(folder, "ngcg.c"), os.path.join(folder, "libngcg.so")
    with open(src, "w") as f:
        f.write(_HELPER)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


def child(lib: str, model: str, configs: List[str], steps: int, warm: int = 24) -> None:
    """Inside valgrind: run each configuration's ``warm`` steps, then ``steps`` counted ones, in one block."""
    import torch
    from .dispatch import MAKERS, floor_step, on_device
    from .overhead import Runner
    cg = ctypes.CDLL(lib)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    r = Runner(on_device(MAKERS[model](), "cpu"))
    r.steps["floor"] = floor_step(r)
    cg.ng_start()
    for c in configs:
        with r.context(c):  # (zero-code: a fresh watcher, warmed in the same block as it is counted)
            s = r.steps[c]
            for _ in range(warm):  # lazily made plans, buffers and caches; the early warning's rules filled
                s()
            gc.collect()
            gc.disable()  # a collection falling inside one configuration's few counted steps is noise
            cg.ng_zero()
            for _ in range(steps):
                s()
            cg.ng_dump(c.encode())
            gc.enable()
    cg.ng_stop()


# glibc's memcpy/memset: the vector loop at every size (see the module docstring)
_NO_REP_STRINGS = "glibc.cpu.x86_rep_movsb_threshold=1099511627776:glibc.cpu.x86_rep_stosb_threshold=1099511627776"


def measure(model: str, configs: List[str], steps: int, folder: str, lib: str,
            rep_strings: bool = False, cache: bool = False) -> Dict[str, Any]:
    out = os.path.join(folder, f"cg.{model}")
    env = dict(os.environ)
    if not rep_strings:
        env["GLIBC_TUNABLES"] = ":".join(x for x in (env.get("GLIBC_TUNABLES"), _NO_REP_STRINGS) if x)
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                    *(["--cache-sim=yes", "--branch-sim=yes"] if cache else []),
                    sys.executable, "-m", "benchmarks.instructions", "--child", lib, model, ",".join(configs),
                    str(steps)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    per: Dict[str, Any] = {}
    for f in glob.glob(out + ".*"):
        txt = open(f).read()
        trig = re.search(r"^desc: Trigger: Client Request: (.*)$", txt, re.M)
        total = re.search(r"^summary: ([\d ]+)$", txt, re.M)
        events = re.search(r"^events: (.*)$", txt, re.M)
        if trig and total:
            vals = [int(x) / steps for x in total.group(1).split()]
            per[trig.group(1).strip()] = vals[0] if not cache else dict(zip(events.group(1).split(), vals))
    return per


def main(argv: List[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1], argv[2], argv[3].split(","), int(argv[4]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m benchmarks.instructions", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt")
    ap.add_argument("--configs", default="unguarded,guard,zerocode", help="unguarded first (the ratios' base)")
    ap.add_argument("--steps", type=int, default=12,
                    help="counted steps per configuration (12: whole rotations of 1, 2, 3 or 4 parameter "
                         "slices; the CNN's count moved +-0.05 M between runs of 6, +-0.01 M of 12)")
    ap.add_argument("--cache-sim", action="store_true",
                    help="also simulate the caches and the branch predictor (valgrind's models): the misses and "
                         "mispredicted branches per step, which the instruction count does not see (a copy evicting "
                         "the step's data; the interpreter dispatching cold bytecode)")
    ap.add_argument("--rep-strings", action="store_true",
                    help="keep glibc's rep movsb/stosb copies (valgrind counts each byte: copies weigh ~7x)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        print("needs valgrind and a C compiler (cc)", file=sys.stderr)
        return 2
    configs = args.configs.split(",")
    with tempfile.TemporaryDirectory(prefix="nanguard-cg-") as folder:
        lib = _helper(folder)
        for model in args.models.split(","):
            per = measure(model, configs, args.steps, folder, lib, args.rep_strings, args.cache_sim)
            if args.cache_sim:
                print(f"\n{model}: per healthy step (callgrind --cache-sim --branch-sim; I1/D1/LL: misses in L1 code / L1 data / the last level; Bcm/Bim: mispredicted conditional / indirect branches)")
                b = per.get(configs[0]) or {}
                for c in configs:
                    row = per.get(c) or {}
                    print(f"  {c:10s} " + "  ".join(
                        f"{k} {row.get(k, 0) / 1e3:9.1f} k ({(row.get(k, 0) - b.get(k, 0)) / 1e3:+.1f})"
                        for k in ("Ir", "I1mr", "D1mr", "D1mw", "DLmr", "DLmw", "Bcm", "Bim")))
                continue
            base = per.get(configs[0])
            print(f"\n{model}: instructions per healthy step (callgrind)")
            for c in configs:
                if c not in per:
                    print(f"  {c:10s} (no count)")
                    continue
                ratio = f"  {per[c] / base:.4f}x  ({(per[c] - base) / 1e6:+.3f} M)" if base else ""
                print(f"  {c:10s} {per[c] / 1e6:9.3f} M{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
