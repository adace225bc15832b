"""The calibration table: how often a cause at a given confidence is the right one.

Rows are plain dicts ``{"confidence": float, "right": bool, "confirmed": bool}`` (one per diagnosed
scenario; ``benchmarks/calibration.py`` makes them from ``nanguard run`` reports and the scenarios'
ground truth).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

BUCKETS = ((0.0, 0.5), (0.5, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 0.95), (0.95, 1.0))


def bucket_of(confidence: float) -> tuple:
    for lo, hi in BUCKETS:
        if lo <= confidence < hi or (hi == 1.0 and confidence == 1.0):
            return (lo, hi)
    return BUCKETS[0]


def calibration_table(rows: Sequence[dict]) -> List[Dict[str, object]]:
    """Per confidence bucket: how many causes, how many right, the share right."""
    out = []
    for lo, hi in BUCKETS:
        b = [r for r in rows if isinstance(r.get("confidence"), (int, float)) and bucket_of(r["confidence"]) == (lo, hi)]
        if b:
            k = sum(1 for r in b if r.get("right"))
            out.append({"bucket": [lo, hi], "n": len(b), "right": k, "share": round(k / len(b), 3)})
    return out


def share_right_at(rows: Sequence[dict], threshold: float = 0.9) -> Dict[str, object]:
    """Among causes at confidence >= ``threshold``: how many, how many right, the share."""
    hi = [r for r in rows if isinstance(r.get("confidence"), (int, float)) and r["confidence"] >= threshold]
    k = sum(1 for r in hi if r.get("right"))
    return {"threshold": threshold, "n": len(hi), "right": k, "share": round(k / len(hi), 3) if hi else None}
