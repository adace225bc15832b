"""The replay: a jaxpr evaluated equation by equation on concrete inputs, with the taint of every value.

``jax.make_jaxpr(pure_fn)(*args)`` stages the whole failing step (forward, the transpose of
``value_and_grad``, the optimizer's update) into one jaxpr. :class:`Replay` binds its equations one
at a time on the pre-step values, recursing into the bodies of ``jit``/``closed_call``/
``custom_jvp_call``/``custom_vjp_call``/``checkpoint``/``cond``, and iterating ``while`` and ``scan``
in Python (beyond :data:`EVAL_BUDGET` equations, a loop is bound whole and named at its call). Each
value carries a record (:class:`Rec`): its producer op, its stage and the taint of its non-finite
entries, decided by the core's rule (``nanguard.core.locate.taint.Taints.decide``): a new real origin
where an op makes NaN/Inf from finite inputs, a soft one for a non-finite constant written on purpose
(``jnp.where(mask, s, -jnp.inf)``) or an input holding only ``-inf``.

Stages: an equation is ``backward`` when its name stack holds ``transpose(`` (the transposed linear
part of a gradient), ``optimizer`` when it reads a backward or optimizer value (the update after the
gradient), else ``forward``. When the step's optax update is marked (its trace under ``nanguard run``
puts it in the name scope :data:`..check.UPDATE_SCOPE`), an equation outside it that reads backward
values and no optimizer value is the script's own processing of the gradients before the update
(per-example clipping or normalization, a hand-written weight decay): ``backward``, as the gradients
the update is given. A forward origin that only JAX's derivative computation reads (the JVP
coefficient ``0.5 / sqrt(x)`` staged beside the primal ops) is reported as a backward origin of its
forward op (:meth:`Replay.derivative_only`).

Sinks (the outputs that matter): forward outputs of the step (the loss), backward values read by
the optimizer or returned (the gradients), optimizer outputs (new parameters and state). Non-finite
values that reach none of them (an intentional ``-inf`` mask absorbed by a softmax) are no origin.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ...core.locate.oplog import OpGraph
from ...core.locate.result import Sinks, constant_detail
from ...core.locate.taint import CONST, NEW, Taint, Taints, absorbed, escaped_mask
from ..check import UPDATE_SCOPE
from . import numerics as N
from . import ops as O
from .frames import Frame, FrameFinder, is_backward

__all__ = ["Rec", "Leaf", "Replay", "ReplayTimeout", "bind", "EVAL_BUDGET", "KEEP_BUDGET"]

EVAL_BUDGET = 400_000      # equations evaluated one by one; loops beyond it are bound whole
PRECOMPUTE_BUDGET = 200_000_000   # elements of intermediate values computed in one compiled run
LOOPS = ("cond", "while", "scan")
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                 "xla_disable_hlo_passes": "fusion,cpu-instruction-fusion,algsimp,cse"}
KEEP_BUDGET = 32_000_000   # elements of op inputs kept for the origin's evidence


def _body(eqn: Any) -> Any:
    """The jaxpr a call-like equation is evaluated through (None: bound as one op)."""
    key = O.CALLS.get(eqn.primitive.name)
    return eqn.params.get(key) if key else None


def precompute(closed: Any, args_flat: Sequence[Any], fused: bool = False) -> Optional[List[List[Any]]]:
    """Every equation's outputs, in the replay's order, from ONE compiled run of the jaxpr (calls
    inlined; a loop or cond counts as one equation): the replay then reads values instead of compiling
    each primitive for an eager call (~30-80 ms each on CPU). None when they would not fit
    :data:`PRECOMPUTE_BUDGET`. ``fused``: XLA's default passes (fusion, algebraic simplification), the
    rounding of the user's compiled step, for a failure the unfused evaluation did not reproduce."""
    import jax

    def size(jaxpr: Any) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            body = _body(eqn)
            if body is not None:
                n += size(getattr(body, "jaxpr", body))
            else:
                n += sum(int(np.prod(getattr(v.aval, "shape", ()) or (1,))) for v in eqn.outvars)
        return n
    if size(closed.jaxpr) > PRECOMPUTE_BUDGET:
        return None

    def collect(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], out: list) -> list:
        from jax._src.core import Literal
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            vals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            body = _body(eqn)
            if body is not None:
                res = collect(getattr(body, "jaxpr", body), getattr(body, "consts", ()) if hasattr(body, "jaxpr")
                              else (), vals, out)
            else:
                res = bind(eqn, vals)
                out.append(res)
            env.update(zip(eqn.outvars, res))
        return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    def all_values(*args: Any) -> list:
        out: list = []
        collect(closed.jaxpr, closed.consts, args, out)
        return out
    lowered = jax.jit(all_values).lower(*args_flat)
    try:    # a big graph with every intermediate as an output: LLVM's expensive passes dominate
        compiled = lowered.compile() if fused else lowered.compile(compiler_options=_FAST_COMPILE)
    except Exception:
        compiled = lowered.compile()
    return compiled(*args_flat)


