"""The recovery budget: how many recoveries a run may have before it stops with the diagnosis.

At most ``max_recoveries`` recoveries in ``window`` steps (by default 10, and a quarter of the window while each was
a plain skip: batches the computation cannot learn from) and at most
``max_consecutive`` failing steps in a row; for bad input data (batches skipped
without touching the weights) at most ``max_data_skips`` in the window and
``max_consecutive_data`` in a row; for a computation that fails on a few samples
of finite data (skipped the same way) also at most ``max_sample_skips`` in the last
``sample_window`` steps: samples it fails on in half the batches are common, not rare
bad rows (the Keras bag scenario skips 13 batches in 50 steps, at most 6 in any 20; a ReLU scale head at
exactly 0 recovers with 11 in 20; a Poisson GLM whose weights grew fails in 15 of 20). A plain rollback (nothing else changed) whose
replay of the same state, data and RNG fails again at the same point is out of
budget too: a rollback alone cannot fix it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

DATA_CATEGORY = "bad_input_data"


class RecoveryBudget:
    """Steps that were recovered, and whether one more recovery at ``step`` is within budget."""

    def __init__(self, max_recoveries: Optional[int] = None, window: int = 100, max_consecutive: int = 3,
                 max_data_skips: int = 50, max_consecutive_data: int = 8, max_sample_skips: int = 15,
                 sample_window: int = 20) -> None:
        # None: 10, and a quarter of the window for plain skips (``_recoveries_limit``); a number: that, for both
        self.given = max_recoveries
        self.max_recoveries = 10 if max_recoveries is None else max_recoveries
        self.window, self.max_consecutive = window, max_consecutive
        self.max_data_skips, self.max_consecutive_data = max_data_skips, max_consecutive_data
        self.max_sample_skips, self.sample_window = max_sample_skips, sample_window
        self.recovery_steps: List[int] = []
        self.data_steps: List[int] = []    # bad input data skipped without touching the weights
        self.sample_steps: List[int] = []  # finite samples a computation failed on, skipped the same way
        self.plain: List[int] = []         # recoveries that dropped the update and did nothing else
        self.counts: Dict[str, int] = {}   # recoveries per category
        self.version = 0  # bumped by every action that changes how training runs (lr, clip, dtype, scale)
        self.last_rollback: Optional[Dict[str, Any]] = None

    def exhausted(self, step: int, category: str, data: Optional[bool] = None, consecutive: bool = True) -> Optional[str]:
        """Why a recovery at ``step`` is over budget, or None. ``data``: count it against the bad-data
        allowance (default: for bad input data; the policy also says so for per-sample failures).
        ``consecutive``: False where failing steps in a row are expected (a schedule's non-finite rate)."""
        samples = bool(data) and category != DATA_CATEGORY
        data = category == DATA_CATEGORY or bool(data)
        if samples:
            left, window, limit = self._samples_left(step)
            if not left:
                return (f"the failure ({category}) recurred on a few samples at {limit} of the last "
                        f"{window} steps (limit {limit}): the data is finite and the "
                        "samples it fails on are common, so skipping them would hide a computation that fails on "
                        "ordinary inputs; fix the op")
        steps, limit = self._kind(data, False, step)
        recent = [s for s in steps + (self.sample_steps if samples else []) if s > step - self.window]
        if len(recent) >= limit:
            what = "bad-data skips" if data else "recoveries"
            return (f"recovery budget exhausted: {len(recent)} {what} in the last {self.window} steps "
                    f"(limit {limit})")
        done = set(self.recovery_steps) | set(self.data_steps) | set(self.sample_steps)
        run = 1
        while step - run in done:
            run += 1
        limit = self.max_consecutive_data if data else self.max_consecutive
        if run > limit and consecutive:
            if category == DATA_CATEGORY:
                return (f"batches in a row held non-finite data {run} steps in a row (limit {limit}): most of the "
                        "data is bad, skipping would train on what is left")
            if data:  # a few samples per batch, on finite data: the computation fails on them, not the data
                return (f"the failure recurred on a few samples of each batch {run} steps in a row (limit {limit}): "
                        f"the data is finite, the computation ({category}) fails on samples that are common, "
                        "skipping them would train on what is left; fix the op")
            return (f"the failure recurred {run} steps in a row (limit {limit}): a deterministic bug, not a rare "
                    "bad batch; recovery would only hide it")
        return None

    def _kind(self, data: bool, samples: bool, step: Optional[int] = None) -> tuple:
        """The steps counted and the limit of a recovery, a bad-data skip or a failing-samples skip."""
        if samples:
            return self.sample_steps, self.max_sample_skips
        if data:
            return self.data_steps, self.max_data_skips
        return self.recovery_steps, self.max_recoveries if step is None else self._recoveries_limit(step)

    def _recoveries_limit(self, step: int) -> int:
        """``max_recoveries``, or a quarter of the window while every recovery in it dropped its update and did
        nothing else: batches the computation cannot learn from, each skipped (a masked RMSE's sqrt(0) on the days
        nothing is scored, one batch in six; the in-a-row limit still stops a failure the weights make)."""
        recent = [s for s in self.recovery_steps if s > step - self.window]
        if self.given is None and all(s in self.plain for s in recent):
            return max(self.max_recoveries, self.window // 4)
        return self.max_recoveries

    def left(self, step: int, data: bool = False, samples: bool = False) -> int:
        """Recoveries (bad-data skips, failing-samples skips) still allowed at ``step``."""
        if samples:
            return self._samples_left(step)[0]
        steps, limit = self._kind(data, False, step)
        return max(limit - len([s for s in steps if s > step - self.window]), 0)

    def _samples_left(self, step: int) -> Tuple[int, int, int]:
        """(skips of failing samples left, over which window, its limit): the tighter of a dense limit (15 of
        20 steps) and a persistent one (a quarter of the last ``window`` steps)."""
        return min((max(limit - len([s for s in self.sample_steps if s > step - window]), 0), window, limit)
                   for window, limit in ((self.sample_window, self.max_sample_skips), (self.window, self.window // 4)))

    def allowance(self, step: int, data: bool = False, samples: bool = False) -> Dict[str, int]:
        """``{"recoveries": left, "window": steps}``: what :meth:`left` allows, and over how many steps (a
        sliding window: the count may go up again)."""
        if samples:
            left, window, _ = self._samples_left(step)
            return {"recoveries": left, "window": window}
        return {"recoveries": self.left(step, data), "window": self.window}

    def replay_failed(self, step: int, category: str) -> Optional[str]:
        """A rollback that changed nothing else replays the same state and data (the RNG is rewound too):
        the same failure at the same point of the replay means a rollback alone cannot fix it."""
        last = self.last_rollback
        if last is None or last["version"] != self.version or last["category"] != category:
            return None
        failed, target = last["step"], last["to_step"]
        if target >= failed:  # back to the failing step's own start: no step was replayed, the next ones are new
            return None
        if step - failed <= (failed - target) + 2:
            return (f"rolled back to step {target} at step {failed}, and replaying the same state and data "
                    f"failed again at step {step}: a rollback alone cannot fix this")
        return None

    def training_changed(self) -> None:
        self.version += 1

    def plain_rollback(self, step: int, to_step: int, category: str) -> None:
        """A rollback with nothing else changed: its replay will be identical."""
        self.last_rollback = {"step": step, "to_step": to_step, "category": category, "version": self.version}

    def spend(self, step: int, category: str, data_skip: bool, plain_skip: bool = False) -> int:
        """Count a recovery at ``step``; returns the run's number of recoveries so far. Bad input data counts
        against the bad-data allowance whatever was done (a rollback past an outlier batch too): the allowance
        :meth:`exhausted` checks it against. ``plain_skip``: the update was dropped and nothing else done."""
        data = data_skip or category == DATA_CATEGORY
        if plain_skip and not data:
            self.plain.append(step)
        self._kind(data, data_skip and category != DATA_CATEGORY)[0].append(step)
        self.counts[category] = self.counts.get(category, 0) + 1
        return len(self.recovery_steps) + len(self.data_steps) + len(self.sample_steps)
