"""The callback's per-batch cost at Keras' side (issue 23): ``NanGuard`` overrides no batch hook, so Keras 3
keeps its batch-end dispatch asynchronous (``CallbackList`` turns it off, and converts every batch's logs on
the training thread, as soon as one callback overrides ``on_train_batch_end`` or ``on_batch_end``), and the
per-step host work is one stash read by a single ``ReadVariableOp``."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import nanguard.keras as nk  # noqa: E402


def test_the_callback_overrides_no_batch_hook_and_keeps_async_dispatch():
    from keras.src import backend
    from keras.src.utils import is_default
    cb = nk.NanGuard(report=None, quiet=True)
    for hook in ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end",
                 "on_test_batch_end", "on_predict_batch_end"):
        assert is_default(getattr(cb, hook)), hook
    if backend.IS_THREAD_SAFE:
        assert keras.callbacks.CallbackList([cb])._async_train is True


def test_the_stash_read_is_a_copy_of_the_variable():
    from nanguard.tensorflow.host import read_host
    v = tf.Variable(np.arange(6.0).reshape(2, 3))
    a = read_host(v)
    np.testing.assert_array_equal(a, v.numpy())
    a[0, 0] = 99.0                      # the host copy never writes through to the variable
    assert v.numpy()[0, 0] == 0.0