def _holds_scope(jaxpr: Any, scope: str) -> bool:
    """Some equation of ``jaxpr`` or of a jaxpr nested in it has ``scope`` in its name stack."""
    from jax._src import core as jcore
    todo = [jaxpr]
    while todo:
        j = todo.pop()
        for e in j.eqns:
            if scope in str(e.source_info.name_stack):
                return True
        todo.extend(jcore.subjaxprs(j))
    return False


def bind(eqn: Any, vals: Sequence[Any], params: Optional[dict] = None) -> List[Any]:
    """Evaluate one equation on concrete values (``params`` replaces its bind parameters)."""
    bp = eqn.primitive.get_bind_params(eqn.params)
    subfuns, bp = bp if isinstance(bp, tuple) else ((), bp)   # jax < 0.7 returns (subfuns, params)
    ans = eqn.primitive.bind(*subfuns, *vals, **(bp if params is None else {**bp, **params}))
    return list(ans) if eqn.primitive.multiple_results else [ans]


class ReplayTimeout(RuntimeError):
    """The replay ran past its deadline (``Replay.deadline``, a ``time.monotonic()`` value)."""


class Rec:
    """One value of the replay: its array, producer op (-1: an input or constant), stage, taint, and
    (for the step's inputs) the leaf index."""
    __slots__ = ("val", "op", "stage", "taint", "leaf", "const", "_flags", "carried")

    def __init__(self, val: Any, op: int = -1, stage: Optional[str] = None, taint: Optional[Taint] = None,
                 leaf: Optional[int] = None, const: bool = False) -> None:
        self.val, self.op, self.stage, self.taint, self.leaf, self.const = val, op, stage, taint, leaf, const
        self._flags: Optional[tuple] = None
        self.carried: Optional[Taint] = None  # finite, computed from an earlier failure's values (taint.absorbed)

    @property
    def flags(self) -> tuple:
        if self._flags is None:
            self._flags = N.flags(self.val)
        return self._flags

    @property
    def nonfinite(self) -> bool:
        return any(self.flags)


@dataclass
class Leaf:
    """An input leaf of the step: its tree path, name, kind (param | optimizer_state | data | buffer;
    None: decided by use), module, and how the replay used it."""
    path: str
    name: str
    kind: Optional[str] = None
    module: Optional[str] = None
    forward_use: bool = False
    optimizer_use: bool = False
    first_use: Optional[int] = None


@dataclass
class Ctx:
    frame: Optional[Frame]
    name_stack: str
    backward: bool
    lib: bool = False
    calls: tuple = ()   # the names of the jitted library functions the op runs in (jnp.std -> "_std", "_var")


class JaxOpLog(OpGraph):
    """The op log of the replay: per executed equation its primitive (``names``), canonical name,
    stage, frame, name stack, consumers (all of them: ``users``), and kept inputs."""

    def __init__(self) -> None:
        super().__init__(10 ** 9, pass_ops=O.PASS, select_ops=O.SELECT)
        self.canon: List[str] = []
        self.stage: List[str] = []
        self.frame: List[Optional[Frame]] = []
        self.name_stack: List[str] = []
        self.lib: List[bool] = []             # the op runs inside a library call made on its user line
        self.calls: List[tuple] = []          # the names of the jitted functions the op runs in (Ctx.calls)
        self.users: Dict[int, List[int]] = {}
        self.eqns: Dict[int, Any] = {}
        self.inputs: Dict[int, tuple] = {}      # op -> input values (kept within KEEP_BUDGET)
        self.params_read: Dict[int, List[int]] = {}   # op -> input leaves it read directly
        self._kept = 0

    def keep_inputs(self, idx: int, eqn: Any, vals: Sequence[Any]) -> None:
        n = sum(int(getattr(v, "size", 1)) for v in vals)
        if self._kept + n <= KEEP_BUDGET:
            self.inputs[idx] = tuple(vals)
            self.eqns[idx] = eqn
            self._kept += n


