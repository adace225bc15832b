"""What the backends' op recorders share (framework-neutral: plain Python on plain records).

A backend (``nanguard.pytorch.locate``: ATen ops under a dispatch mode; ``nanguard.tensorflow.locate``:
eager ops under TensorFlow's op callback) records one step and reads values its own way; what it
decides from those readings is the same and lives here once:

* :mod:`.taint`: the taint of each non-finite value (:class:`Taint`), the inheritance rule
  (:meth:`Taints.decide`: real beats soft, a new origin, a mask a reduction kept) and the fallback
  when a sink's taint was lost;
* :mod:`.oplog`: the backend-neutral op log (:class:`OpGraph`: op names and input producers, each
  backend's op log subclasses it), the producer chain of a value and the where-trap walk;
* :mod:`.result`: the typed localization (:class:`Localization`, :class:`Sink`,
  :class:`Preexisting`, :class:`OptimizerInfo`; ``as_dict()`` is the dict the diagnosis and the
  reports read), the failing-sink choice and the one assembler (:func:`build_localization`) a
  backend drives through a :class:`LocalizationPort`;
* :mod:`.evidence`: the evidence gatherer registry (:class:`Gatherers`) and the examined op;
* :mod:`.naming`: which files are the user's (:class:`UserFiles`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from .evidence import Gatherers, ProbeBase
    from .naming import UserFiles, is_user_file
    from .oplog import OpGraph
    from .result import (PHASE, PRE_PHASE, Localization, LocalizationPort, OptimizerInfo, OriginShape, Preexisting, Sink,
                         SinkChoice, Sinks, build_localization, choose_sink, constant_detail, failed_result,
                         mask_escape_detail, origin_dict, source_rows)
    from .taint import CONST, NEW, Taint, Taints, earliest, escaped_mask, fallback

__all__ = ["Gatherers", "ProbeBase", "UserFiles", "is_user_file", "OpGraph", "PHASE", "PRE_PHASE", "Localization",
           "LocalizationPort", "OptimizerInfo", "OriginShape", "Preexisting", "Sink", "SinkChoice", "Sinks",
           "build_localization", "choose_sink", "constant_detail", "failed_result", "mask_escape_detail",
           "origin_dict", "source_rows", "CONST", "NEW", "Taint", "Taints", "earliest", "escaped_mask", "fallback"]

# imported on first use (a healthy run does not load this package's modules)
__getattr__, __dir__ = lazy_exports(__name__, {
    "Gatherers": ".evidence", "ProbeBase": ".evidence", "UserFiles": ".naming", "is_user_file": ".naming",
    "OpGraph": ".oplog", "PHASE": ".result", "PRE_PHASE": ".result", "Localization": ".result",
    "LocalizationPort": ".result", "OptimizerInfo": ".result", "OriginShape": ".result", "Preexisting": ".result",
    "Sink": ".result", "SinkChoice": ".result", "Sinks": ".result", "build_localization": ".result",
    "choose_sink": ".result", "constant_detail": ".result", "failed_result": ".result",
    "mask_escape_detail": ".result", "origin_dict": ".result", "source_rows": ".result", "CONST": ".taint", "NEW": ".taint", "Taint": ".taint", "Taints": ".taint",
    "earliest": ".taint", "escaped_mask": ".taint", "fallback": ".taint"})
