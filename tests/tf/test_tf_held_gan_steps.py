"""A GAN's ``train_step`` (a critic update, then a generator update) under ``model.fit`` with
``steps_per_execution=2`` and recovery: a NaN row in batch 2 fails its critic update (step 4), batch 3
(steps 6 and 7, in the same graph call) is held behind it and re-run after the recovery. The held re-run
is a whole ``train_step`` of which only the held optimizer's update (the critic's: the failure halted
its updates) is applied; the generator's update of batch 3 was not halted and ran in-graph. So each
optimizer makes as many updates as with one batch per call. On the old code the re-run was refused for
making two updates (one was required), and the healthy batch 3 became a failure of its own ('other',
skipped); applying both re-run updates would give the generator one update too many."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
from test_tf_step_numbering import _Gan  # noqa: E402  (critic then generator, two Adam optimizers)
import nanguard.keras  # noqa: E402

BAD_ROW = 2 * 8 + 3   # batch 2 of 8 rows, unshuffled


def _fit(spe: int):
    keras.utils.set_random_seed(0)
    real = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
    real[BAD_ROW, 1] = np.nan
    model = _Gan((None, -1))
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    model.steps_per_execution = spe
    cb = nanguard.keras.NanGuard(report=None, quiet=True, recover="auto")
    model.fit(real, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return model, cb.report


def test_a_held_gan_batch_reruns_both_updates():
    ref, ref_rep = _fit(1)
    model, rep = _fit(2)
    assert [(e.step, (e.recovery or {}).get("action")) for e in ref_rep.events] == [(4, "skip_step")]
    events = [(e.step, e.cause["category"], (e.recovery or {}).get("action")) for e in rep.events]
    assert events == [(4, "bad_input_data", "skip_step")], events      # old code: + (6, 'other', skip_step)
    assert rep.status == "recovered"
    # as many updates as one batch per call: batch 3's critic update re-applied, the generator's not twice
    counts = [(int(o.iterations.numpy()), int(o_ref.iterations.numpy()))
              for o_ref, o in ((ref.d_opt, model.d_opt), (ref.g_opt, model.g_opt))]
    assert counts == [(5, 5), (6, 6)], counts
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
