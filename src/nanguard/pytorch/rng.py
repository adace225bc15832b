"""RNG state of a step: captured before it runs so a replay draws the same random numbers."""
from __future__ import annotations

import random
import sys
from typing import Any, Dict, Optional

import torch


def capture_rng(plain: bool = True) -> Dict[str, Any]:
    """RNG state of torch (CPU, and CUDA when initialised), ``random`` and numpy if imported.

    ``plain=False`` keeps Python's and numpy's native state objects (what :class:`StepRng`
    captures once per step for the Guard); :func:`plain_rng` turns them into what
    ``torch.load(weights_only=True)`` can read back.
    """
    st = _torch_rng()
    st["random"] = random.getstate()
    _numpy_rng(st)
    return plain_rng(st) if plain else st


def _torch_rng(cuda: Optional[bool] = None) -> Dict[str, Any]:
    """torch's CPU RNG state, and CUDA's once initialised (``cuda``: whether CUDA is available, if known)."""
    st: Dict[str, Any] = {"torch": _CPU_GEN.get_state()}  # what torch.get_rng_state() returns, without its frame
    if cuda is not False:
        _cuda_rng(st, cuda)
    return st


def _cuda_rng(st: Dict[str, Any], cuda: Optional[bool]) -> None:
    try:
        if (torch.cuda.is_available() if cuda is None else cuda) and torch.cuda.is_initialized():
            st["cuda"] = torch.cuda.get_rng_state_all()
    except Exception:
        pass


_CPU_GEN = torch.default_generator


def _numpy_rng(st: Dict[str, Any]) -> Any:
    """numpy's global RNG state into ``st`` (when numpy is imported); returns numpy or None."""
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            st["numpy"] = np.random.get_state()
        except Exception:
            return None
    return np


class StepRng:
    """The RNG state at the start of each step (for its replay), at a cost that fits every step.

    torch's generator (and CUDA's, once initialised) is read every step: a 5 KB copy, ~7 us.
    Python's ``random`` and numpy's global generator cost ~50 and ~170 us to read (their states
    are rebuilt as Python objects: a third of a dispatch-bound 12 ms step's budget), so they are
    read only once steps are seen drawing from them. A probe step (the first two, then one in
    ``PROBE_EVERY``) reads them at its start and again after its forward and backward
    (:meth:`after`; a driver that does not call it is answered at the next step's start, draws
    between steps included); once either changed, it is read at every step's start from then on.
    A step that draws from them before any probe saw it is replayed with its torch draws (its
    replay may then not reproduce; the detection never depends on it).
    """

    PROBE_EVERY = 64

    def __init__(self) -> None:
        self.n = 0
        self.py = False   # steps draw from Python's random: read every step
        self.np = False   # steps draw from numpy's global generator: read every step
        # the state a probe step captured, until after() compared it (None: no probe pending; a driver
        # tests this attribute before calling after(), so an ordinary step makes no call)
        self.probing: Optional[Dict[str, Any]] = None
        try:
            self._cuda = torch.cuda.is_available()  # asked once (a driver query), not every step
        except Exception:
            self._cuda = False

    def capture(self) -> Dict[str, Any]:
        """This step's RNG state (the native form of :func:`capture_rng`, without what is not drawn)."""
        if self.probing is not None:
            self.after()
        probe = self.n < 2 or self.n % self.PROBE_EVERY == 0
        self.n += 1
        st = {"torch": _CPU_GEN.get_state()}  # (_torch_rng inline: one call less every step)
        if self._cuda:
            _cuda_rng(st, True)
        if self.py or probe:
            st["random"] = random.getstate()
        if self.np or probe:
            _numpy_rng(st)
        if probe and not (self.py and self.np):
            self.probing = st
        return st

    def after(self) -> None:
        """After a probe step's forward and backward: did they draw from ``random`` or numpy?"""
        st, self.probing = self.probing, None
        if st is None:
            return
        if not self.py and "random" in st and random.getstate() != st["random"]:
            self.py = True
        if not self.np and "numpy" in st:
            old, cur = st["numpy"], None
            try:
                cur = sys.modules["numpy"].random.get_state()
            except Exception:
                pass
            if cur is None or cur[2:] != old[2:] or not (cur[1] == old[1]).all():
                self.np = True


def plain_rng(st: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(st)
    if isinstance(st.get("random"), tuple):
        v, internal, gauss = st["random"]
        out["random"] = [v, list(internal), gauss]
    npst = st.get("numpy")
    if isinstance(npst, tuple):
        name, keys, pos, has_gauss, cached = npst
        out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return out


def restore_rng(st: Dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng` (plain or native form)."""
    torch.set_rng_state(st["torch"])
    if st.get("random") is not None:
        v, internal, gauss = st["random"]
        random.setstate((v, tuple(internal), gauss))
    if "cuda" in st:
        try:
            torch.cuda.set_rng_state_all(st["cuda"])
        except Exception:
            pass
    if st.get("numpy") is not None:  # (None: no NumPy state was kept, as the bundle check reads it)
        np = sys.modules.get("numpy")
        if np is None:
            import numpy as np  # noqa: F811  (the script imports it anyway)
        npst = st["numpy"]
        if isinstance(npst, list):
            name, keys, pos, has_gauss, cached = npst
            npst = (name, keys.numpy().astype("uint32"), pos, has_gauss, cached)
        np.random.set_state(npst)
