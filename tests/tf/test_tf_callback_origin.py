"""Under the Keras callback (no `nanguard run`), an origin inside a built-in layer built before `fit` is
named by the line that constructed that layer (importing nanguard.keras records construction lines),
not by the `model.fit` line (issue 23); and the optimizer named in the diagnosis is the one of the
failing fit, not the first one the run saw."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
import nanguard.keras  # noqa: E402  (as a user's script imports it, before building the model)


def _lines(marker: str) -> int:
    import inspect
    src = inspect.getsource(test_origin_inside_a_builtin_layer_names_its_construction_line).splitlines()
    start = inspect.getsourcelines(test_origin_inside_a_builtin_layer_names_its_construction_line)[1]
    return start + next(i for i, ln in enumerate(src) if marker in ln)


def test_origin_inside_a_builtin_layer_names_its_construction_line():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = rng.normal(size=(96, 1)).astype("float32")
    x[40] = 3e38                                                     # finite, but its matmul overflows
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16),                       # FIRST-DENSE
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
    head = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    head.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    head.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)   # another optimizer, stepped before
    cb = nanguard.keras.NanGuard(report=None, quiet=True)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[cb])  # FIT-LINE
    ev = cb.report.events[0]
    o = ev.origin or {}
    assert ev.step == 1 and o.get("line") == _lines("FIRST-DENSE"), o
    assert o.get("line") != _lines("FIT-LINE") and o.get("line_source") == "constructor", o
    assert "Adam" not in ev.cause.get("summary", "") + " ".join(ev.fixes)   # the failing fit's SGD


def test_a_layer_called_by_keras_has_no_call_site_line():
    """Without a construction site, a layer that Keras itself called (fit's train step) has no user line
    that called it: the line is not known, rather than the `fit` line."""
    from nanguard.tensorflow.locate import naming
    users = naming.default_user_files()

    class _F:  # a frame as resolve sees it: the caller is Keras code
        def __init__(self, fn, back=None):
            self.f_code = type("C", (), {"co_filename": fn, "co_name": "f"})()
            self.f_lineno, self.f_back = 7, back
    trainer = keras.src.backend.tensorflow.trainer.__file__
    user = __file__
    comp = naming._Comp(object(), _F(naming.__file__, _F(trainer, _F(user))), "layer")
    assert naming._user_caller(comp, users) is None                 # fit's train step called the model
    comp = naming._Comp(object(), _F(naming.__file__, _F(user)), "layer")
    assert naming._user_caller(comp, users) == (user, 7, "f")       # the user's own model(x) call
