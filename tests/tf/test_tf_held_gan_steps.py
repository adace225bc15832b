"""A GAN's ``train_step`` (a critic update, then a generator update) under ``model.fit`` and recovery: the
batch is the unit. A NaN row in batch 2 fails its critic update (step 4); the generator's update of that
batch (step 5) is held in-graph behind it (whichever optimizer makes it), and the recovery acts on the whole
``train_step``: ``drop_samples`` re-runs it without the bad row, both updates applied; ``skip_step`` skips
both. With ``steps_per_execution=2`` batch 3 (steps 6 and 7, in the same graph call) is held too and re-run
whole after the recovery. So each optimizer makes one update per batch that trained, whatever the call
size. On the old code the generator's update of the failing batch ran on (its critic's skipped: one
update too many for the generator), the drop re-run was refused for making two updates (the batch was
skipped, its bad row not dropped), and with two batches per call the held batch's generator update ran
in-graph while its critic's was re-run alone."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
from test_tf_step_numbering import _Gan  # noqa: E402  (critic then generator, two Adam optimizers)
import nanguard.keras  # noqa: E402

BAD_ROW = 2 * 8 + 3   # batch 2 of 8 rows, unshuffled


def _fit(spe: int, recover: str = "auto"):
    keras.utils.set_random_seed(0)
    real = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
    real[BAD_ROW, 1] = np.nan
    model = _Gan((None, -1))
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    model.steps_per_execution = spe
    cb = nanguard.keras.NanGuard(report=None, quiet=True, recover=recover)
    model.fit(real, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return model, cb.report


def _counts(model):
    return [int(model.d_opt.iterations.numpy()), int(model.g_opt.iterations.numpy())]


@pytest.mark.parametrize("spe", [1, 2])
def test_a_failing_gan_batch_is_dropped_whole(spe):
    model, rep = _fit(spe)
    events = [(e.step, e.cause["category"], (e.recovery or {}).get("action")) for e in rep.events]
    assert events == [(4, "bad_input_data", "drop_samples")], events   # old code: skip_step (spe 2: + 'other')
    assert rep.events[0].recovery["actions"]["drop_samples"]["rows"] == [3]
    assert rep.status == "recovered"
    assert _counts(model) == [6, 6]   # old code: [5, 6] (the generator's update of the failing batch ran)
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


def test_a_skipped_gan_batch_skips_its_generator_update_too():
    model, rep = _fit(1, recover="skip_step")
    assert [(e.step, (e.recovery or {}).get("action")) for e in rep.events] == [(4, "skip_step")]
    assert _counts(model) == [5, 5], _counts(model)   # old code: [5, 6]
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
