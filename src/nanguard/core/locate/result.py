"""The localization of one recorded step: its typed parts and the one assembler both backends use.

A backend's recorder ends with its sinks (the losses, the non-finite gradients, the non-finite
parameters / optimizer state after the update, each with its taint) and its taint table.
:func:`build_localization` decides, for every backend:

* the **failing sink**: a non-finite loss, else non-finite gradients, else non-finite
  parameters/state after the update (:func:`choose_sink`); none: not reproduced, and the non-finite
  values that appeared were masked away;
* the **origin**: the earliest real taint reaching that sink (the earliest real origin of the sink's
  stage when the taint was lost);
* the **phase**: the sink's stage (forward / backward / optimizer), or for a value non-finite before
  the step its kind (data / params / optimizer);
* the **dict shape** (:meth:`Localization.as_dict`): the keys ``nanguard.core.diagnosis`` and the
  reports read.

What differs by backend comes through a :class:`LocalizationPort`: the origin's keys
(:class:`OriginShape`), how a pre-existing value is named and where its rows are, the optimizer's
hyper-parameters, the where-trap walk over its op log, and backend notes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .taint import Taint, Taints

__all__ = ["PHASE", "PRE_PHASE", "Sink", "Preexisting", "OptimizerInfo", "Localization", "OriginShape",
           "SinkChoice", "Sinks", "choose_sink", "origin_dict", "LocalizationPort", "build_localization",
           "failed_result", "constant_detail", "mask_escape_detail", "source_rows", "UNTRACED_NOTE"]

PHASE = {"loss": "forward", "grad": "backward", "optimizer": "optimizer"}            # sink kind -> phase
PRE_PHASE = {"data": "data", "param": "params", "buffer": "params", "optimizer_state": "optimizer"}
UNTRACED_NOTE = "the non-finite sink could not be traced to an op; using the earliest real origin"
_NO_COUNTS = {"nan": 0, "posinf": 0, "neginf": 0}


# ---------------------------------------------------------------------------- typed parts
@dataclass
class Sink:
    """The failing sink: ``kind`` loss | grad | optimizer (None: no sink went non-finite) and the
    names of what went non-finite there (loss values, parameters, ``param:state``)."""
    kind: Optional[str] = None
    names: List[Any] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "names": self.names}


@dataclass
class Preexisting:
    """A value already non-finite before the step (``localization["preexisting"]``): ``kind`` data |
    param | buffer | optimizer_state, its ``name``, the batch rows (``samples``) and dataset rows
    (``source_rows``) of bad data, its statistics, where it first entered the step, and the write
    that made a parameter non-finite (``written_by``)."""
    kind: Optional[str]
    name: Optional[str]
    samples: List[Any] = field(default_factory=list)
    source_rows: List[Any] = field(default_factory=list)
    stats: Dict[str, Any] = field(default_factory=dict)
    first_use: Optional[Dict[str, Any]] = None
    written_by: Optional[Dict[str, Any]] = None
    source_rows_from: Optional[str] = None
    module_type: Optional[str] = None   # the layer whose own tensor it is (a Keras Normalization's mean)

    @classmethod
    def of(cls, taint: Taint, samples: List[Any], source_rows: List[Any],
           stats: Optional[Dict[str, Any]] = None) -> "Preexisting":
        """From a ``preexisting`` taint (its kind, name, first use and ``detail``'s stats/written_by)."""
        detail = taint.detail or {}
        return cls(kind=taint.pre_kind, name=taint.name, samples=samples, source_rows=source_rows,
                   stats=detail.get("stats", {}) if stats is None else stats,
                   first_use=taint.first_use or None, written_by=detail.get("written_by"),
                   module_type=detail.get("module_type"))

    @property
    def rows_in_tensor(self) -> List[Any]:
        return self.stats.get("bad_rows", [])

    @property
    def phase(self) -> str:
        return PRE_PHASE.get(self.kind, "data")

    def facts(self) -> Dict[str, Any]:
        return {"preexisting": {"kind": self.kind, "name": self.name, "nonfinite": self.stats.get("nonfinite"),
                                "numel": self.stats.get("numel")}}

    def as_dict(self) -> Dict[str, Any]:
        d = {"kind": self.kind, "name": self.name, "samples": self.samples, "source_rows": self.source_rows,
             "stats": self.stats, "rows_in_tensor": self.rows_in_tensor, "first_use": self.first_use,
             "written_by": self.written_by}
        if self.source_rows_from is not None:
            d["source_rows_from"] = self.source_rows_from
        if self.module_type is not None:
            d["module_type"] = self.module_type
        return d


@dataclass
class OptimizerInfo:
    """The update an optimizer-stage origin belongs to (``localization["optimizer"]``): the parameter
    and state slot, the inputs traced to them, what was non-finite after the step, the optimizer's
    class and hyper-parameters (``hyper``: lr, eps, ... in the backend's order), the parameter's
    dtype and what the eps constant is worth in it."""
    param: Optional[str] = None
    state: Optional[str] = None
    inputs: List[Dict[str, Any]] = field(default_factory=list)
    nonfinite_after_step: Optional[List[str]] = None
    optimizer: Optional[str] = None
    hyper: Dict[str, Any] = field(default_factory=dict)
    param_dtype: Optional[str] = None
    eps_fact: Optional[Dict[str, Any]] = None

    def as_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"param": self.param, "state": self.state, "inputs": self.inputs}
        if self.nonfinite_after_step is not None:
            d["nonfinite_after_step"] = self.nonfinite_after_step
        if self.optimizer is not None:
            d["optimizer"] = self.optimizer
        d.update(self.hyper)
        if self.param_dtype is not None:
            d["param_dtype"] = self.param_dtype
        if self.eps_fact is not None:
            d["eps_fact"] = self.eps_fact
        return d


