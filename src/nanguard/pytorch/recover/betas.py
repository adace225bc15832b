"""``raise_beta2``: set Adam's second-moment decay (``betas[1]`` of each param group) from now on, and the same
change for the length of a replay (see :mod:`nanguard.core.recovery.beta2`)."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence


def with_betas(optimizers: Sequence[Any], index_of: Optional[Dict[int, int]] = None,
               only: Optional[int] = None) -> List[Any]:
    """The optimizers with a ``betas`` pair in a param group (``only``: the one of that history index, by
    ``index_of``: id(optimizer) -> index; when it is not among them, every one)."""
    have = [o for o in optimizers if any(_pair(g.get("betas")) for g in o.param_groups)]
    if only is not None and index_of:
        mine = [o for o in have if index_of.get(id(o)) == only]
        return mine or have
    return have


def raise_beta2(optimizers: Sequence[Any], beta2: float) -> Optional[Dict[str, Any]]:
    """Set ``betas[1]`` of every param group of ``optimizers`` that has betas to ``beta2`` (None: none has).
    A lower beta2 already there is raised; a higher one is kept."""
    before, after = [], []
    names = []
    for o in optimizers:
        for g in o.param_groups:
            b = g.get("betas")
            if not _pair(b):
                continue
            before.append(float(b[1]))
            new = max(float(b[1]), float(beta2))
            g["betas"] = (b[0], new)
            after.append(new)
        names.append(type(o).__name__)
    if not before:
        return None
    return {"beta2_before": before, "beta2_after": after, "optimizers": names}


@contextlib.contextmanager
def beta2_for_replay(optimizers: Sequence[Any], beta2: Optional[float]) -> Iterator[None]:
    """``betas[1]`` set to ``beta2`` inside the block (a replay), put back after; nothing when None."""
    saved = [(g, g.get("betas")) for o in optimizers for g in o.param_groups if _pair(g.get("betas"))]
    try:
        if beta2 is not None:
            for g, b in saved:
                g["betas"] = (b[0], float(beta2))
        yield
    finally:
        for g, b in saved:
            g["betas"] = b


def _pair(b: Any) -> bool:
    return isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(x, (int, float)) for x in b)
