"""`nanguard lint --fix`: the exactly safe rewrites (log(softmax) -> log_softmax, BCELoss on a sigmoid ->
BCEWithLogitsLoss on the logits), the exact resulting text, idempotence, and nothing else rewritten."""
from __future__ import annotations

import ast

import pytest

from nanguard.cli.main import main
from nanguard.lint.engine import lint_source
from nanguard.lint.fix import apply_fixes

pytest.importorskip("libcst")

BEFORE = '''import torch
import torch.nn as nn
import torch.nn.functional as F
import tensorflow as tf


def losses(x, y, z, t):
    a = torch.log(F.softmax(x, dim=-1))   # keep this comment
    b = x.softmax(-1).log()
    c = torch.log(torch.softmax(x, 1))
    d = nn.BCELoss(reduction="sum")(torch.sigmoid(z), t)
    e = F.binary_cross_entropy(z.sigmoid(), t, weight=None)
    p = F.softmax(x, -1)
    f = torch.log(p)                      # through a name: reported, not rewritten
    g = tf.math.log(tf.nn.softmax(x))
    return a, b, c, d, e, f, g
'''

AFTER = '''import torch
import torch.nn as nn
import torch.nn.functional as F
import tensorflow as tf


def losses(x, y, z, t):
    a = F.log_softmax(x, dim=-1)   # keep this comment
    b = x.log_softmax(-1)
    c = torch.log_softmax(x, 1)
    d = nn.BCEWithLogitsLoss(reduction="sum")(z, t)
    e = F.binary_cross_entropy_with_logits(z, t, weight=None)
    p = F.softmax(x, -1)
    f = torch.log(p)                      # through a name: reported, not rewritten
    g = tf.nn.log_softmax(x)
    return a, b, c, d, e, f, g
'''


def test_fix_rewrites_exactly_the_safe_patterns():
    findings = lint_source(BEFORE, "m.py")
    fixable = sorted((f.rule, f.line) for f in findings if f.fixable)
    assert fixable == sorted([("NGL001", 8), ("NGL001", 9), ("NGL001", 10), ("NGL002", 11), ("NGL002", 12),
                              ("NGL001", 15)])
    out, n = apply_fixes(BEFORE, findings)
    assert out == AFTER and n == 6
    ast.parse(out)
    again = lint_source(out, "m.py")
    assert [f.rule for f in again] == ["NGL001"] and not again[0].fixable   # only the log through a name is left
    assert apply_fixes(out, again) == (out, 0)                               # idempotent


def test_fix_leaves_a_module_bound_elsewhere_alone():
    src = ("import torch\nimport torch.nn as nn\n\n\ndef f(z, t):\n    crit = nn.BCELoss()\n"
           "    return crit(torch.sigmoid(z), t)\n")
    findings = lint_source(src, "m.py")
    assert [f.rule for f in findings] == ["NGL002"] and not findings[0].fixable
    assert apply_fixes(src, findings) == (src, 0)


def test_cli_fix_writes_the_file_and_exits_with_what_is_left(tmp_path, capsys):
    f = tmp_path / "m.py"
    f.write_text(BEFORE)
    rc = main(["lint", "--fix", str(f)])
    out, err = capsys.readouterr()
    assert f.read_text() == AFTER
    assert rc == 1 and "fixed 6 finding(s)" in err and out.count("NGL001") == 1
    rc = main(["lint", "--fix", str(f)])
    capsys.readouterr()
    assert f.read_text() == AFTER and rc == 1