_OPTIONAL = ("backend", "instrumentation", "origins_seen", "masked_nonfinite_origins", "loss_scale")
_KNOWN = ("reproduced", "phase", "origin", "preexisting", "optimizer", "facts", "n_ops", "notes", "sink") + _OPTIONAL


@dataclass
class Localization:
    """What an op recorder found in one step (``OpRecorder.result()`` / ``TFRecorder.result()``).

    ``origin`` is the origin op's description (its keys are the backend's, see :class:`OriginShape`);
    ``facts`` the evidence the diagnosis rules read; ``origins_seen``: real op origins recorded;
    ``masked_nonfinite_origins``: (not reproduced) non-finite values that never reached a sink;
    ``extra``: keys added by others (e.g. ``seconds``), kept as they came, last."""
    reproduced: bool = False
    phase: Optional[str] = None
    origin: Optional[Dict[str, Any]] = None
    preexisting: Optional[Preexisting] = None
    optimizer: Optional[OptimizerInfo] = None
    facts: Dict[str, Any] = field(default_factory=dict)
    n_ops: int = 0
    notes: List[str] = field(default_factory=list)
    sink: Optional[Sink] = None
    backend: Optional[str] = None
    instrumentation: Optional[str] = None
    origins_seen: Optional[int] = None
    masked_nonfinite_origins: Optional[int] = None
    loss_scale: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        """The JSON dict (the keys the diagnosis and the reports read; unset optional keys left out)."""
        d: Dict[str, Any] = {"reproduced": self.reproduced, "phase": self.phase, "origin": self.origin,
                             "preexisting": self.preexisting.as_dict() if self.preexisting is not None else None,
                             "optimizer": self.optimizer.as_dict() if self.optimizer is not None else None,
                             "facts": self.facts, "n_ops": self.n_ops, "notes": self.notes}
        if self.sink is not None:
            d["sink"] = self.sink.as_dict()
        for k in _OPTIONAL:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Localization":
        """The typed form of a localization dict (e.g. one a re-run child wrote)."""
        pre = d.get("preexisting")
        opt = d.get("optimizer")
        sink = d.get("sink")
        pre_t = None
        if isinstance(pre, dict):
            pre_t = Preexisting(kind=pre.get("kind"), name=pre.get("name"), samples=pre.get("samples") or [],
                                source_rows=pre.get("source_rows") or [], stats=pre.get("stats") or {},
                                first_use=pre.get("first_use"), written_by=pre.get("written_by"),
                                source_rows_from=pre.get("source_rows_from"))
        opt_t = None
        if isinstance(opt, dict):
            known = ("param", "state", "inputs", "nonfinite_after_step", "optimizer", "param_dtype", "eps_fact")
            opt_t = OptimizerInfo(param=opt.get("param"), state=opt.get("state"), inputs=opt.get("inputs") or [],
                                  nonfinite_after_step=opt.get("nonfinite_after_step"),
                                  optimizer=opt.get("optimizer"),
                                  hyper={k: v for k, v in opt.items() if k not in known},
                                  param_dtype=opt.get("param_dtype"), eps_fact=opt.get("eps_fact"))
        return cls(reproduced=bool(d.get("reproduced")), phase=d.get("phase"), origin=d.get("origin"),
                   preexisting=pre_t, optimizer=opt_t, facts=d.get("facts") or {}, n_ops=d.get("n_ops") or 0,
                   notes=list(d.get("notes") or []),
                   sink=Sink(sink.get("kind"), sink.get("names") or []) if isinstance(sink, dict) else None,
                   **{k: d.get(k) for k in _OPTIONAL}, extra={k: v for k, v in d.items() if k not in _KNOWN})


