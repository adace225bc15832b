"""Fixtures for the whole suite, framework-free (tests/core imports neither torch nor TensorFlow); the
torch fixtures are in tests/torch/conftest.py, the TensorFlow ones in tests/tf/conftest.py. The shared
helpers (ngtest.py, tf_helpers.py, html_cases.py, ...) stay in tests/, on sys.path through
``pythonpath = ["tests"]`` in pyproject.toml, so ``import ngtest`` works from every subfolder."""
from __future__ import annotations

import sys

import pytest


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
