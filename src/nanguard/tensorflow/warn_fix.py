"""A Keras warning's fix tested in a run that does not recover (``on_spike="warn"``): the learning-rate cut or
the clip the warning's diagnosis gives, replayed on a step's own batch from the weights now and put back
(:func:`nanguard.core.recovery.tried.test_warning_fix`, the candidates a recovery would try).

Each replay runs through the ``--recover`` machinery (:func:`.recover_tried._run`): the step run eagerly
with the change, its update applied past the guard's check, every variable, rate, clip setting and seed
state put back after, so the run trains on bit-for-bit as without the replays. What is replayed:

* a ``@tf.function`` step of a tape loop (the outermost call that ran the warning's update, read right
  after it returned): that call, with the arguments it was given, from the weights after its update;
* a ``model.fit`` step: its batch lives inside the traced train step and is gone when the step is read.
  Keeping every batch on the host would cost every healthy step, so nothing is kept until a warning: the
  warning re-makes the train function with a ``tf.py_function`` that hands the *next* step's batch to the
  host (:func:`keep_batch`; one trace), the fix is replayed on that batch once the step is read (from the
  weights after it), printed on a line of its own, and the train function is re-made without it;
* an eager ``GradientTape`` step is the script's own code, not a call: nothing to replay in-process (the
  fix is said untested, and why), as under ``--recover``.

Nothing here runs before a warning: a healthy run pays nothing.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .draws import STATEFUL_RANDOM, graphs_from
from .observer import TFObserver

__all__ = ["test_fix", "keep_batch", "NextBatchTest"]

FIT_PENDING = "fix to be tested on the next step's batch (a fit keeps no batch)"


def _why_not(w: Any) -> Optional[str]:
    """Why no step of watcher ``w`` can be replayed with a fix, or None."""
    if not w.optimizers():
        return "no optimizer to replay the updates with"
    if w.lso:
        return "a LossScaleOptimizer's steps are not replayed (its dynamic scale would move)"
    if tf.distribute.has_strategy() or any(_strategy(m) for m in [w.fitting()] if m is not None):
        return "a distributed step is not replayed"
    return None


def _strategy(model: Any) -> bool:
    """Whether ``model`` trains under a non-default distribution strategy."""
    s = getattr(model, "_distribute_strategy", None)
    return s is not None and type(s).__name__ not in ("_DefaultDistributionStrategy",)


def _iterator(x: Any) -> bool:
    """A data iterator (calling again would pull the next batch, not replay this one)."""
    return isinstance(x, tf.data.Iterator) or (hasattr(x, "get_next") and hasattr(x, "element_spec"))


def test_fix(w: Any, spikes: Any, event: Any, step: int, history: list) -> Optional[str]:
    """``on_spike="warn"``: the warning ``event``'s fix tested on watcher ``w``'s step (see the module doc);
    the words for the warning's line, or None when its category has no fix to test."""
    from ..core.recovery.tried import KIND, WARN_ACTION, record_on_event, test_warning_fix, warning_fix_words
    action = WARN_ACTION.get(str((event.cause or {}).get("category")))
    if action is None:
        return None

    def untested(why: str) -> str:
        record_on_event(event, [{"unavailable": KIND[action][0], "why": why}])
        return f"fix not tested by replay: {why}"

    why = _why_not(w)
    if why is not None:
        return untested(why)
    call = w.step_call
    model = w.fitting()
    if call is not None and any(_iterator(a) for a in tf.nest.flatten((call[1], call[2]), expand_composites=False)):
        # a fit's train function (it pulls its batch from the iterator): the next step's batch
        inner = getattr(model, "_nanguard_inner_train_step", None) if model is not None else None
        if inner is None:
            return untested("the fit's train step is not the watcher's")
        if int(getattr(model, "steps_per_execution", 1) or 1) != 1:
            return untested("a fit of several steps per call keeps no step's batch")
        if getattr(model, "jit_compile", False) is True:
            return untested("an XLA-compiled fit step cannot hand its batch to the host")
        if _stateful_random(call[0]):
            return untested("the fit's train step draws from TensorFlow's stateful random ops (tf.random.normal), "
                            "whose streams restart when it is traced again to keep a batch: the run would change")
        if spikes.pending is not None:
            return None  # an earlier warning's test is waiting for the same batch
        spikes.pending = NextBatchTest(w, spikes, event, step, history, model)
        return FIT_PENDING
    if call is None:
        from .recover_tried import EAGER_WHY
        return untested(EAGER_WHY)
    fn, args, kwargs = call
    run = [(step, lambda: fn(*args, **kwargs))]
    with _kept(_captured(fn, args, kwargs)):  # a step counter, a tf.random.Generator the step draws from
        test_warning_fix(event, history, step, _learning_rates(w), lambda **kw: replay(w, run, **kw))
    return warning_fix_words(event)