def failed_result(n_ops: int, notes: List[str], error: BaseException, backend: Optional[str] = None) -> Dict[str, Any]:
    """The localization when building it raised (nothing reproduced; the error in the notes)."""
    return Localization(n_ops=n_ops, notes=list(notes) + [f"result failed: {error!r}"[:200]],
                        backend=backend).as_dict()


# ---------------------------------------------------------------------------- the failing sink
@dataclass
class Sinks:
    """Where a taint must arrive to matter: ``loss`` [(taint, info)] (info: ``finite``, ``value``,
    ``shape``), ``grad`` [(parameter name, taint)] of non-finite gradients, ``opt`` [(parameter name,
    state name or None, taint)] non-finite after the update. ``grad``/``opt`` may be None while not
    evaluated yet. ``grad_marked``: a gradient computation was seen."""
    loss: List[Tuple[Optional[Taint], Dict[str, Any]]] = field(default_factory=list)
    grad: Optional[List[Tuple[str, Optional[Taint]]]] = field(default_factory=list)
    grad_marked: bool = False
    opt: Optional[List[Tuple[Optional[str], Optional[str], Optional[Taint]]]] = field(default_factory=list)

    def note_loss(self, finite: bool, taint: Optional[Taint] = None, value: Any = None,
                  shape: Optional[List[int]] = None) -> None:
        """A loss the step differentiates: finite, or non-finite with its taint, first value and shape."""
        self.loss.append((None, {"finite": True}) if finite else
                         (taint, {"finite": False, "value": value, "shape": shape}))


@dataclass
class SinkChoice:
    """The failing sink (``kind`` None: none), the names there, the taint reaching it and the stage
    whose earliest real origin stands in when that taint was lost."""
    kind: Optional[str]
    names: List[Any]
    taint: Optional[Taint]
    stage: str


def choose_sink(sinks: Any, opt_name: Callable[[Optional[str], Optional[str]], Any]) -> SinkChoice:
    """A non-finite loss first, else non-finite gradients, else non-finite parameters/state after the
    update (``opt_name(param, state)`` names the latter); the earliest real taint reaching it."""
    bad_loss = [(t, info) for t, info in sinks.loss if not info.get("finite", True)]
    if bad_loss:
        return SinkChoice("loss", [info.get("value") for _, info in bad_loss][:3],
                          Taints.earliest([t for t, _ in bad_loss]), "forward")
    if sinks.grad:
        return SinkChoice("grad", [n for n, _ in sinks.grad][:10], Taints.earliest([t for _, t in sinks.grad]),
                          "backward")
    if sinks.opt:
        return SinkChoice("optimizer", [opt_name(n, k) for n, k, _ in sinks.opt][:10],
                          Taints.earliest([t for *_, t in sinks.opt]), "optimizer")
    return SinkChoice(None, [], None, "forward")


