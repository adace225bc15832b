"""The zero-code hooks of the JAX backend: optax updates checked in the graph, jitted steps return the check.

JAX runs Python hooks once, when a step is traced, so the check is built into the traced step:

* every optax ``GradientTransformation`` is wrapped at construction (``optax.adam(...)``, ``chain``,
  ``inject_hyperparams``... all go through ``GradientTransformation.__new__``); the outermost
  ``update`` of a step (the inner transforms of a chain are not counted) computes the step's flag
  vector (:mod:`.check`) next to the update, and in recovery mode drops a failing update in the graph;
* ``optax.apply_updates`` / ``eqx.apply_updates`` (the NNX ``Optimizer`` and Linen ``TrainState`` call
  the first): in a jitted step, the check reads the parameters they produce in place of the update
  (:class:`_Pending`), so the update stays fused into the new parameters' own kernels;
* ``jax.value_and_grad`` (used by ``nnx.value_and_grad`` and ``eqx.filter_value_and_grad`` too) notes
  the loss it returns, so the check sees the loss the step differentiated;
* ``jax.jit`` (used by ``nnx.jit`` and ``eqx.filter_jit`` too) compiles the user's function with the
  step's flag vectors as one extra output: the host reads them with the step's own results, no
  callback and no extra sync. The jitted object keeps the user's interface (its ``lower``, ``trace``...
  are those of a plain ``jax.jit`` of the same function). An update traced where no such output can
  carry the vector (inside ``lax.scan``, under a jit with ``out_shardings``) reports it through
  ``jax.debug.callback``; an eager update hands it to the host directly.

The host is the installed :class:`~.driver.JaxDriver` (one at a time), reached through :data:`HOST`.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
from jax._src import core as jcore

from . import check

HOST: List[Any] = [None]     # the installed driver
_ORIG: Dict[str, Any] = {}   # what the patches replaced
_DEPTH = [0]                 # optax update nesting (inner transforms of a chain)
_LOSS: List[Any] = [None]   # (the trace it was computed in, the loss) of the last value_and_grad


class _Pending:
    """An update traced in a jitted step whose check is built when the step's trace ends: by then the
    script has applied the update (``optax.apply_updates``), and the check reads the new parameters, an
    output the step computes anyway, in place of the update itself (see :func:`_vector`)."""

    __slots__ = ("loss", "grads", "params", "updates", "new_state", "applied", "u_ids", "p_ids", "pre", "vec",
                 "scheduled")

    def __init__(self, loss: Any, grads: Any, params: Any, updates: Any, new_state: Any,
                 pre: Optional[Tuple[Any, Any]] = None, scheduled: Any = None) -> None:
        self.loss, self.grads, self.params, self.updates, self.new_state = loss, grads, params, updates, new_state
        self.scheduled = scheduled  # the rate a schedule gives the update (check.schedule_lr), or None
        self.applied: Any = None
        self.u_ids = [id(x) for x in jax.tree_util.tree_leaves(updates)]
        self.p_ids = [id(x) for x in check.float_leaves(params)] if params is not None else None
        # recovery: (the vector read without the update, its ok); the update is gated where it is applied
        # (:meth:`gate`), which completes the vector
        self.pre = pre
        self.vec: Any = None

    @property
    def gating(self) -> bool:
        return self.pre is not None

    def vector(self) -> Any:
        if self.vec is not None:
            return self.vec
        post = self.applied if self.applied is not None else self.updates
        return check.step_vector(self.loss, self.grads, self.params, post, self.new_state, self.scheduled)[0][None, :]

    def gate(self, params: Any, new_params: Any) -> Any:
        """Recovery: ``new_params`` (``apply_updates(params, update)``) where the step's check passes, else
        ``params``. The check reads the new parameters, as the plain check does, so the update stays fused
        into their kernels and a healthy step is bit for bit the plain one (a gate on the update itself
        made XLA compute it apart: a 1-ulp drift of SGD-Nesterov within 20 steps)."""
        vec, ok = check.with_post(*self.pre, new_params)
        self.vec = vec[None, :]
        return check.select(ok, new_params, params)


class _Ctx:
    """One traced outermost function: its trace and the flag vectors of the updates traced in it (a
    :class:`_Pending` for an update whose vector is built at the end of the trace)."""

    __slots__ = ("trace", "flags", "inline", "nested")

    def __init__(self, inline: bool = False) -> None:
        self.trace = jcore.trace_ctx.trace
        self.flags: List[Any] = []
        # updates traced in a nested body (a lax.scan's step) awaiting their apply_updates: (trace, _Pending)
        self.nested: List[Tuple[Any, "_Pending"]] = []
        # recovery gates each update in the update itself (the step applies it by a function of its own,
        # not optax.apply_updates: :class:`_Regate`)
        self.inline = inline

    def applied(self, params: Any, updates: Any, new_params: Any) -> Any:
        """``new_params = apply_updates(params, updates)`` traced here: when ``updates`` is what an update
        of this trace returned and ``params`` the parameters it was checked on, its check reads
        ``new_params`` (finite exactly when the update is, the parameters being finite: the check's
        pre-update flag) in place of the update. The update then stays fused into the parameters' own
        new values: read apart, XLA computes it in kernels of its own (two per leaf on CPU)."""
        ids = [id(x) for x in jax.tree_util.tree_leaves(updates)]
        for p in reversed(self.flags):
            if isinstance(p, _Pending) and p.applied is None and p.u_ids == ids:
                if p.p_ids is not None and p.p_ids == [id(x) for x in check.float_leaves(params)]:
                    p.applied = new_params
                    if p.gating:
                        return p.gate(params, new_params)
                return new_params
        return new_params


class _Regate(Exception):
    """Raised at the end of a recovering step's trace when an update was not applied through
    ``optax.apply_updates`` (no gate on its parameters): the step is traced again with the gate inside the
    update (:func:`.check.gate`)."""


_STACK: List[_Ctx] = []


def tracing() -> bool:
    return not isinstance(jcore.trace_ctx.trace, jcore.EvalTrace)


def _here() -> Optional[_Ctx]:
    """The context of the function being traced right now (None inside a nested transform's body)."""
    if _STACK and _STACK[-1].trace is jcore.trace_ctx.trace:
        return _STACK[-1]
    return None


def _live(host: Any) -> bool:
    return host is not None and not host.suspended and not host.disabled


# --------------------------------------------------------------------------- the loss

def _note_loss(value: Any) -> None:
    _LOSS[0] = (jcore.trace_ctx.trace, value)


def _take_loss() -> Any:
    """The loss differentiated in the trace the update runs in (a jit, a scan body, eager), once."""
    got, _LOSS[0] = _LOSS[0], None
    if got is not None and got[0] is jcore.trace_ctx.trace:
        return got[1]
    return None


def _value_and_grad(fun: Callable, *a: Any, **k: Any) -> Callable:
    g = _ORIG["value_and_grad"](fun, *a, **k)
    has_aux = k.get("has_aux", a[1] if len(a) > 1 else False)

    @functools.wraps(g)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = g(*args, **kwargs)
        host = HOST[0]
        if _live(host):
            try:
                _note_loss(out[0][0] if has_aux else out[0])
                if not tracing():  # an eager step: what its replay recomputes
                    host.note_eager(g, args, kwargs)
            except Exception:
                pass
        return out
    return wrapped


# --------------------------------------------------------------------------- optax updates

def optimizer_info(frames_from: Any) -> Dict[str, Any]:
    """The optax factory that built a transform (the outermost public optax function on the stack)
    and its numeric arguments: ``{"name": "adam", "hyperparams": {"learning_rate": 0.05, ...}}``."""
    info: Dict[str, Any] = {}
    f = frames_from
    public = sys.modules.get("optax")
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        name = f.f_code.co_name
        if mod.startswith("optax") and hasattr(public, name) and name != "chain" \
                and not mod.endswith("._src.base"):
            hp = {k: v for k, v in f.f_locals.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            info = {"name": name, "hyperparams": hp, "alias": mod.endswith(".alias")}
            if callable(f.f_locals.get("learning_rate")):
                info["schedule"] = f.f_locals["learning_rate"]  # read at each update: check.schedule_lr
        f = f.f_back
    return info


def _wrap_update(update: Callable, info: Dict[str, Any]) -> Callable:
    if getattr(update, "_nanguard", False):
        return update

    def wrapped(updates: Any, state: Any, params: Any = None, *a: Any, **k: Any) -> Any:
        host = HOST[0]
        if check.REPLAY_TRACE[0] and _DEPTH[0] == 0 and tracing():
            return _scoped_update(update, updates, state, params, a, k)
        if not _live(host) or _DEPTH[0] > 0:
            return update(updates, state, params, *a, **k)
        if not tracing():
            host.check_stop()  # an eager loop stops before its next update
        elif "apply:equinox" not in _ORIG:
            _patch_apply()  # Equinox imported after the install
        return _outer_update(host, update, info, updates, state, params, a, k)
    wrapped._nanguard = True  # type: ignore[attr-defined]
    wrapped._nanguard_info = info  # type: ignore[attr-defined]
    return wrapped


def _scoped_update(update: Callable, grads: Any, state: Any, params: Any, a: tuple, k: dict) -> Any:
    """The outermost update traced for the replay of a failing step (``check.REPLAY_TRACE``): under
    :data:`.check.UPDATE_SCOPE`, so that the replay tells the update's equations from the script's own
    processing of the gradients before it (a name scope is metadata: the values are the same)."""
    _DEPTH[0] += 1
    try:
        with jax.named_scope(check.UPDATE_SCOPE):
            return update(grads, state, params, *a, **k)
    finally:
        _DEPTH[0] -= 1


def _outer_update(host: Any, update: Callable, info: Dict[str, Any], grads: Any, state: Any, params: Any,
                  a: tuple, k: dict) -> Any:
    g = grads
    if host.clip_norm is not None:
        g = check.clip_tree(grads, host.clip_norm)
    _DEPTH[0] += 1
    try:
        out_u, new_state = update(g, state, params, *a, **k)
    finally:
        _DEPTH[0] -= 1
    try:
        ctx = _here()
        traced = tracing()
        loss = _take_loss()
        sched = check.schedule_lr(info, state)
        if ctx is not None and not (host.recovering and ctx.inline):  # the vector is built later (_Pending)
            if host.lr_scale != 1.0:
                out_u = check.scale_tree(out_u, host.lr_scale)
            host.note_optimizer(info, state)
            # the check reads the update's own new state; with recovery, a failing update returns the old one
            # (read apart from the update's kernels) and keeps the old parameters where it is applied
            # (_Pending.gate, which completes this vector with them)
            pre = check.step_vector(loss, grads, params, None, new_state, sched) if host.recovering else None
            ctx.flags.append(_Pending(loss, grads, params, out_u, new_state, pre, sched))
            if pre is not None:
                new_state = check.select(pre[1], new_state, state)
            return out_u, new_state
        outer = _STACK[-1] if _STACK and traced and ctx is None else None
        if outer is not None and not outer.inline and not host.recovering:
            # a nested body's update (a lax.scan step) of a jitted step: its check reads the parameters
            # apply_updates makes, so the update stays fused into them (read apart, it drifts by an ulp)
            if host.lr_scale != 1.0:
                out_u = check.scale_tree(out_u, host.lr_scale)
            host.note_optimizer(info, state)
            outer.nested.append((jcore.trace_ctx.trace, _Pending(loss, grads, params, out_u, new_state, None, sched)))
            return out_u, new_state
        vec, ok = check.step_vector(loss, grads, params, out_u, new_state, sched)
        if host.recovering:
            vec, out_u, new_state = check.gate(ok, vec, out_u, new_state, state, host.lr_scale)
        elif host.lr_scale != 1.0:  # an early warning's rollback lowered the step size (no failure recovery)
            out_u = check.scale_tree(out_u, host.lr_scale)
        host.note_optimizer(info, state)
        if ctx is not None:
            ctx.flags.append(vec[None, :])
        elif not traced:
            host.on_vectors(vec[None, :], host.take_eager())
        else:
            jax.debug.callback(host.on_callback, vec, ordered=False)
    except Exception as e:  # the check must never break the user's step
        host.internal_error(e)
    return out_u, new_state


# --------------------------------------------------------------------------- jit

def _instrumented(fun: Callable, inline: Optional[List[bool]] = None) -> Callable:
    """``fun`` returning its outputs and the step's flag vectors. ``inline``: the jitted step's flag
    (a one-element list) that its updates are gated inside the update (set by :class:`_Regate`)."""
    @functools.wraps(fun)
    def traced(*args: Any, **kwargs: Any) -> Any:
        ctx = _Ctx(bool(inline and inline[0]))
        _STACK.append(ctx)
        try:
            out = fun(*args, **kwargs)
        finally:
            _STACK.remove(ctx)
        if any(isinstance(f, _Pending) and f.gating and f.vec is None for f in ctx.flags) or \
                any(p.applied is None for _, p in ctx.nested):
            # an update applied without optax.apply_updates: gate it (a nested one: check it) in the update
            raise _Regate()
        vecs = [v for v in (_vector(f) for f in ctx.flags) if v is not None]
        flags = jnp.concatenate(vecs, 0) if vecs else None
        return out, flags
    return traced


def _vector(f: Any) -> Any:
    """A flag vector of the trace (a :class:`_Pending` one built now); None when building it failed."""
    if not isinstance(f, _Pending):
        return f
    try:
        return f.vector()
    except Exception as e:  # the check must never break the user's step
        if HOST[0] is not None:
            HOST[0].internal_error(e)
        return None


def _apply_updates(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapped(params: Any, updates: Any, *a: Any, **k: Any) -> Any:
        new = orig(params, updates, *a, **k)
        ctx = _here() if _STACK else None
        if ctx is None and _STACK and _STACK[-1].nested:
            try:
                _nested_applied(_STACK[-1], params, updates, new)
            except Exception as e:  # the check must never break the user's step
                if HOST[0] is not None:
                    HOST[0].internal_error(e)
        if ctx is not None:
            try:
                return ctx.applied(params, updates, new)
            except Exception as e:  # the check must never break the user's step
                if HOST[0] is not None:
                    HOST[0].internal_error(e)
        return new
    wrapped._nanguard = True  # type: ignore[attr-defined]
    return wrapped


def _nested_applied(outer: _Ctx, params: Any, updates: Any, new_params: Any) -> None:
    """``apply_updates`` in a nested body: the update traced there for these parameters is checked on the new
    parameters, reported by callback (a scan step has no output of the jitted step to carry it)."""
    here, ids = jcore.trace_ctx.trace, [id(x) for x in jax.tree_util.tree_leaves(updates)]
    for i, (trace, p) in enumerate(outer.nested):
        if trace is here and p.applied is None and p.u_ids == ids and \
                p.p_ids == [id(x) for x in check.float_leaves(params)]:
            p.applied = new_params
            jax.debug.callback(HOST[0].on_callback, p.vector()[0], ordered=False)
            return


def _patch_apply() -> None:
    """Wrap ``optax.apply_updates`` and ``equinox.apply_updates`` (once each, when imported)."""
    for mod in ("optax", "equinox"):
        m = sys.modules.get(mod)
        fn = getattr(m, "apply_updates", None)
        if fn is not None and not getattr(fn, "_nanguard", False):
            _ORIG[f"apply:{mod}"] = (m, fn)
            m.apply_updates = _apply_updates(fn)  # type: ignore[union-attr]


class Jitted:
    """``jax.jit(fun)`` under the guard: calls return ``fun``'s outputs; the step's flag vectors,
    compiled in as an extra output, go to the host. Other attributes are a plain jit's."""

    def __init__(self, fun: Callable, a: tuple, k: dict) -> None:
        self._fun, self._a, self._k = fun, a, k
        kk = dict(k)
        kk.pop("out_shardings", None)  # all None (nnx.jit passes a tuple of them): the same as none
        self.donated = bool(kk.pop("donate_argnums", None) or kk.pop("donate_argnames", None))
        kk.pop("donate_argnums", None)
        kk.pop("donate_argnames", None)
        # donated inputs are the pre-step state the replay and the rollback need: they stay alive
        self._kk = kk
        self._inline = [False]  # recovery gates the updates inside them (:class:`_Regate`)
        self._inner = _ORIG["jit"](_instrumented(fun, self._inline), *a, **kk)
        self._plain: Any = None
        functools.update_wrapper(self, fun)  # type: ignore[arg-type]

    def _run(self, args: tuple, kwargs: dict) -> Any:
        try:
            return self._inner(*args, **kwargs)
        except _Regate:
            if self._inline[0]:
                raise
            self._inline[0] = True
            self._inner = _ORIG["jit"](_instrumented(self._fun, self._inline), *self._a, **self._kk)
            return self._inner(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        host = HOST[0]
        if not _live(host) or tracing():
            out, flags = self._run(args, kwargs)
            ctx = _here()
            if flags is not None and ctx is not None:
                ctx.flags.append(flags)  # a jitted step inside another traced function
            return out
        args, kwargs = host.before_call(self, args, kwargs)
        out, flags = self._run(args, kwargs)
        if flags is not None:
            host.after_call(self, args, kwargs, out, flags)
        return out

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_fun", "_a", "_k", "_kk", "_inline", "_inner", "_plain", "donated"):
            raise AttributeError(name)
        if self._plain is None:
            self._plain = _ORIG["jit"](self._fun, *self._a, **self._k)
        return getattr(self._plain, name)


def _jit(fun: Any = None, *a: Any, **k: Any) -> Any:
    if fun is None:
        return lambda f: _jit(f, *a, **k)
    if HOST[0] is None or not callable(fun) or jax.tree_util.tree_leaves(k.get("out_shardings")):
        return _ORIG["jit"](fun, *a, **k)  # real output shardings: the check reports by callback there
    return Jitted(fun, a, k)


# --------------------------------------------------------------------------- install

def install(host: Any) -> None:
    """Patch optax, ``jax.jit`` and ``jax.value_and_grad`` for ``host`` (idempotent)."""
    HOST[0] = host
    if _ORIG:
        return
    from optax._src import base
    _ORIG["jit"], _ORIG["value_and_grad"] = jax.jit, jax.value_and_grad
    jax.jit = _jit
    jax.value_and_grad = _value_and_grad
    _patch_apply()
    for cls in (base.GradientTransformation, base.GradientTransformationExtraArgs):
        orig_new = cls.__new__
        _ORIG[f"new:{cls.__name__}"] = (cls, orig_new)

        def new(c: Any, init: Any, update: Any, _orig: Any = orig_new) -> Any:
            try:
                info = optimizer_info(sys._getframe(1))
                upd = _wrap_update(update, info)
                if info.get("alias") and HOST[0] is not None:
                    HOST[0].note_optimizer(info, None)  # built: the context names it if no outer one is named
            except Exception:
                upd = update
            return _orig(c, init, upd)
        cls.__new__ = new  # type: ignore[method-assign]
    _patch_multisteps()


def _patch_multisteps() -> None:
    """``optax.MultiSteps`` is a class, not a transform built by ``GradientTransformation``: its ``update``
    (the outermost update of a step that accumulates gradients) is wrapped here, so the check reads each
    micro-step's gradients and loss where the step is traced, and recovery keeps the old accumulator with
    the old state. (Unwrapped, the inner optimizer's update was the outermost one, inside MultiSteps'
    ``lax.cond``: no loss read, and a skip left the NaN gradients in the accumulator.)"""
    ms = getattr(sys.modules.get("optax"), "MultiSteps", None)
    orig = getattr(ms, "update", None)
    if orig is None or getattr(orig, "_nanguard", False):
        return
    _ORIG["multisteps"] = (ms, orig)

    def update(self: Any, updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        info = getattr(getattr(getattr(self, "_opt", None), "update", None), "_nanguard_info", None) or \
            {"name": "MultiSteps", "hyperparams": {}}
        return _wrap_update(functools.partial(orig, self), info)(updates, state, params, **extra)
    update._nanguard = True  # type: ignore[attr-defined]
    ms.update = update


def uninstall() -> None:
    """Put back what :func:`install` replaced (transforms built meanwhile stay wrapped, inert)."""
    HOST[0] = None
    if not _ORIG:
        return
    jax.jit = _ORIG.pop("jit")
    jax.value_and_grad = _ORIG.pop("value_and_grad")
    for key in [k for k in _ORIG if k.startswith("new:")]:
        cls, orig_new = _ORIG.pop(key)
        cls.__new__ = orig_new
    for key in [k for k in _ORIG if k.startswith("apply:")]:
        mod, fn = _ORIG.pop(key)
        mod.apply_updates = fn
    if "multisteps" in _ORIG:
        ms, fn = _ORIG.pop("multisteps")
        ms.update = fn