def _stateful_random(fn: Any) -> bool:
    """Whether the traced function ``fn`` (or one it calls) holds a stateful random op: its kernel keeps its own
    stream, which a new trace starts again (keras.random's ops are stateless, seeded from a variable)."""
    found = stateful_random_ops(fn)
    return found is None or bool(found)  # not known: assume it does (no re-trace, the test untested)


def stateful_random_ops(fn: Any) -> Optional[List[str]]:
    """The stateful random op types in the traced function ``fn`` and the functions it calls (sorted), or None
    when its graphs cannot be read."""
    try:
        roots = [cf.graph for cf in fn._list_all_concrete_functions()]
    except Exception:
        return None
    return sorted({op.type for g in graphs_from(roots) for op in g.get_operations() if op.type in STATEFUL_RANDOM})


def unrepeatable_note(fn: Any) -> Optional[str]:
    """Why a replay of a step of the traced function ``fn`` cannot repeat it, when it draws with stateful random
    ops (their kernels' streams cannot be rewound; an eager replay draws other numbers); else None."""
    ops = stateful_random_ops(fn) if fn is not None else None
    if not ops:
        return None
    return (f"the step draws random numbers inside a tf.function with stateful random ops ({', '.join(ops)}: "
            "tf.random.normal / uniform with the global seed), whose streams a replay cannot rewind, so it drew "
            "other numbers; to make the step replayable draw them with keras.random and a SeedGenerator (or a "
            "tf.random.Generator), or pass the noise in as an argument")


def _captured(fn: Any, args: tuple, kwargs: dict) -> List[Any]:
    """The variables the traced step ``fn`` captures (its concrete function for these arguments, traced
    already), beyond the models' and optimizers' that the replay puts back itself; [] when not found."""
    try:
        return list(fn.get_concrete_function(*args, **kwargs).variables)
    except Exception:
        return []


@contextlib.contextmanager
def _kept(variables: Sequence[Any]) -> Iterator[None]:
    """The values of ``variables`` put back after the block (no write of the script's: the watcher's
    outside-write check does not see it)."""
    from .state import tl_get, tl_set
    saved = [(v, np.array(v.numpy())) for v in variables]
    try:
        yield
    finally:
        depth = tl_get("apply_depth")
        tl_set("apply_depth", depth + 1)
        try:
            for v, a in saved:
                v.assign(a)
        finally:
            tl_set("apply_depth", depth)


def _learning_rates(w: Any) -> List[float]:
    from .recover import KerasActions
    return KerasActions(w).learning_rates()


def replay(w: Any, calls: Sequence[Tuple[int, Callable[[], Any]]], *, steps: int, lr_factor: Optional[float] = None,
           max_norm: Optional[float] = None) -> Dict[str, Any]:
    """``calls`` (step, one call of it) cycled to ``steps`` steps from the state now with the change, the state
    put back after (:func:`.recover_tried._run`): the core's replay result."""
    from .recover import KerasActions
    from .recover_tried import _run
    order = [calls[i % len(calls)] for i in range(max(int(steps), 1))]
    out = _run(w, KerasActions(w), order, lr_factor, max_norm, {})
    out["period"] = min(len(calls), len(order))  # the same batch comes back every period steps
    return out


