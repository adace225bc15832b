"""The experiments' budget is counted in work (replays of one step), not seconds: the same failure gets the
same experiments and the same cause whatever the machine's load (issue 22)."""
import time

from nanguard.core.events import Event
from nanguard.core.experiments import Bench, Experiment, ExperimentConfig, investigate


class SlowBench(Bench):
    """float64 says nothing decisive; the domain guard confirms. Each replay takes ``slowdown`` x a 1 s
    step on the wall clock (a loaded machine), which the bench also reports as its seconds."""

    def __init__(self, slowdown):
        self.slowdown, self.ran = slowdown, []

    def capabilities(self, origin):
        return {"batch_size": 4, "module_chain": [], "float64": True, "op_patch": True, "compiled": False,
                "snapshots": [], "lrs": [0.1]}

    def step_seconds(self):
        return 1.0

    def run(self, spec, replays_left):
        self.ran.append(spec.kind)
        fin = {"float64_step": False, "domain_guard": True}.get(spec.kind)
        return Experiment(spec.kind, spec.kind, params=dict(spec.params), finite=fin, replays=1,
                          seconds=1.0 * self.slowdown)


def _event():
    origin = {"op": "aten.log.default", "dtype": "float16", "module": "", "file": "t.py", "line": 3,
              "output": {"nan": 0, "posinf": 0, "neginf": 4}, "inputs": [{"zeros": 4, "numel": 64}],
              "samples": [0, 1, 2, 3], "shape": [4, 16]}
    return Event(step=7, phase="forward", origin=origin,
                 cause={"category": "log_domain", "summary": "log of 0", "confidence": 0.8, "evidence": {}},
                 fixes=["clamp"], localization={"reproduced": True, "method": "replayed"})


def _outcome(slowdown, monkeypatch):
    clock = [0.0]

    def slow_clock():  # every read of the clock is far later than the last: a machine under load
        clock[0] += 7.0 * slowdown
        return clock[0]

    monkeypatch.setattr(time, "perf_counter", slow_clock)
    ev, bench = _event(), SlowBench(slowdown)
    investigate(ev, bench, ExperimentConfig())
    return bench.ran, ev.cause["category"], (ev.cause.get("confirmed_by") or {}).get("kind"), \
        ev.cause["evidence"]["experiments_cost"]


def test_same_experiments_and_cause_on_a_slow_clock(monkeypatch):
    fast = _outcome(1.0, monkeypatch)
    slow = _outcome(40.0, monkeypatch)
    assert fast[:3] == slow[:3]
    assert fast[0] == ["float64_step", "domain_guard"] and fast[2] == "domain_guard"
    assert slow[3]["replays"] == fast[3]["replays"] == 2.0 and slow[3]["budget_replays"] == 3.0
    assert slow[3]["seconds"] > fast[3]["seconds"]  # the time is reported, it does not decide


def test_the_budget_counts_replays():
    ev = _event()
    bench = SlowBench(1.0)
    investigate(ev, bench, ExperimentConfig(budget_steps=2.0))  # float64 (1.3) fits, then 1 + 1.5 does not
    assert bench.ran == ["float64_step"]
    assert ev.cause["evidence"]["experiments_cost"]["not_run_for_budget"] == ["domain_guard"]
