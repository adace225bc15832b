"""Issue 24 (9): a repro bundle is checked whole before anything is loaded: whatever the file holds,
``load_bundle`` / ``Bundle.load_into`` end in a :class:`BundleError` or a complete load, and a bundle
that does not fit leaves the model, the optimizer, the scaler and the RNG exactly as they were.
Property-based (hypothesis): arbitrary bytes, and crafted bundles that are valid zip/pickle files."""
from __future__ import annotations

import copy
import os
import random
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from nanguard import BundleError, load_bundle
from nanguard.pytorch.bundle import FORMAT, save_bundle

PROPS = settings(max_examples=30, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


def _setup():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(5, 3)).sum().backward()
    opt.step()  # the optimizer has state
    return m, opt


def _snapshot(m, opt):
    return ({k: v.clone() for k, v in m.state_dict().items()}, copy.deepcopy(opt.state_dict()),
            torch.get_rng_state().clone(), random.getstate())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _good(m, opt) -> dict:
    return {"format": FORMAT, "step": 3, "phase": "forward", "batch": [torch.randn(2, 3)],
            "model_state": {k: v.clone() + 1 for k, v in m.state_dict().items()},
            "optimizer_states": [copy.deepcopy(opt.state_dict())], "scaler_state": None,
            "rng": {"torch": torch.get_rng_state()}, "config": {}, "versions": {}, "event": {}}


def _load_into_untouched_on_error(d: dict, **kw) -> bool:
    """Save ``d`` as a bundle, load it into a fresh model/optimizer; True when it loaded. A BundleError must
    leave everything as it was; any other exception fails the test."""
    m, opt = _setup()
    before = _snapshot(m, opt)
    fd, path = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    try:
        torch.save(d, path)
        try:
            b = load_bundle(path)
            b.load_into(m, opt, **kw)
            return True
        except BundleError as e:
            assert str(e) and "\n" not in str(e)
            after = _snapshot(m, opt)
            assert _same(before[0], after[0]), "the model was changed by a bundle that failed to load"
            assert _same(before[1], after[1]), "the optimizer was changed by a bundle that failed to load"
            assert torch.equal(before[2], after[2]) and before[3] == after[3], "the RNG was changed"
            return False
    finally:
        os.unlink(path)


# --------------------------------------------------------------------------- the defect

@pytest.mark.parametrize("bad", ["optimizer_groups", "optimizer_hyper", "optimizer_state_key", "rng_size",
                                 "python_rng", "model_dtype", "model_shape"])
def test_a_bundle_that_does_not_fit_leaves_the_model_untouched(bad):
    m, opt = _setup()
    d = _good(m, opt)
    if bad == "optimizer_groups":
        d["optimizer_states"][0]["param_groups"].append(dict(d["optimizer_states"][0]["param_groups"][0]))
    elif bad == "optimizer_hyper":
        d["optimizer_states"][0]["param_groups"][0]["lr"] = "fast"
    elif bad == "optimizer_state_key":
        d["optimizer_states"][0]["state"][99] = {"step": torch.tensor(1.0)}
    elif bad == "rng_size":
        d["rng"]["torch"] = torch.zeros(10, dtype=torch.uint8)
    elif bad == "python_rng":
        d["rng"]["random"] = [3, [1, 2, 3], None]
    elif bad == "model_dtype":
        d["model_state"]["0.weight"] = d["model_state"]["0.weight"].double()
    else:
        d["model_state"]["2.bias"] = torch.zeros(7)
    assert _load_into_untouched_on_error(d) is False


def test_a_good_bundle_still_loads_everything():
    m, opt = _setup()
    d = _good(m, opt)
    assert _load_into_untouched_on_error(d) is True


# --------------------------------------------------------------------------- properties

@PROPS
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_are_a_bundle_error(data):
    fd, path = tempfile.mkstemp(suffix=".pt")
    try:
        os.write(fd, data)
        os.close(fd)
        with pytest.raises(BundleError):
            load_bundle(path)
    finally:
        os.unlink(path)


@PROPS
@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0, max_value=10_000))
def test_a_corrupted_good_bundle_is_a_bundle_error_or_a_load(patch, at):
    m, opt = _setup()
    fd, path = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    try:
        torch.save(_good(m, opt), path)
        raw = bytearray(open(path, "rb").read())
        at = at % len(raw)
        raw[at:at + len(patch)] = patch
        open(path, "wb").write(bytes(raw))
        try:
            load_bundle(path)
        except BundleError:
            pass
    finally:
        os.unlink(path)


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                     st.text(max_size=8))
_TENSORS = st.builds(lambda shape, dt: torch.zeros(shape, dtype=dt),
                     st.lists(st.integers(0, 5), max_size=3).map(tuple),
                     st.sampled_from([torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool,
                                      torch.complex64]))
_VALUES = st.recursive(st.one_of(_SCALARS, _TENSORS),
                       lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(st.one_of(st.text(max_size=6), st.integers(0, 9)),
                                                               inner, max_size=3)),
                       max_leaves=8)

# (where, how): the part of a good bundle a crafted one replaces
_PARTS = ["model_key", "model_value", "opt_state", "opt_group_key", "opt_param_state", "opt_whole", "rng_torch",
          "rng_random", "rng_numpy", "rng_cuda", "scaler"]


@PROPS
@given(st.sampled_from(_PARTS), _VALUES, st.booleans(),
       st.sampled_from(["lr", "betas", "eps", "amsgrad", "params", "weight_decay"]))
@example(part="rng_numpy", value=None, use_rng=True, key="lr")  # passed the check, then failed in set_state
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_a_crafted_bundle_loads_whole_or_leaves_everything_untouched(part, value, use_rng, key):
    m, opt = _setup()
    d = _good(m, opt)
    o = d["optimizer_states"][0]
    if part == "model_key":
        d["model_state"]["extra." + str(value)[:10]] = torch.zeros(1)
    elif part == "model_value":
        d["model_state"]["1.running_mean"] = value
    elif part == "opt_state":
        o["state"] = value
    elif part == "opt_group_key":
        o["param_groups"][0][key] = value
    elif part == "opt_param_state":
        o["state"][0] = value
    elif part == "opt_whole":
        d["optimizer_states"] = [value]
    elif part.startswith("rng_"):
        d["rng"][part[4:]] = value
    else:
        d["scaler_state"] = value
    scaler = torch.amp.GradScaler("cpu", enabled=True) if part == "scaler" else None
    try:
        _load_into_untouched_on_error(d, rng=use_rng, scaler=scaler)
    except BundleError:
        pass
