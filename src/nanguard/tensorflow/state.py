"""The watcher's state: what one graph (or eager code) saw since its last update (:class:`Pending`),
and per optimizer the in-graph variables of the check and the host's reading position
(:class:`OptState`).

The per-optimizer states and the ``tf.function``\\ s that hold a check are global, not per watcher:
a step traced under one watcher keeps its check in its graph, and a later watcher (another ``fit``
with the callback, another ``watch()`` block) reads it once one of its updates runs under it (until
then that optimizer is no part of the later run: not in its snapshots, learning rates or report).
When a watcher uninstalls it releases the states it knew (:meth:`OptState.release`): with no watcher
installed the check still runs but never skips an update nor clips (``active`` off, ``halt`` and the
clip reset), so nothing one run armed reaches the next.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from . import detect as D

__all__ = ["StopRun", "Pending", "OptState", "STATES", "FN_STATES", "active", "set_active", "tl_get", "tl_set",
           "graph_key", "create_lifted", "updates_made", "updates_var", "batch_halt_var", "clear_batch_halt"]

_local = threading.local()
STATES: Dict[int, "OptState"] = {}
FN_STATES: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()
_ACTIVE: List[Any] = [None]   # the installed watcher (one at a time)
_UPDATES: List[Any] = []      # the count of updates by every optimizer (one variable, made on first use)
_BATCH_HALT: List[Any] = []   # fit under recovery: a failing update holds the later ones of its call (any optimizer)


def updates_made() -> bool:
    """Whether the count of every update exists (TensorFlow's runtime then runs: it can be read)."""
    return bool(_UPDATES)


def updates_var() -> Any:
    """The in-graph count of the updates attempted by every optimizer of the process (int64), read and
    advanced by each update's check: a step is numbered by the updates made before it, whichever
    optimizer made them (a GAN's discriminator and generator updates of one batch are two steps). One
    variable for all watchers (traced steps keep it); each watcher counts from its value at install."""
    if not _UPDATES:
        _UPDATES.append(create_lifted(lambda: tf.Variable(0, dtype=tf.int64, trainable=False,
                                                          experimental_enable_variable_lifting=False,
                                                          name="nanguard_updates")))
    return _UPDATES[0]


def batch_halt_var() -> Any:
    """``model.fit`` under recovery: set in-graph by a failing update, read by every later update of the same
    graph call whichever optimizer makes it (a GAN's critic failing holds the critic's next updates and the
    generator's of that ``train_step``: the batch is the unit, :mod:`.recover_held`); cleared by the host once
    the failure is recovered. One variable for the process (bool), made when a fit step is traced."""
    if not _BATCH_HALT:
        _BATCH_HALT.append(create_lifted(lambda: tf.Variable(False, trainable=False,
                                                             experimental_enable_variable_lifting=False,
                                                             name="nanguard_batch_halt")))
    return _BATCH_HALT[0]


def clear_batch_halt() -> None:
    """The shared halt back off (a recovered failure; a watcher adopting or releasing the states)."""
    if _BATCH_HALT:
        _BATCH_HALT[0].assign(False)


class StopRun(BaseException):
    """Raised through the user's script to stop it (BaseException: ``except Exception`` won't eat it)."""

    def __init__(self, detection: Any) -> None:
        super().__init__(f"nanguard stopped the run at step {detection.step} ({detection.phase})")
        self.detection = detection


def active() -> Any:
    """The installed :class:`~.watch.TFWatcher`, or None."""
    return _ACTIVE[0]


def set_active(w: Any) -> None:
    _ACTIVE[0] = w


def tl_get(name: str, default: Any = 0) -> Any:
    """Thread-local hook state (nesting depths, the outermost tf.function being called)."""
    return getattr(_local, name, default)


def tl_set(name: str, value: Any) -> None:
    setattr(_local, name, value)


class _Eager:
    """Key of the eager 'graph' in the pending table."""


_EAGER = _Eager()


def graph_key() -> Any:
    if tf.executing_eagerly():
        return _EAGER
    return tf.compat.v1.get_default_graph()


def _per_replica() -> dict:
    """Under a distribution strategy's scope: each replica writes its own copy of the check's variables
    (a mirrored variable cannot be written per replica), and the host reads the first replica's."""
    if not tf.distribute.has_strategy():
        return {}
    return {"synchronization": tf.VariableSynchronization.ON_READ,
            "aggregation": tf.VariableAggregation.ONLY_FIRST_REPLICA}


def create_lifted(make: Callable[[], Any]) -> Any:
    """``make()`` lifted out of the graph being traced (``init_scope``). On a later trace of a
    ``tf.function`` (a step traced before the watcher was installed and traced again under it)
    TensorFlow refuses new variables; then ``make()`` runs again with the function's "no variable
    creation" scope set aside. Only for variables made once per optimizer and kept (no leak per
    trace); the first try keeps TensorFlow's own creators (Keras and strategies rely on them)."""
    with tf.init_scope():
        try:
            return make()
        except ValueError as e:
            if "singleton tf.Variables" not in str(e):
                raise
        g = tf.compat.v1.get_default_graph()
        old = g._variable_creator_stack
        g._variable_creator_stack = []
        try:
            return make()
        finally:
            g._variable_creator_stack = old


class Pending:
    """What one graph (or eager code) saw since its last update: losses, batch flags, seeds, batch."""

    __slots__ = ("losses", "data_flags", "data_host_ok", "scaled", "seeds", "batch", "hold", "buffers", "made",
                 "grad_ids")

    def __init__(self) -> None:
        self.losses: List[tf.Tensor] = []
        # id(loss) -> what its tape.gradient returned (flattened only when several losses are pending): an update
        # takes the losses of its own gradients (two tapes' gradients before two updates: a GAN's G and D)
        self.grad_ids: Dict[int, Any] = {}
        self.data_flags: List[tf.Tensor] = []
        self.data_host_ok = True
        self.scaled: List[Tuple[tf.Tensor, tf.Tensor]] = []  # (scaled loss, loss)
        self.seeds: Dict[int, Tuple[Any, tf.Tensor]] = {}     # id(generator) -> (generator, state before)
        self.batch: Any = None                                  # model.fit: train_step's data
        # model.fit with steps_per_execution > 1 under recovery: a failing step holds the rest of its call
        # (they are captured and re-run after the recovery, see .recover_held), and the values of the
        # buffers (metrics, non-trainable variables) when the step starts
        self.hold = False
        # ids of what an outermost layer call returned in this step (kept alive in the list): a later
        # outermost call given one of them (a VAE's decoder(z), a GAN's discriminator(generator(noise)))
        # is given no data of the batch
        self.made: List[Any] = []
        self.buffers: List[Tuple[Any, tf.Tensor]] = []

    def user_loss(self, t: Any) -> Any:
        """The user's loss for a differentiated target (a LossScaleOptimizer's ``loss * scale``: the loss)."""
        for scaled, loss in self.scaled:
            if scaled is t:
                return loss
        return t

    def note_grads(self, target: Any, out: Any) -> None:
        """``tape.gradient(target)`` returned ``out``: the gradients each of its (pending) losses made."""
        for t in tf.nest.flatten(target):
            t = self.user_loss(t)
            if any(t is x for x in self.losses):
                self.grad_ids[id(t)] = out   # kept as returned: read only when several losses are pending

    def take_own(self, grads: Sequence[Any]) -> Optional["Pending"]:
        """Keep the losses whose gradients ``grads`` are (an update's own), when several tapes' losses are pending
        and only some of them are; returns a Pending with the others (for their own update), else None. (A GAN's
        generator applied first: its discriminator's inf loss is the discriminator update's, not the generator's.)"""
        if len(self.losses) < 2 or not self.grad_ids or not grads:
            return None
        gid = {id(g) for g in grads if g is not None}
        mine = [t for t in self.losses
                if any(id(g) in gid for g in tf.nest.flatten(self.grad_ids.get(id(t))) if g is not None)]
        rest = [t for t in self.losses if not any(t is m for m in mine)]
        if not mine or not rest:
            return None
        q = Pending()
        q.losses, q.scaled = rest, self.scaled
        q.grad_ids = {id(t): self.grad_ids[id(t)] for t in rest if id(t) in self.grad_ids}
        self.losses = mine
        return q


class OptState:
    """Per optimizer: the stash variables and the host-side reading position."""

    def __init__(self, opt: Any, n_vars: int, *, active: bool, stop_mode: bool) -> None:
        self.opt_ref = weakref.ref(opt)
        self.name = type(opt).__name__
        self.n_vars = n_vars
        self.offset = 0  # the raw count of its updates when the current watcher adopted this state
        self.first: Optional[int] = None  # the run's step of this optimizer's first update under the watcher
        self.last: Optional[int] = None   # the run's step of its latest update read
        self.updates = updates_var()
        self.clip_host = float("inf")  # the clip variable's value, as last set from the host
        def make() -> tuple:
            # not lifted by a tf.function being traced: the check's own variables never make TensorFlow
            # trace the user's step twice (a first trace that creates variables is traced again)
            var = functools.partial(tf.Variable, experimental_enable_variable_lifting=False, **_per_replica())
            return (var(np.full((D.RING, D.NCOL), -1.0), dtype=tf.float64, trainable=False,
                        name="nanguard_stash"),
                    var(0, dtype=tf.int64, trainable=False, name="nanguard_step"),
                    var(False, trainable=False, name="nanguard_halt"),
                    var(active, trainable=False, name="nanguard_active"),
                    var(stop_mode, trainable=False, name="nanguard_stop_mode"),
                    var(np.zeros(max(n_vars, 1)), dtype=tf.float64, trainable=False,
                        name="nanguard_bad_grads"),
                    var(float("inf"), dtype=tf.float32, trainable=False, name="nanguard_clip"),
                    var(False, trainable=False, name="nanguard_force_check"))
        (self.stash, self.counter, self.halt, self.active, self.stop_mode, self.gbad, self.clip,
         self.force) = create_lifted(make)
        self.next_step = 0          # host: the first step not yet decided
        self.attempts = 0           # host: update attempts known so far
        self.tvars: List[Any] = []  # the variables of the last traced update (names, slow paths)
        # eager: the row waiting for its post-update norms (row, their tensor, the variables updated)
        self.eager_post: Optional[Tuple[List[float], tf.Tensor, List[Any]]] = None
        self.lost_rows = 0

    def adopt(self, *, active: bool, stop_mode: bool) -> None:
        """Made under an earlier watcher: the new one counts steps from the current count."""
        raw = int(self.counter.numpy())
        self.offset = self.next_step = self.attempts = raw
        self.first = self.last = None
        self.eager_post = None
        self.active.assign(active)
        self.stop_mode.assign(stop_mode)
        self.halt.assign(False)
        clear_batch_halt()
        self.force.assign(False)
        self.clip.assign(float("inf"))
        self.clip_host = float("inf")

    def release(self) -> None:
        """The watcher is gone: the check (still in traced steps) never skips an update, nor clips."""
        self.active.assign(False)
        self.halt.assign(False)
        clear_batch_halt()
        self.force.assign(False)
        self.clip.assign(float("inf"))
        self.clip_host = float("inf")

    def opt_variables(self) -> list:
        opt = self.opt_ref()
        return list(getattr(opt, "variables", [])) if opt is not None else []