class NextBatchTest(TFObserver):
    """A fit warning's test, waiting for the next step's batch: the train function is re-made with
    :func:`keep_batch` now; when the next step is read (:meth:`step_end`, an observer of the watcher while
    armed only), the fix is replayed on that batch and the train function re-made without it."""

    def __init__(self, w: Any, spikes: Any, event: Any, step: int, history: list, model: Any) -> None:
        self.spikes, self.event, self.step, self.history = spikes, event, step, list(history)
        self.model = weakref.ref(model)
        self.batch: Any = None   # the kept step's batch tensors, as numpy arrays (:func:`keep_batch`)
        self.batch_step: Optional[int] = None
        self.structure: Any = None  # (the traced batch, which of its leaves are tensors)
        w.observers.items.append(self)
        model.make_train_function(force=True)  # traced again at the next call, with keep_batch in it

    def keep(self, step: int, arrays: List[Any]) -> None:
        self.batch, self.batch_step = arrays, step

    def batch_of(self) -> Any:
        """The kept batch in the structure the train step got it in."""
        data, is_tensor = self.structure
        arrays = iter(self.batch)
        return tf.nest.pack_sequence_as(data, [next(arrays) if t else x for x, t in zip(tf.nest.flatten(data), is_tensor)])

    def step_end(self, w: Any, step: int) -> None:
        if step <= self.step:
            return
        self.close(w)
        if any(d.step == step for d in w.detections) or self.batch_step != step or self.structure is None:
            return  # the next step failed (the failure's own handling takes over), or its batch was not kept
        from ..core.recovery.tried import test_warning_fix, warning_fix_words
        from .capture import as_tensors
        model = self.model()
        inner = getattr(model, "_nanguard_inner_train_step", None) if model is not None else None
        if inner is None:
            return
        batch = as_tensors(self.batch_of())
        run = [(step, lambda: inner(batch))]
        hist = self.history + [h for h in w.history.raw_dicts() if self.step <= h["step"] <= step]
        test_warning_fix(self.event, hist, step, _learning_rates(w), lambda **kw: replay(w, run, **kw))
        said = warning_fix_words(self.event, on=f"step {step}'s batch, from the weights after it")
        if said and not self.spikes.quiet:
            from ..core.render.terminal import print_line
            print_line(f"step {self.step}: the warning's {said}")

    def close(self, w: Any) -> None:
        """Disarm: no longer an observer; the train function re-made without :func:`keep_batch`."""
        if self in w.observers.items:
            w.observers.items.remove(self)
        if self.spikes.pending is self:
            self.spikes.pending = None
        model = self.model()
        if model is not None:
            model.make_train_function(force=True)


def keep_batch(w: Any, data: Any) -> None:
    """While a ``fit`` train step is traced with a warning's test pending: a ``tf.py_function`` that hands the
    step's batch tensors (numpy copies) to the test when the step runs; the test puts them back in the
    batch's structure when it replays (:meth:`NextBatchTest.batch_of`)."""
    test = getattr(w.spikes, "pending", None)
    leaves = tf.nest.flatten(data)
    tensors = [t for t in leaves if isinstance(t, tf.Tensor)]
    if test is None or not tensors:
        return
    test.structure = (data, [isinstance(t, tf.Tensor) for t in leaves])

    def store(*vals):
        try:  # never raise inside the graph: the step would fail
            test.keep(w.steps_watched, [np.array(v.numpy()) for v in vals])  # the step now running
        except Exception:
            pass
        return tf.constant(0)

    tf.py_function(store, tensors, [tf.int32])