class Replay:
    """Evaluates one closed jaxpr on its inputs (see the module docstring)."""

    def __init__(self, frames: FrameFinder, leaves: List[Leaf]) -> None:
        self.frames = frames
        self.leaves = leaves
        self.log = JaxOpLog()
        self.prov = Taints()
        self.sinks = Sinks()
        self.notes: List[str] = []
        self.births: Dict[int, dict] = {}        # taint seq -> what made it (op, values, outputs)
        self.n_evals = 0
        self.batch_size: Optional[int] = None
        self.loss_ops: set = set()
        self._grad_seen: set = set()
        self.deadline: Optional[float] = None          # time.monotonic() after which the replay gives up
        self.pre: Optional[List[List[Any]]] = None   # precomputed outputs (see precompute), read in order
        self._cursor = 0
        self._in_loop = 0
        self.update_scoped = False   # the trace holds the marked optax update (see the module docstring)

    # ------------------------------------------------------------------ entry
    def run(self, closed: Any, args_flat: Sequence[Any], fast: bool = True, fused: bool = False) -> List[Rec]:
        """Replay ``closed`` on ``args_flat`` (``fast``: values from one compiled run where they fit;
        ``fused``: that run with XLA's fusions, see :func:`precompute`)."""
        if fast:
            try:
                self.pre = precompute(closed, args_flat, fused)
            except Exception as e:   # the eager path below still works
                self.notes.append(f"values computed op by op ({type(e).__name__} in the compiled run)")
        jaxpr = closed.jaxpr
        self.update_scoped = _holds_scope(jaxpr, UPDATE_SCOPE)
        env: Dict[Any, Rec] = {}
        for v, c in zip(jaxpr.constvars, closed.consts):
            env[v] = Rec(c, const=True)
        for i, (v, a) in enumerate(zip(jaxpr.invars, args_flat)):
            env[v] = Rec(a, stage="input", leaf=i)
        outs = self.eval_jaxpr(jaxpr, env, Ctx(None, "", False))
        self._outputs(outs)
        return outs

    def _outputs(self, outs: List[Rec]) -> None:
        for k, r in enumerate(outs):
            if not N.is_float(r.val) or r.stage in (None, "input"):
                continue
            bad = r.nonfinite
            if r.stage == "forward":
                self.loss_ops.add(r.op)
                if np.size(r.val) <= 1 or not bad:
                    self.sinks.note_loss(not bad, self.taint_of(r, r.op), self._first(r.val) if bad else None,
                                         list(np.shape(r.val)))
                else:
                    self.sinks.note_loss(False, self.taint_of(r, r.op), self._first(r.val), list(np.shape(r.val)))
            elif r.stage == "backward" and bad:
                self._grad_sink(r, f"output[{k}]")
            elif r.stage == "optimizer" and bad:
                self.sinks.opt.append((f"output[{k}]", None, self.taint_of(r, r.op)))

    @staticmethod
    def _first(v: Any) -> Any:
        x = N.host(v)
        if x is None or x.size == 0:
            return None
        bad = x[~np.isfinite(x)] if x.dtype.kind == "f" else x
        return N.jnum(bad.reshape(-1)[0] if bad.size else x.reshape(-1)[0])

    def _grad_sink(self, r: Rec, name: str) -> None:
        key = (r.op, id(r.val))
        if key not in self._grad_seen:
            self._grad_seen.add(key)
            shape = "x".join(str(s) for s in np.shape(r.val))
            self.sinks.grad.append((f"{name} ({r.val.dtype}[{shape}])", self.taint_of(r, r.op)))
            self.sinks.grad_marked = True

    # ------------------------------------------------------------------ taints of inputs and constants
    def taint_of(self, r: Rec, at_op: int) -> Optional[Taint]:
        """The taint of a value (a non-finite step input or constant gets one at its first use)."""
        if r.taint is not None or not r.nonfinite:
            return r.taint
        nan, inf = r.flags
        x = N.host(r.val)
        only_neginf = bool(not nan and x is not None and not np.isposinf(x).any())
        if r.leaf is not None:
            leaf = self.leaves[r.leaf]
            t = self.prov.add("preexisting", only_neginf, at_op, "input")
            t.pre_kind, t.name = leaf.kind, leaf.name
            t.first_use = {"op": at_op}
            t.detail = {"leaf": r.leaf, "stats": {**N.stats(x), "bad_rows": N.bad_rows(x)}}
        else:
            t = self.prov.add("constant", True, at_op, self.log.stage[at_op] if 0 <= at_op < len(self.log) else None)
            t.detail = self._const_detail(at_op, self._first(r.val))
        r.taint = t
        return t

    def _const_detail(self, at_op: int, value: Any) -> dict:
        """A non-finite constant the program wrote, named by the op that first read it."""
        log = self.log
        if not 0 <= at_op < len(log):
            return {"constant": True, "value": value}
        canon = log.canon[at_op]
        api = O.api_name(canon) if canon == "where" else "a constant"   # materialised by a cast/broadcast
        return constant_detail(canon, canon, api, None, log.stage[at_op], log.frame[at_op], [value])

    # ------------------------------------------------------------------ evaluation
    def eval_jaxpr(self, jaxpr: Any, env: Dict[Any, Rec], ctx: Ctx) -> List[Rec]:
        from jax._src.core import Literal
        for eqn in jaxpr.eqns:
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise ReplayTimeout(f"the replay ran out of time after {len(self.log)} equations")
            ins = [Rec(v.val, const=True) if isinstance(v, Literal) else env[v] for v in eqn.invars]
            tb = eqn.source_info.traceback
            frame = self.frames.frame(tb) or ctx.frame
            lib = self.frames.in_library(tb) if tb is not None else ctx.lib
            ns = str(eqn.source_info.name_stack)
            ns = f"{ctx.name_stack}/{ns}" if ctx.name_stack and ns else (ctx.name_stack or ns)
            back = ctx.backward or is_backward(ns)
            sub = Ctx(frame, ns, back, lib, ctx.calls)
            outs = self.higher_order(eqn, ins, sub)
            if outs is None:
                outs = self.apply(eqn, ins, sub)
            for v, r in zip(eqn.outvars, outs):
                env[v] = r
        return [Rec(v.val, const=True) if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    def _stage(self, ins: List[Rec], ctx: Ctx) -> str:
        if ctx.backward:
            return "backward"
        if self.update_scoped and UPDATE_SCOPE in ctx.name_stack:
            return "optimizer"
        if any(r.stage == "optimizer" for r in ins):
            return "optimizer"
        if any(r.stage == "backward" for r in ins):
            return "backward" if self.update_scoped else "optimizer"
        return "forward"

    def apply(self, eqn: Any, ins: List[Rec], ctx: Ctx) -> List[Rec]:
        """Bind one equation on its inputs' values and record its outputs' taints."""
        prim = eqn.primitive.name
        vals = [r.val for r in ins]
        outs_v = self._next() if self.pre is not None and not self._in_loop else bind(eqn, vals)
        self.n_evals += 1
        idx = len(self.log)
        stage = self._stage(ins, ctx)
        log = self.log
        log.record(prim, [(r.op, 0) if r.op >= 0 else None for r in ins])
        log.canon.append(O.canonical(prim))
        log.stage.append(stage)
        log.frame.append(ctx.frame)
        log.name_stack.append(ctx.name_stack)
        log.lib.append(ctx.lib)
        log.calls.append(ctx.calls)
        leaves_read = []
        for r in ins:
            if r.op >= 0:
                log.users.setdefault(r.op, []).append(idx)
            if r.leaf is not None:
                leaves_read.append(r.leaf)
                leaf = self.leaves[r.leaf]
                if stage == "optimizer":
                    leaf.optimizer_use = True
                else:
                    leaf.forward_use = True
                if leaf.first_use is None:
                    leaf.first_use = idx
            if stage == "optimizer" and r.stage == "backward" and N.is_float(r.val) and r.nonfinite:
                self._grad_sink(r, f"gradient read by {O.canonical(prim)}")
        if leaves_read:
            log.params_read[idx] = leaves_read
        if O.family_of(prim) is not None or prim in O.EPS_PRODUCERS or prim in ("sub", "reduce_max", "mul") \
                or any(str(getattr(v, "dtype", "")) in N.LOW_PRECISION for v in outs_v):  # float32 chain re-runs
            log.keep_inputs(idx, eqn, vals)
        outs = [Rec(v, op=idx, stage=stage) for v in outs_v]
        bad = [o for o in outs if N.is_float(o.val) and o.nonfinite]
        in_nf = [(r.op, 0) if r.op >= 0 else None for r in ins]
        if stage == "forward":
            log.note_consumers(idx, prim, [(p, r.nonfinite) for p, r in zip(in_nf, ins)], bool(bad),
                               any(N.is_float(o.val) for o in outs))
        if bad:
            self._taint_outputs(eqn, prim, idx, stage, ins, outs, bad)
        if stage != "optimizer" and prim not in O.SELECT and len(bad) < len(outs) and \
                any(r.carried is not None or (r.taint is not None and r.taint.real) for r in ins):
            carried = absorbed([r.taint for r in ins], [r.carried for r in ins])
            for o in outs:
                if o.taint is None:
                    o.carried = carried
        return outs

    def _taint_outputs(self, eqn: Any, prim: str, idx: int, stage: str, ins: List[Rec], outs: List[Rec],
                       bad: List[Rec]) -> None:
        taints = [self.taint_of(r, idx) for r in ins]
        in_nan = any(r.flags[0] for r in ins)
        in_inf = any(r.flags[1] for r in ins)
        out_nan = any(o.flags[0] for o in bad)
        out_inf = any(o.flags[1] for o in bad)

        def mask_sink() -> bool:   # a forward sum over entries (a matmul contracts a dimension)
            if prim not in O.MASK_SINKS or stage != "forward":
                return False
            if prim == "dot_general":
                return bool(eqn.params["dimension_numbers"][0][0])
            return int(np.size(bad[0].val)) < max(int(np.size(r.val)) for r in ins)
        d = self.prov.decide(out_nan, out_inf, taints, in_nan, in_inf, mask_sink, O.MASK_WRITERS,
                             carried=[r.carried for r in ins])
        if d is NEW:
            mask = self.prov.take_escaped_mask()
            if mask is None and in_inf and (mask_sink() or (prim == "mul" and out_nan and not in_nan)):
                # -inf * w summed with +inf (a mask a matmul kept), or 0 * -inf (a dense label times a
                # masked log-probability)
                mask = escaped_mask([t for t in taints if t is not None], O.MASK_WRITERS)
            t = self.prov.add("op", False, idx, stage)
            self.births[t.seq] = {"op": idx, "eqn": eqn, "ins": [r.val for r in ins], "in_recs": ins,
                                  "outs": [o.val for o in outs], "pos": outs.index(bad[0]), "mask": mask}
        elif d is CONST:
            t = self.prov.add("constant", True, idx, stage)
            t.detail = self._const_detail(idx, self._first(bad[0].val))
        else:
            t = d
        for o in bad:
            o.taint = t

    def _next(self) -> List[Any]:
        out = self.pre[self._cursor]
        self._cursor += 1
        return list(out)

    # ------------------------------------------------------------------ higher-order primitives
    def higher_order(self, eqn: Any, ins: List[Rec], ctx: Ctx) -> Optional[List[Rec]]:
        """Recurse into the body of a call, cond, while or scan (None: bind it as one op)."""
        prim = eqn.primitive.name
        body = _body(eqn)
        if body is not None:
            name = eqn.params.get("name") if prim in ("pjit", "jit") else None
            return self._call(body, ins, Ctx(ctx.frame, ctx.name_stack, ctx.backward, ctx.lib, ctx.calls + (name,))
                              if isinstance(name, str) else ctx)
        if prim not in LOOPS or self.n_evals > EVAL_BUDGET:
            return None
        if self.pre is not None and not self._in_loop:
            self._cursor += 1     # the compiled run evaluated the loop as one equation
        self._in_loop += 1
        try:
            out = self._loop(prim, eqn, ins, ctx)
        finally:
            self._in_loop -= 1
        if out is None and self.pre is not None and not self._in_loop:
            self._cursor -= 1     # bound whole: apply() reads the compiled run's value
        return out

    def _loop(self, prim: str, eqn: Any, ins: List[Rec], ctx: Ctx) -> Optional[List[Rec]]:
        if prim == "cond":
            idx = int(np.asarray(ins[0].val))
            branches = eqn.params["branches"]
            return self._call(branches[max(0, min(idx, len(branches) - 1))], ins[1:], ctx)
        if prim == "while":
            return self._while(eqn, ins, ctx)
        if prim == "scan":
            return self._scan(eqn, ins, ctx)
        return None

    def _call(self, body: Any, ins: List[Rec], ctx: Ctx) -> List[Rec]:
        jaxpr = getattr(body, "jaxpr", body)
        consts = getattr(body, "consts", ()) if hasattr(body, "jaxpr") else ()
        env: Dict[Any, Rec] = {v: Rec(c, const=True) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, ins))
        return self.eval_jaxpr(jaxpr, env, ctx)

    def _while(self, eqn: Any, ins: List[Rec], ctx: Ctx) -> Optional[List[Rec]]:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        while True:
            pred = self._call(p["cond_jaxpr"], cc + carry, ctx)[0]
            if not bool(np.asarray(pred.val)):
                return carry
            if self.n_evals > EVAL_BUDGET:
                self.notes.append("a long while_loop was evaluated whole after the equation budget ran out")
                outs = self.apply(eqn, cc + bc + carry, ctx)
                return outs
            carry = self._call(p["body_jaxpr"], bc + carry, ctx)

    def _scan(self, eqn: Any, ins: List[Rec], ctx: Ctx) -> Optional[List[Rec]]:
        p = eqn.params
        n_c, n_carry, length = p["num_consts"], p["num_carry"], int(p["length"])
        consts, carry, xs = ins[:n_c], ins[n_c:n_c + n_carry], ins[n_c + n_carry:]
        order = range(length - 1, -1, -1) if p.get("reverse") else range(length)
        ys_steps: List[List[Rec]] = []
        for i in order:
            if self.n_evals > EVAL_BUDGET:
                self.notes.append("a long scan was evaluated whole after the equation budget ran out")
                return None   # the caller binds the whole scan from its inputs
            x_i = [Rec(r.val[i], op=r.op, stage=r.stage, taint=r.taint, leaf=r.leaf, const=r.const) for r in xs]
            out = self._call(p["jaxpr"], consts + carry + x_i, ctx)
            carry, ys = out[:n_carry], out[n_carry:]
            ys_steps.append(ys)
        if p.get("reverse"):
            ys_steps.reverse()
        return carry + self._stack(ys_steps, len(eqn.outvars) - n_carry, eqn)

    @staticmethod
    def _stack(ys_steps: List[List[Rec]], n: int, eqn: Any) -> List[Rec]:
        import jax.numpy as jnp
        out = []
        for k in range(n):
            recs = [s[k] for s in ys_steps]
            if not recs:
                aval = eqn.outvars[len(eqn.outvars) - n + k].aval
                out.append(Rec(jnp.zeros(aval.shape, aval.dtype)))
                continue
            taint = Taints.earliest([r.taint for r in recs])
            last = recs[-1]
            out.append(Rec(jnp.stack([r.val for r in recs]), op=last.op, stage=last.stage, taint=taint))
        return out

    # ------------------------------------------------------------------ after the run
    def derivative_only(self, op: int) -> bool:
        """A forward op whose values reach the backward ops but never a forward output of the step nor
        a value nothing reads (the loss of a step that does not return it): JAX's derivative computation
        staged beside the primal ops (a JVP coefficient)."""
        log = self.log
        seen, todo, reached_back = set(), [op], False
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            if i in self.loss_ops or not log.users.get(i):
                return False
            for u in log.users.get(i, ()):
                if log.stage[u] == "forward":
                    todo.append(u)
                elif log.stage[u] == "backward":
                    reached_back = True
        return reached_back

    def forward_op(self, idx: int) -> Optional[int]:
        """The forward op a backward (or derivative-only) op ``idx`` differentiates: a producer of its
        inputs written on the same line, else an op of that line sharing an input with it; ops in an
        op family first."""
        log = self.log
        frame = log.frame[idx]
        if frame is None:
            return None
        ins = {p for p in log.inprod[idx] if p >= 0}
        cands = []
        for i in range(idx - 1, -1, -1):
            if log.stage[i] != "forward" or log.frame[i] != frame or i == idx:
                continue
            shares = i in ins or bool(ins & {p for p in log.inprod[i] if p >= 0})
            fam = O.family_of(log.names[i]) is not None
            cands.append((not shares, not fam, idx - i, i))
        if not cands:
            return None
        cands.sort()
        return cands[0][3]
