"""An eager replay of a traced step draws the numbers the traced step drew.

A ``tf.random.normal`` / ``uniform`` / ``truncated_normal`` inside a ``tf.function`` is a stateful op: its
kernel holds a Philox generator seeded from the op's ``seed``/``seed2`` attributes, and every run takes the
next ``numel x 256`` counter values. An eager replay of the step (the op-level recorder runs the step's
Python again, op by op) would draw other numbers, so a failure made by one draw (a sampled action whose
tanh rounds to 1, a noise batch) does not come back. The stateless V2 ops compute the same numbers from a
key and a counter: the draw of the k-th run is the stateless op with ``key = seed`` and ``counter =
(k x numel x 256, seed2)``, bit for bit (the kernels share ``FillPhiloxRandom``).

:class:`Draws` patches the generated wrappers the ``tf.random`` functions call, while a replay runs: the
i-th stateful random call of the replayed call is answered with the draw of the i-th such op of the traced
graph (the same type; ``k``: how many times the traced function ran before the step). Only ops at the top
level of the graph are matched (one run per call); a graph whose stateful random ops sit in control flow or
in called functions, or of another kind (gamma, multinomial), is not (the replay draws as before, and the
report says why it could not repeat the step).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

# every stateful random op type (a kernel with its own stream, which a new trace starts again)
STATEFUL_RANDOM = frozenset({"RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal",
                             "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial", "RandomShuffle",
                             "ParameterizedTruncatedNormal"})
# op type -> (the generated wrapper tf.random calls, the stateless V2 op that computes the same numbers)
_OPS = {"RandomStandardNormal": ("random_standard_normal", "StatelessRandomNormalV2"),
        "RandomUniform": ("random_uniform", "StatelessRandomUniformV2"),
        "TruncatedNormal": ("truncated_normal", "StatelessTruncatedNormalV2"),
        "RandomUniformInt": ("random_uniform_int", "StatelessRandomUniformIntV2")}
PHILOX = 1  # the stateless ops' algorithm id for Philox, the stateful kernels' generator
RESERVED = 256  # counter values a stateful kernel reserves per output element


def step_draws() -> List[Tuple[str, Any]]:
    """While a step is traced: ``(type, output)`` of the stateful random ops of the graph that holds them (the
    nearest graph out from the one being built, a ``tf.cond`` branch's), in creation order: what an in-graph
    capture hands to the host so that the eager replay draws the same numbers (:class:`Draws` ``fixed``)."""
    import tensorflow as tf
    g = tf.compat.v1.get_default_graph()
    while g is not None:
        found = [(op.type, op.outputs[0]) for op in g.get_operations() if op.type in _OPS]
        if found:
            return found
        g = getattr(g, "outer_graph", None)
    return []


def random_ops_of(concrete: Any) -> Optional[List[Tuple[str, int, int]]]:
    """``(type, seed, seed2)`` of the stateful random ops of ``concrete``'s graph, in creation order, or None when
    some cannot be matched to a replay's calls (in a called function or control flow, or of another kind)."""
    g = concrete.graph
    found = [(op.type, int(op.get_attr("seed")), int(op.get_attr("seed2")))
             for op in g.get_operations() if op.type in STATEFUL_RANDOM]
    if any(t not in _OPS for t, _, _ in found):
        return None
    if any(op.type in STATEFUL_RANDOM for sub in graphs_from(_called(g)) for op in sub.get_operations()):
        return None
    return found


def _called(g: Any) -> List[Any]:
    """The graphs of the functions ``g`` calls directly (a tf.cond's branches, a nested tf.function)."""
    return [f.graph for f in getattr(g, "_functions", {}).values() if getattr(f, "graph", None) is not None]


def graphs_from(roots: List[Any]) -> Iterator[Any]:
    """``roots`` and every graph of a function they call, at any depth, each once."""
    stack, seen = list(roots), set()
    while stack:
        g = stack.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        yield g
        stack += _called(g)


class Draws:
    """While installed, the stateful random calls of an eager replay of a traced call return the traced call's
    draws. ``current()``: the outermost call being replayed, ``(fn, args, kwargs, k)`` (``k``: the runs of
    ``fn`` before it), or None."""

    def __init__(self, current: Optional[Callable[[], Optional[tuple]]] = None,
                 fixed: Optional[List[Tuple[str, Any]]] = None) -> None:
        self.current = current
        self.fixed = fixed  # the failing step's own draws, handed over by its in-graph capture: (type, value)
        self.matched = 0          # draws answered from the traced graph
        self.unmatched: Optional[str] = None  # why a call was not (the replay then drew its own numbers)
        self._call: Any = None
        self._ops: Optional[List[Tuple[str, int, int]]] = None
        self._k, self._i = 0, 0
        self._cache: Dict[int, Optional[List[Tuple[str, int, int]]]] = {}
        self._undo: List[Callable[[], None]] = []

    def install(self) -> "Draws":
        from tensorflow.python.ops import gen_random_ops
        for typ, (wrapper, _) in _OPS.items():
            orig = getattr(gen_random_ops, wrapper)
            setattr(gen_random_ops, wrapper, self._patched(typ, orig))
            self._undo.append(lambda w=wrapper, o=orig: setattr(gen_random_ops, w, o))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _patched(self, typ: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = None
            try:
                out = self._draw(typ, args, kwargs)
            except Exception as e:  # never break the replay: it draws its own numbers
                self.unmatched = f"{type(e).__name__}: {e}"
            return orig(*args, **kwargs) if out is None else out
        return call

    def _draw(self, typ: str, args: tuple, kwargs: dict) -> Any:
        import tensorflow as tf
        if not tf.executing_eagerly():
            return None
        if self.fixed is not None:
            return self._handed(typ, args, kwargs)
        cur = self.current() if self.current is not None else None
        if cur is None:
            return None
        if cur is not self._call:  # a new replayed call: its draws start again from the first op
            self._call, self._i, self._k = cur, 0, int(cur[3])
            self._ops = self._graph_ops(cur)
        ops = self._ops
        if ops is None or self._i >= len(ops) or ops[self._i][0] != typ:
            self.unmatched = self.unmatched or f"the replay's random call {self._i + 1} ({typ}) has no traced op"
            return None
        _, seed, seed2 = ops[self._i]
        self._i += 1
        if seed == 0 and seed2 == 0:  # no seed at all: the kernel drew its own random seed
            self.unmatched = self.unmatched or "a random op without a seed (no tf.random.set_seed)"
            return None
        shape = tf.reshape(tf.cast(args[0] if args else kwargs["shape"], tf.int64), [-1])
        n = int(tf.reduce_prod(shape).numpy())
        key = tf.constant([seed], tf.uint64)
        counter = tf.constant([self._k * n * RESERVED, seed2], tf.uint64)
        raw = getattr(tf.raw_ops, _OPS[typ][1])
        if typ == "RandomUniformInt":
            lo, hi = (args[1], args[2]) if len(args) >= 3 else (kwargs["minval"], kwargs["maxval"])
            out = raw(shape=shape, key=key, counter=counter, alg=PHILOX, minval=lo, maxval=hi)
        else:
            dtype = args[1] if len(args) >= 2 else kwargs["dtype"]
            out = raw(shape=shape, key=key, counter=counter, alg=PHILOX, dtype=dtype)
        self.matched += 1
        return out

    def _handed(self, typ: str, args: tuple, kwargs: dict) -> Any:
        """The i-th draw the captured step handed over, when its type and shape are this call's."""
        import numpy as np
        import tensorflow as tf
        fixed = self.fixed or []
        if self._i >= len(fixed) or fixed[self._i][0] != typ:
            self.unmatched = self.unmatched or f"the replay's random call {self._i + 1} ({typ}) was not handed over"
            return None
        value = np.asarray(fixed[self._i][1])
        shape = [int(d) for d in np.reshape(np.asarray(args[0] if args else kwargs["shape"]), [-1])]
        if list(value.shape) != shape:
            self.unmatched = self.unmatched or f"the replay's random call {self._i + 1} has another shape"
            return None
        self._i += 1
        self.matched += 1
        return tf.constant(value)

    def _graph_ops(self, cur: tuple) -> Optional[List[Tuple[str, int, int]]]:
        fn = cur[0]
        key = id(fn)
        if key not in self._cache and getattr(fn, "_jit_compile", None):
            self._cache[key] = None  # XLA compiles the random ops to generators of its own: other numbers
        if key not in self._cache:
            try:
                # a function that creates variables at its first call is traced twice, with the same ops; traces
                # that differ (other argument shapes): which one ran each call is not known
                found = [random_ops_of(c) for c in fn._list_all_concrete_functions()]
                self._cache[key] = found[0] if found and all(f == found[0] for f in found) else None
            except Exception:
                self._cache[key] = None
        if self._cache[key] is None:
            self.unmatched = self.unmatched or "the traced function's random ops could not be matched"
        return self._cache[key]
