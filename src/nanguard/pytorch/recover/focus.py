"""The optimizer a divergence names: in a run with several optimizers (a GAN's discriminator and generator),
the diagnosis reads each one's own history and names the one whose update grew
(``cause.evidence.optimizer.index``: :mod:`nanguard.core.diagnosis.per_optimizer`); the learning-rate cut,
its replay and a warning's tested fix then change that optimizer's rate alone."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence


def named_index(cause: Any) -> Optional[List[int]]:
    """The history indices of the optimizers the cause names (their own steps diverge while another
    optimizer's did not), or None (one optimizer, or every one diverging, or none named)."""
    ev = (cause.get("evidence") or {}) if isinstance(cause, dict) else {}
    o = ev.get("optimizer")
    if not isinstance(o, dict) or not isinstance(o.get("index"), int):
        return None
    ids = [i for i in o.get("indices") or [o["index"]] if isinstance(i, int) and not isinstance(i, bool)]
    return ids or None


def focused(optimizers: Sequence[Any], opt_index: Optional[Dict[int, int]], indices: Optional[List[int]]) -> List[Any]:
    """The optimizers of the history ``indices`` among ``optimizers`` (``opt_index``: id -> index, the
    monitor's); all of them when none is named or none matches."""
    if not indices or not opt_index:
        return list(optimizers)
    mine = [o for o in optimizers if opt_index.get(id(o)) in indices]
    return mine or list(optimizers)