# ---------------------------------------------------------------------------- the origin's keys
@dataclass(frozen=True)
class OriginShape:
    """The keys of a backend's ``origin`` dict, in report order, and how a backward origin is named by
    the forward op it differentiates: when ``detail[backward_if]`` is set, ``backward_file``/
    ``backward_line`` keep the backward op's line and each ``(key, detail key)`` of ``from_forward``
    replaces the key (``only_if_set``: only when the detail key holds a value). ``own_backward``: the
    detail key set when the backward op ran in a backward the user wrote (a ``torch.autograd.Function``,
    a ``tf.custom_gradient``): the origin is still named by the forward call, the sentences and fixes
    point at the backward's own line (``backward_line``, where the fix goes). ``defaults``: values for keys left None."""
    keys: Tuple[str, ...]
    backward_if: str
    from_forward: Tuple[Tuple[str, str], ...]
    only_if_set: Tuple[str, ...] = ()
    own_backward: str = "custom_backward"
    defaults: Tuple[Tuple[str, Any], ...] = (("inputs", []), ("output", _NO_COUNTS), ("samples", []))


def origin_dict(detail: Dict[str, Any], kind: str, stage: Optional[str], shape: OriginShape) -> Dict[str, Any]:
    """The reported origin from its taint's description (``detail``), kind and stage."""
    origin = {k: detail.get(k) for k in shape.keys}
    origin["stage"] = stage
    origin["kind"] = kind
    own = stage == "backward" and bool(detail.get(shape.own_backward))
    if stage == "backward" and (own or detail.get(shape.backward_if) is not None):
        # the line is the forward's (the call of the op, or of the Function, whose backward made it); the
        # backward op's own line beside it: in a backward the user wrote, where the fix goes
        origin["backward_file"], origin["backward_line"] = detail.get("file"), detail.get("line")
        for key, src in shape.from_forward:
            if detail.get(src) is not None or (key not in shape.only_if_set and detail.get(shape.backward_if)
                                               is not None):
                origin[key] = detail.get(src)
        if own:
            origin["custom_backward"] = True
    for k, default in shape.defaults:
        if origin.get(k) is None:
            origin[k] = type(default)(default)   # a fresh list/dict: reports mutate them
    return origin


# ---------------------------------------------------------------------------- the assembler
class LocalizationPort:
    """What a backend supplies to :func:`build_localization` (override what differs)."""

    shape: OriginShape
    backend: Optional[str] = None           # the ``backend`` key (None: left out)
    instrumentation: Optional[str] = None   # the ``instrumentation`` key (None: left out)
    constant_example: str = ""              # a non-finite constant a program writes on purpose
    state_word: str = "parameters"          # what the update writes ("the loss, gradients or <word>")

    @staticmethod
    def opt_name(param: Optional[str], state: Optional[str]) -> Any:
        """The sink name of a non-finite parameter (``state`` None) or optimizer state after the update."""
        return param if state is None else f"{param}:{state}"

    def annotate(self, loc: Localization, choice: SinkChoice) -> None:
        """Backend notes once the sink is known (before anything else is decided)."""

    def preexisting(self, taint: Taint) -> Preexisting:
        """The value non-finite before the step that the failing sink's taint names."""
        return Preexisting.of(taint, [], [])

    def where_trap(self, op: int) -> bool:
        return False

    def finish_origin(self, origin: Dict[str, Any], facts: Dict[str, Any]) -> None:
        """Last touches on the reported origin (e.g. flattened rows mapped to batch rows)."""

    def optimizer(self, taint: Taint, sinks: Any) -> Optional[OptimizerInfo]:
        return None


