"""Stage 2 driver for TensorFlow: replay the failing step under the op-level recorder.

The recorder itself is ``nanguard.tensorflow.locate`` (see :mod:`.capture` for the interface).
"""
from __future__ import annotations

from typing import Any, Dict, Optional


def recorder_factory():
    """``locate.make_recorder`` when the op-level recorder is present, else None."""
    try:
        from .locate import make_recorder  # type: ignore[attr-defined]
    except ImportError:
        return None
    return make_recorder


def localize(driver: Any, det: Any) -> Optional[Dict[str, Any]]:
    """``loc_run`` for ``det`` (the shape ``core.pipeline.build_event`` reads), or None when no replay ran."""
    if recorder_factory() is None:
        return None
    return None
