"""RNG state of a step: captured before it runs so a replay draws the same random numbers."""
from __future__ import annotations

import random
import sys
from typing import Any, Dict

import torch


def capture_rng(plain: bool = True) -> Dict[str, Any]:
    """RNG state of torch (CPU, and CUDA when initialised), ``random`` and numpy if imported.

    ``plain=False`` keeps Python's and numpy's native state objects (cheap: used
    once per step by the Guard); :func:`plain_rng` turns them into what
    ``torch.load(weights_only=True)`` can read back.
    """
    st: Dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            st["cuda"] = torch.cuda.get_rng_state_all()
    except Exception:
        pass
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            st["numpy"] = np.random.get_state()
        except Exception:
            pass
    return plain_rng(st) if plain else st


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
    if "numpy" in st:
        np = sys.modules.get("numpy")
        if np is None:
            import numpy as np  # noqa: F811  (the script imports it anyway)
        npst = st["numpy"]
        if isinstance(npst, list):
            name, keys, pos, has_gauss, cached = npst
            npst = (name, keys.numpy().astype("uint32"), pos, has_gauss, cached)
        np.random.set_state(npst)