def build_localization(sinks: Any, taints: Taints, notes: Sequence[str], n_ops: int,
                       port: LocalizationPort) -> Localization:
    """The localization of one step (see the module docstring)."""
    notes = list(notes)
    choice = choose_sink(sinks, port.opt_name)
    reproduced = choice.kind is not None
    taint = choice.taint
    if reproduced and taint is None:
        taint = taints.fallback(choice.stage)
        notes.append(UNTRACED_NOTE)
    loc = Localization(reproduced=reproduced, n_ops=n_ops, notes=notes, sink=Sink(choice.kind, choice.names),
                       backend=port.backend, instrumentation=port.instrumentation,
                       origins_seen=sum(1 for o in taints.origins if o.kind == "op"), masked_nonfinite_origins=0)
    port.annotate(loc, choice)
    if not reproduced:
        masked = loc.masked_nonfinite_origins = sum(1 for o in taints.origins if o.kind in ("op", "constant"))
        if masked:
            notes.append(f"{masked} non-finite intermediate(s) appeared but were masked before reaching the loss, "
                         f"gradients or {port.state_word}")
            first = next((o for o in taints.origins if o.kind == "op"), None)
            if first is not None:  # what the compiled step may have kept (graph kernels handle NaN their own way)
                d = dict(first.detail or {})
                facts = dict(d.pop("facts", {}) or {})
                origin = origin_dict(d, "op", d.get("stage") or first.stage, port.shape)
                port.finish_origin(origin, facts)
                loc.extra["masked_origin"] = {"origin": origin, "facts": facts}
        return loc
    if taint is None:
        loc.phase = PHASE[choice.kind]
        return loc
    if taint.kind == "preexisting":
        pre = loc.preexisting = port.preexisting(taint)
        loc.phase = pre.phase
        loc.facts = pre.facts()
        return loc
    loc.phase = PHASE[choice.kind]
    d = dict(taint.detail or {})
    facts = dict(d.pop("facts", {}) or {})
    if d.get("mask_escape"):
        facts["mask_escape"] = d["mask_escape"]
    if taint.kind == "constant":
        notes.append(f"a non-finite constant written by the program (e.g. {port.constant_example}) reached the "
                     + choice.kind)
        facts["intentional_constant"] = True
    if taint.kind == "untracked":
        notes.append("the origin is a mutation outside the recorded ops")
    stage = d.get("stage") or taint.stage
    if "where_trap" not in facts and taint.kind == "op" and choice.kind == "grad" and stage == "forward":
        facts["where_trap"] = port.where_trap(taint.op)
    origin = origin_dict(d, taint.kind, stage, port.shape)
    port.finish_origin(origin, facts)
    loc.origin = origin
    loc.facts = facts
    if stage == "optimizer" or choice.kind == "optimizer":
        loc.optimizer = port.optimizer(taint, sinks)
    return loc


# ---------------------------------------------------------------------------- shared descriptions
def constant_detail(op: str, name: str, api: Optional[str], module: Optional[str], stage: Optional[str],
                    frame: Optional[Tuple[Any, Any, Any]], scalars: List[Any]) -> Dict[str, Any]:
    """The description of a non-finite constant the program wrote (``frame``: (file, line, function))."""
    return {"op": op, "name": name, "api": api, "module": module, "stage": stage,
            "file": frame[0] if frame else None, "line": frame[1] if frame else None,
            "function": frame[2] if frame else None, "constant": True, "scalars": scalars}


def mask_escape_detail(mask: Taint) -> Dict[str, Any]:
    """``origin["mask_escape"]``: the mask a reduction kept (its op, API, line and constant)."""
    md = mask.detail or {}
    return {"mask_op": md.get("name"), "mask_api": md.get("api"), "file": md.get("file"), "line": md.get("line"),
            "constant": (md.get("scalars") or [None])[0]}


def source_rows(index: Any, samples: Sequence[int], limit: int = 10) -> List[int]:
    """The dataset rows of batch rows ``samples`` looked up through a 1-D ``index`` (an indexable
    sequence of integers: an index tensor's first column)."""
    n = len(index)
    return sorted({int(index[r]) for r in samples if r < n})[:limit]
