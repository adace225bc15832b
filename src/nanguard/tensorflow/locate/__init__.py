"""Stage 2 for TensorFlow/Keras: find where the first non-finite value of one training step is born.

Instrumentation
---------------
The failing step is replayed **eagerly, op by op** (``tf.config.run_functions_eagerly(True)`` while
armed: a ``@tf.function`` step or Keras' ``train_function`` runs its Python body) under TensorFlow's
op callback (``tensorflow.python.framework.op_callbacks``), which sees every executed op with its
input and output tensors, forward, backward (the tape's gradient functions run eager ops too) and
the optimizer's update. See :mod:`.recorder` for provenance, :mod:`.naming` for layer/line names,
:mod:`.evidence` for the facts, :mod:`.ops` for the TF op type -> canonical name table.

Why this one (measured on a 2-core CPU, TF 2.21 / Keras 3.15): on the bag-of-items model of
``bag_mean_div_zero_tape`` the eager replay of a ``tf.function`` step (232 ops with Adam) takes
0.1-0.26 s including the variable snapshot/restore; tracing the step into a FuncGraph and fetching
every intermediate (option a) ~1.0 s (0.7 s trace + 0.3 s first run) and it cannot see inside nested
functions; tfdbg's FULL_TENSOR dump (option b) ~1.8 s plus ~0.12 s to read the files back. Per op,
the recorded eager step costs ~0.4-0.5 ms more than the plain eager one (MLP, 159 ops: 51 -> 110 ms;
2-layer transformer, 1637 ops: 0.45 -> 1.3 s): ~0.14 ms is the recorder, the rest is the slow
Python path TF takes for every op while an op callback is installed. Only the failing step pays it.

Fidelity: every option evaluates ops unfused (fetching every intermediate disables grappler's
fusions too). In graph mode grappler may hide or remove a non-finite value that the eager replay
shows: the fused MatMul+BiasAdd+Relu kernel maps NaN to 0, and the arithmetic optimizer rewrites
``log(softmax(x) + 0)`` into ``LogSoftmax`` (finite). So the replay is at least as non-finite as the
script; its origin is the op that made the first non-finite value either way, but its sink can
differ (the fused graph's loss can stay finite while its gradients are not). Not replayed exactly:
XLA-compiled functions (run without XLA), replica threads of a distribution strategy (op callbacks
are per thread: only the calling thread is recorded), and second-order gradients (a tape inside a
tape: backward ops are mapped to forward ops by type and tensors, heuristically).

Contract with part A (``nanguard.tensorflow.capture``)
-------------------------------------------------------
``make_recorder(capture) -> TFRecorder`` (the ``Recorder`` protocol of ``capture.py``):

* built from ``capture.model`` / ``capture.models`` / ``capture.optimizer`` / ``capture.variables``
  (``{path: variable}``: names for the variables, and whether each is a parameter, a non-trainable
  "buffer" or optimizer state);
* ``start()`` arms (op callback, gradient-function wrapper, ``Layer.__call__``/``Loss.__call__``
  tracking, ``run_functions_eagerly(True)``; all undone by ``stop()``), ``set_stage(stage)``,
  ``mark_loss(tensor)`` (``GradientTape.gradient``'s target), ``mark_grads(grads, sources)`` (what it
  returned), ``stop()``, ``result() -> dict``;
* ``apply_update`` is True: the watcher runs the optimizer's update during the replay so that an
  optimizer-phase failure has its ops recorded (``capture.run`` restores the variables after);
* the recorder installs no tape/optimizer hooks of its own there (``hooks=False``): the watcher's
  replay hooks call ``set_stage`` / ``mark_loss`` / ``mark_grads``.

``result()`` has the shape of ``nanguard.pytorch.locate.OpRecorder.result()``: ``reproduced``,
``phase`` (``forward``/``backward``/``optimizer``/``data``/``params``), ``sink`` ({kind: loss | grad |
optimizer, names}), ``origin`` ({op (canonical: ``div``), tf_op (``RealDiv``), api, layer (Keras layer
name), module (layer path, "" for the model itself), module_type, layer_stack, file, line, function,
line_source (``op`` | ``constructor`` | ``constructor_scan`` | ``call_site`` | ``not_known``), dtype, shape, stage,
inputs (stats), output (counts), samples (batch rows), scalars; for a backward origin also
autograd_node (``LogGrad``), backward_op, forward_op / forward_tf_op and the forward op's layer and
line in file/line}), ``facts``, ``preexisting`` ({kind: data | param | buffer | optimizer_state, name:
the variable's ``.path``, samples, source_rows, stats, first_use}), ``optimizer``, ``n_ops``,
``notes``, ``backend: "tensorflow"``. The shape, the sink choice and the taint rules are the ones
``nanguard.core.locate`` holds for both backends.

Re-run child (``nanguard run`` on a script whose step is inline code): construct the recorder the
same way (``make_recorder(capture)`` with ``kind="rerun"``, or ``TFRecorder(model=..., optimizer=...)``),
``start()`` when the failing step begins (before its forward), ``stop()`` after its update.

Layer construction lines: :func:`install_construction_hook` must run before the model is built
(the watcher's install, before the script's first line) for ops inside built-in layers/losses to be
named by the line that constructed them; it is cheap (one frame walk per layer construction).

Standalone use (tests, the explicit API): :func:`localize` replays a step callable in-process with
the recorder's own hooks and restores every variable afterwards.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .naming import construction_hook_installed, construction_site, install_construction_hook

if TYPE_CHECKING:
    from .recorder import TFRecorder

__all__ = ["TFRecorder", "make_recorder", "localize", "install_construction_hook", "construction_site",
           "construction_hook_installed"]


def __getattr__(name: str) -> Any:
    """``TFRecorder`` on first use: a healthy run installs the construction hook (``.naming``) and never
    loads the recorder and its op hooks (start-up)."""
    if name == "TFRecorder":
        from .recorder import TFRecorder
        return TFRecorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_recorder(capture: Any) -> TFRecorder:
    """The recorder for a :class:`nanguard.tensorflow.capture.StepCapture` (see the module doc)."""
    from .recorder import TFRecorder
    models = list(getattr(capture, "models", None) or [])
    return TFRecorder(model=getattr(capture, "model", None), models=models,
                      optimizer=getattr(capture, "optimizer", None),
                      variables=getattr(capture, "variables", None), hooks=False, apply_update=True)


def _all_variables(model: Any, models: Sequence[Any], optimizer: Any, variables: Any) -> list:
    out, seen = [], set()

    def add(v: Any) -> None:
        if v is not None and id(v) not in seen and hasattr(v, "assign"):
            seen.add(id(v))
            out.append(v)
    for m in ([model] if model is not None else []) + list(models or ()):
        for v in list(getattr(m, "variables", []) or []) + list(getattr(m, "metrics_variables", []) or []):
            add(v)
    o = optimizer
    while o is not None:
        for v in getattr(o, "variables", []) or []:
            add(v)
        o = getattr(o, "inner_optimizer", None)
    vs = variables.values() if isinstance(variables, dict) else (variables or [])
    for v in vs:
        add(v)
    return out


def localize(step: Callable[..., Any], *args: Any, model: Any = None, models: Sequence[Any] = (),
             optimizer: Any = None, variables: Any = None, apply_update: bool = True, restore: bool = True,
             **kwargs: Any) -> dict:
    """Replay ``step(*args, **kwargs)`` (one training step: forward, loss, ``GradientTape.gradient``,
    optionally the optimizer's update; a plain function or a ``tf.function``) eagerly under the op
    recorder and return the localization dict. Every variable of ``model``/``optimizer``/``variables``
    is restored afterwards (``restore``), so the replay leaves training state as it found it."""
    t0 = time.time()
    vs = _all_variables(model, models, optimizer, variables) if restore else []
    saved = [(v, v.numpy()) for v in vs]
    from .recorder import TFRecorder
    rec = TFRecorder(model=model, models=models, optimizer=optimizer, variables=variables, hooks=True,
                     apply_update=apply_update)
    error = None
    rec.start()
    try:
        step(*args, **kwargs)
    except Exception as e:  # the failing step may raise (e.g. a check in the user's code)
        error = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        rec.stop()
        for v, val in saved:
            try:
                v.assign(val)
            except Exception:
                pass
    res = rec.result()
    if error:
        res.setdefault("notes", []).append(f"the replayed step raised {error}")
    res["seconds"] = round(time.time() - t0, 3)
    return res
