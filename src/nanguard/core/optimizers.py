"""Whether the optimizer of a run's latest step took over from another one (a fine-tuning stage, a second
``compile`` + ``fit``), from what each backend kept of its optimizers' steps: framework-neutral."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple


def optimizer_switch(updates: Sequence[Tuple[Optional[int], Optional[int], str]]) -> Dict[str, Any]:
    """``updates``: per optimizer, (the run's step of its first update, of its latest, its class name); None
    where it has none. When the optimizer of the latest step started after another one had made its last
    update: ``{"step": its first step, "from", "to"}``; else ``{}`` (optimizers stepping together, a GAN's
    two, are no switch)."""
    seen = [u for u in updates if u[1] is not None]
    if len(seen) < 2:
        return {}
    cur = max(seen, key=lambda u: u[1])
    start = cur[0]
    before = [u for u in seen if u is not cur and start and u[1] < start]
    if not before:
        return {}
    return {"step": int(start), "from": max(before, key=lambda u: u[1])[2], "to": cur[2]}
