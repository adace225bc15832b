"""The TensorFlow/Keras backend (Keras 3 on the TensorFlow backend).

Imports ``nanguard.core``, never torch nor ``nanguard.pytorch``. Nothing here is imported by
``import nanguard``: TensorFlow takes seconds to import, so only a script that uses it pays for it.

* :mod:`.detect`   the per-step check, built in-graph (``model.fit`` and ``tf.function`` steps)
                   or eagerly, and the host-side decision (one host read per step);
* :mod:`.watch`    the global hooks (``GradientTape.gradient``, ``Optimizer.apply``, outermost
                   ``Layer.__call__``, ``tf.function`` calls, ``LossScaleOptimizer.scale_loss``,
                   ``SeedGenerator.next``, ``Model.fit``) and the :class:`~.watch.TFWatcher`;
* :mod:`.capture`  the failing step handed to the op-level recorder (interface with ``locate``);
* :mod:`.replay`   in-process replay of a captured step and the re-run child for inline loops;
* :mod:`.recover`  recovery actions (snapshots, skip, rollback, lr backoff, clipping, float32 layer);
* :mod:`.callback` the Keras callback behind :class:`nanguard.keras.NanGuard`;
* :mod:`.run`      ``nanguard run`` for TensorFlow scripts.
"""
