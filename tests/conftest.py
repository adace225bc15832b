"""Fixtures for the whole suite, framework-free (tests/core imports neither torch nor TensorFlow); the
torch fixtures are in tests/torch/conftest.py, the TensorFlow ones in tests/tf/conftest.py. The shared
helpers (ngtest.py, tf_helpers.py, html_cases.py, ...) stay in tests/, on sys.path through
``pythonpath = ["tests"]`` in pyproject.toml, so ``import ngtest`` works from every subfolder."""
from __future__ import annotations

import sys

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` (pyproject.toml) with ``-n N``: tests marked ``xdist_group(NAME)`` run on one worker.
    pytest-xdist 3.8 tags them by renaming ``item._nodeid``, which pytest 9.2 no longer reads (the node id
    is ``item._id``): the tag is set through ``_id`` here where xdist's rename did not take."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(sorted(names))}")


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Default report/bundle paths are relative to the working directory: keep them in tmp."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _restore_argv_and_path():
    """A failing test must not leave sys.argv or sys.path changed behind it."""
    argv, path = list(sys.argv), list(sys.path)
    yield
    assert sys.argv == argv, "sys.argv not restored"
    assert sys.path == path, "sys.path not restored"
