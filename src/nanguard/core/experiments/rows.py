"""Batch rows, framework-neutral: the rows left when some are dropped, and finding the rows that make a
step fail on their own by bisection (group testing over replays of the step on sub-batches)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple


def complement(rows: Sequence[int], size: int) -> List[int]:
    drop = set(rows)
    return [r for r in range(size) if r not in drop]


def bisect_rows(fails: Callable[[List[int]], Optional[bool]], size: int, max_tests: int,
                max_culprits: Optional[int] = None) -> Tuple[Optional[List[int]], int, str]:
    """Find the batch rows that make the step fail on their own (group testing: a failing group is
    split in halves, each half replayed alone). ``fails(rows)`` replays the step on ``rows`` only and
    says whether it is non-finite (None: it could not run, e.g. BatchNorm on one row; that group is
    then kept whole). Returns (rows or None, tests used, note)."""
    max_culprits = max_culprits or max(1, size // 4)
    culprits: List[int] = []
    tests = 0
    todo = [list(range(size))]  # groups known to fail
    while todo:
        g = todo.pop()
        if len(g) == 1:
            culprits += g
        else:
            half = len(g) // 2
            parts = [g[:half], g[half:]]
            failing = []
            undecided = False
            for part in parts:
                if tests >= max_tests:
                    return None, tests, f"stopped after {tests} replays (budget)"
                tests += 1
                r = fails(part)
                if r is None:
                    undecided = True
                elif r:
                    failing.append(part)
            if failing:
                todo.extend(reversed(failing))
            elif undecided:
                culprits += g  # the halves could not be replayed alone: keep the group
            else:
                return None, tests, ("each half of a failing group of rows is finite on its own: the failure "
                                     "needs rows together (a batch statistic), not single samples")
        if len(culprits) > max_culprits:
            return None, tests, (f"more than {max_culprits} of {size} rows fail on their own: not a few bad "
                                 "samples")
    return sorted(culprits), tests, f"{tests} sub-batch replays"


def rows_to_drop(e: Any, size: int, max_tests: int, fails: Callable[[List[int]], Optional[bool]]) -> Optional[List[int]]:
    """The rows a ``drop_samples`` experiment ``e`` drops: its given ``rows``, or with ``bisect`` those
    :func:`bisect_rows` finds (the note in ``e.details["bisection"]``). None when the bisection found no
    rows: ``e`` is then settled (non-finite when the rows fail only together, else an error)."""
    if not e.params.get("bisect"):
        return list(e.params.get("rows") or [])
    rows, _tests, note = bisect_rows(fails, size, max_tests)
    e.details["bisection"] = note
    if rows is None:
        e.finite = False if ("needs rows together" in note or "more than" in note) else None
        e.error = None if e.finite is not None else note
    return rows
