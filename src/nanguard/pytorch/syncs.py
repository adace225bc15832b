"""Counting host syncs: every read of a tensor's value by the host, inside a block.

On a GPU a host read of a device tensor (``.item()``, ``.tolist()``, ``bool(t)``,
``.cpu()``, a data-dependent shape like ``nonzero``) blocks the CPU until the GPU has
caught up, so the CPU can no longer run ahead of the kernels. :class:`HostSyncCounter`
counts them in a block of code, two ways:

* a ``TorchDispatchMode`` counting the value-reading aten ops
  (``_local_scalar_dense`` behind ``item``/``float``/``bool``, ``is_nonzero``, ``equal``,
  ``nonzero``, ``masked_select``, ``unique``..., and copies from a non-CPU device to the
  CPU), plus wrappers on the Python methods that read without dispatching
  (``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu``). This works on CPU, where it
  stands in for the GPU: a CPU run that reads nothing would not sync on a GPU either;
* with CUDA, ``torch.cuda.set_sync_debug_mode("warn")``: PyTorch's own warning on every
  synchronizing CUDA call, counted (``cuda_syncs``).

Reading host memory that a finished asynchronous copy filled (the sync-free mailboxes of
:mod:`nanguard.pytorch.detect.lazy`, through a NumPy view) is not a read of a tensor and
is not counted: on a GPU it does not wait for anything.

Used by the tests (zero reads in a healthy sync-free step) and by the benchmark.
"""
from __future__ import annotations

import traceback
import warnings
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ_OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "unique",
             "_unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "allclose"}


class _Reads(TorchDispatchMode):
    def __init__(self, counter: "HostSyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in _READ_OPS:
            self.counter._hit(f"aten.{name}")
        elif name in ("_to_copy", "copy_") and _to_host(name, args, kwargs):
            self.counter._hit(f"aten.{name} to cpu")
        return func(*args, **kwargs)


def _to_host(name: str, args, kwargs) -> bool:
    try:
        if name == "_to_copy":
            dev = kwargs.get("device")
            return dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu"
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type != "cpu"
    except Exception:
        return False


class HostSyncCounter:
    """``with HostSyncCounter() as c: ...``; then ``c.count`` (and ``c.where`` with ``trace=True``).

    ``c.mark()`` returns the count so far (e.g. per step: ``c.mark()`` after each step).
    """

    def __init__(self, trace: bool = False) -> None:
        self.count = 0
        self.by_kind: Dict[str, int] = {}
        self.trace = trace
        self.where: List[str] = []
        self.cuda_syncs = 0
        self._mode: Optional[_Reads] = None
        self._orig: Dict[str, Any] = {}
        self._depth = 0
        self._cuda_prev = None
        self._warn_ctx = None

    def _hit(self, kind: str) -> None:
        if self._depth:  # a wrapped Python read whose own dispatch is counted already
            return
        self.count += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        if self.trace:
            frames = [f for f in traceback.extract_stack()[:-2] if "syncs.py" not in f.filename]
            self.where.append(f"{kind} at " + " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                                           for f in frames[-4:][::-1]))

    def mark(self) -> int:
        return self.count

    def __enter__(self) -> "HostSyncCounter":
        counter = self
        for name in ("tolist", "numpy", "cpu"):
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def wrap(t, *a, __orig=orig, __name=name, **k):
                if __name != "cpu" or t.device.type != "cpu":
                    counter._hit(f"Tensor.{__name}")
                counter._depth += 1
                try:
                    return __orig(t, *a, **k)
                finally:
                    counter._depth -= 1
            setattr(torch.Tensor, name, wrap)
        self._mode = _Reads(self)
        self._mode.__enter__()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda_prev = torch.cuda.get_sync_debug_mode()
            self._warn_ctx = warnings.catch_warnings(record=True)
            self._warnings = self._warn_ctx.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._warn_ctx is not None:
            torch.cuda.set_sync_debug_mode(self._cuda_prev)
            self.cuda_syncs = sum(1 for w in self._warnings if "synchroniz" in str(w.message))
            self._warn_ctx.__exit__(*exc)
            self._warn_ctx = None
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)
        self._orig = {}
