"""The check's ``tf.cond``s stay functional ``If`` ops in the traced step (issue 23, the callback's cost):
lowered, each became a Switch per captured input (the update's cond captures every gradient and variable)
and its branches' ops inline, all scheduled every step; the transformer of ``benchmarks.tf_overhead`` ran
x1.19 so against x0.97 unlowered (quick runs). The update's own cond is the exception: lowered, it is optimized
with the step as the plain update is (bit-for-bit)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import nanguard.keras as nk  # noqa: E402


def _ifs(model):
    """(lowered, functional) If ops of the traced train step and the functions it calls."""
    cells = [c.cell_contents for c in model.train_function.__closure__ or () if c.cell_contents is not None]
    cfs = [cf for f in cells if hasattr(f, "_list_all_concrete_functions") for cf in f._list_all_concrete_functions()]
    assert cfs
    stack, seen, low, kept = [cf.graph for cf in cfs], set(), 0, 0
    while stack:
        g = stack.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        for op in g.get_operations():
            if op.type in ("If", "StatelessIf"):
                try:
                    lowered = op.get_attr("_lower_using_switch_merge")
                except ValueError:
                    lowered = False
                low, kept = low + bool(lowered), kept + (not lowered)
        stack += [f.graph for f in getattr(g, "_functions", {}).values() if getattr(f, "graph", None) is not None]
    return low, kept


class _Probe(keras.callbacks.Callback):
    """Reads the traced step at the epoch's end (the guard puts the model's train function back at the
    end of ``fit``)."""

    def on_epoch_end(self, epoch, logs=None):
        self.ifs = _ifs(self.model)


def _fit(callbacks):
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    probe = _Probe()
    model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=1, verbose=0, callbacks=callbacks + [probe])
    return probe.ifs


def test_the_checks_conds_stay_if_ops_and_the_update_is_lowered_as_in_a_plain_fit():
    # the check before the update and the check after it stay If ops; the update's cond is lowered: as an If,
    # its branch was optimized on its own and the update differed from the plain one in the last bits
    # (tests/tf/test_tf_guard.py: mixed precision, bit-for-bit)
    low, kept = _fit([nk.NanGuard(report=None, quiet=True)])
    assert (low, kept) == (1, 2)
