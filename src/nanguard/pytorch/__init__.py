"""The PyTorch backend: per-step detection, the op recorder, replay, recovery actions, the explicit
:class:`Guard` and the global hooks of ``nanguard run``."""
