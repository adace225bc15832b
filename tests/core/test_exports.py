"""The packages that export their names on first use (nanguard.core.exports.lazy_exports)."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = ["nanguard.core.diagnosis", "nanguard.core.experiments", "nanguard.core.recovery", "nanguard.core.locate"]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_resolves_and_is_listed(name):
    pkg = importlib.import_module(name)
    for n in pkg.__all__:
        assert getattr(pkg, n) is not None
        assert n in dir(pkg)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        getattr(pkg, "no_such_name")


def test_a_function_named_like_its_submodule_stays_the_function():
    # eagerly, ``from .investigate import investigate`` left the function in the package; lazily, the
    # import system sets the submodule there when it is first imported, which must not replace it
    code = ("import nanguard.core.experiments.investigate as mod, nanguard.core.experiments as pkg, types; "
            "from nanguard.core.experiments import investigate; "
            "print(callable(investigate), not isinstance(investigate, types.ModuleType), "
            "isinstance(__import__('sys').modules['nanguard.core.experiments.investigate'], types.ModuleType))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr[-2000:]


def test_importing_one_submodule_does_not_load_its_package():
    code = ("import sys, nanguard.core.experiments.config, nanguard.core.diagnosis.confidence; "
            "print(sorted(m for m in ('nanguard.core.experiments.investigate', 'nanguard.core.diagnosis.engine', "
            "'nanguard.core.diagnosis.rules', 'nanguard.core.recovery.policy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


def test_the_families_load_their_rules_at_the_first_lookup():
    code = ("import sys; from nanguard.core.diagnosis import families; "
            "a = 'nanguard.core.diagnosis.rules' in sys.modules; f = families.family_of('log'); "
            "print(a, f is not None and f.name, 'nanguard.core.diagnosis.rules' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[0] == "False" and out.stdout.split()[2] == "True", (out.stdout, out.stderr[-2000:])
    assert out.stdout.split()[1] not in ("False", ""), out.stdout
