"""The PyTorch backend: per-step detection (:mod:`.detect`), the op recorder (:mod:`.locate`), the
replay of a failing step (:mod:`.replay`, :mod:`.rerun`), the recovery actions (:mod:`.recover`),
the explicit :class:`~.guard.Guard` and the global hooks of ``nanguard run`` (:mod:`.watch`).
See docs/ARCHITECTURE.md."""
