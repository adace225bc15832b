"""`nanguard lint` as a command: exit statuses, output formats (text, JSON, SARIF 2.1.0), suppression
comments, --select/--ignore, [tool.nanguard.lint] in pyproject.toml, syntax errors, the flake8 plugin and
the pre-commit hook definition."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanguard.cli.main import main
from nanguard.lint.registry import rules

ROOT = Path(__file__).resolve().parents[2]
BAD = """import torch
import torch.nn.functional as F


def nll(logits, y):
    probs = F.softmax(logits, dim=-1)
    return -torch.log(probs)


def norm(adv):
    return (adv - adv.mean()) / adv.std()
"""
GOOD = """import torch.nn.functional as F


def nll(logits, y):
    return F.cross_entropy(logits, y)
"""


def run(capsys, *argv):
    rc = main(["lint", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bad.py").write_text(BAD)
    (tmp_path / "pkg" / "good.py").write_text(GOOD)
    return tmp_path


def test_exit_status_clean_findings_and_text_format(tree, capsys):
    assert run(capsys, str(tree / "pkg" / "good.py"))[0] == 0
    rc, out, _ = run(capsys, str(tree / "pkg"))
    assert rc == 1
    lines = out.splitlines()
    assert lines[0] == (f"{tree / 'pkg' / 'bad.py'}:7:13: NGL001 log_domain log of a softmax output without eps or "
                        "clamp: it is -inf where the softmax rounds to 0; use log_softmax")
    assert lines[1].startswith(f"{tree / 'pkg' / 'bad.py'}:11:12: NGL006 variance_zero ")
    assert lines[-1] == "2 finding(s)"


def test_usage_errors_exit_2(tree, capsys):
    assert run(capsys, str(tree / "missing.py"))[0] == 2
    assert run(capsys, "--format", "xml", str(tree / "pkg"))[0] == 2
    assert run(capsys, "--select", "NGL999", str(tree / "pkg"))[0] == 2
    (tree / "pyproject.toml").write_text("[tool.nanguard.lint\nselect = [")
    rc, _, err = run(capsys, str(tree / "pkg"))
    assert rc == 2 and "pyproject.toml" in err
    (tree / "pyproject.toml").write_text("[tool.nanguard.lint]\nselct = ['NGL001']\n")
    rc, _, err = run(capsys, str(tree / "pkg"))
    assert rc == 2 and "selct" in err
    (tree / "pyproject.toml").write_text("[tool.nanguard.lint]\nselect = ['NGL001']\n")
    assert run(capsys)[0] == 2  # no PATH and no configured paths


def test_json_format(tree, capsys):
    rc, out, _ = run(capsys, "--format", "json", str(tree / "pkg"))
    data = json.loads(out)
    assert rc == 1 and [d["rule"] for d in data] == ["NGL001", "NGL006"]
    for d in data:
        assert {"path", "line", "col", "rule", "category", "message"} <= set(d)
        assert isinstance(d["line"], int) and isinstance(d["col"], int) and d["fixes"]
    assert data[0]["category"] == "log_domain" and data[1]["category"] == "variance_zero"


def test_sarif_format_has_the_required_fields(tree, capsys):
    rc, out, _ = run(capsys, "--format", "sarif", str(tree / "pkg"))
    log = json.loads(out)
    assert rc == 1 and log["version"] == "2.1.0" and "sarif" in log["$schema"]
    (r,) = log["runs"]
    driver = r["tool"]["driver"]
    assert driver["name"] and [d["id"] for d in driver["rules"]] == [x.code for x in rules()]
    assert len(r["results"]) == 2
    for res in r["results"]:
        assert res["ruleId"].startswith("NGL") and res["message"]["text"] and res["level"] == "warning"
        assert driver["rules"][res["ruleIndex"]]["id"] == res["ruleId"]
        loc = res["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"]["uri"].endswith("pkg/bad.py")
        assert loc["region"]["startLine"] >= 1 and loc["region"]["startColumn"] >= 1


def test_suppression_comments(tmp_path, capsys):
    f = tmp_path / "m.py"
    f.write_text(BAD.replace("-torch.log(probs)", "-torch.log(probs)  # nanguard: ignore[NGL001]"))
    rc, out, _ = run(capsys, "--format", "json", str(f))
    assert [d["rule"] for d in json.loads(out)] == ["NGL006"]
    f.write_text(BAD.replace("-torch.log(probs)", "-torch.log(probs)  # nanguard: ignore[NGL006]")
                 .replace("/ adv.std()", "/ adv.std()  # nanguard: ignore"))
    rc, out, _ = run(capsys, "--format", "json", str(f))
    assert [d["rule"] for d in json.loads(out)] == ["NGL001"]


def test_select_and_ignore(tree, capsys):
    rc, out, _ = run(capsys, "--format", "json", "--select", "NGL006", str(tree / "pkg"))
    assert [d["rule"] for d in json.loads(out)] == ["NGL006"]
    rc, out, _ = run(capsys, "--format", "json", "--ignore", "NGL001,NGL006", str(tree / "pkg"))
    assert rc == 0 and json.loads(out) == []


def test_pyproject_config(tree, capsys, monkeypatch):
    (tree / "pyproject.toml").write_text('[tool.nanguard.lint]\npaths = ["pkg"]\nignore = ["NGL006"]\n')
    (tree / "pkg" / "vendored").mkdir()
    (tree / "pkg" / "vendored" / "x.py").write_text(BAD)
    monkeypatch.chdir(tree)
    rc, out, _ = run(capsys, "--format", "json")
    assert sorted({(Path(d["path"]).name, d["rule"]) for d in json.loads(out)}) == [("bad.py", "NGL001"),
                                                                                     ("x.py", "NGL001")]
    (tree / "pyproject.toml").write_text('[tool.nanguard.lint]\npaths = ["pkg"]\nexclude = ["vendored"]\n'
                                         'select = ["NGL00"]\n')
    rc, out, _ = run(capsys, "--format", "json")
    assert [(Path(d["path"]).name, d["rule"]) for d in json.loads(out)] == [("bad.py", "NGL001"), ("bad.py", "NGL006")]
    rc, out, _ = run(capsys, "--format", "json", "--no-config", "pkg/good.py")
    assert rc == 0


def test_a_syntax_error_is_one_line_and_the_rest_is_checked(tree, capsys):
    (tree / "pkg" / "broken.py").write_text("def f(:\n    pass\n")
    rc, out, _ = run(capsys, str(tree / "pkg"))
    assert rc == 1
    errors = [ln for ln in out.splitlines() if "syntax error" in ln]
    assert len(errors) == 1 and errors[0].startswith(str(tree / "pkg" / "broken.py") + ":1:")
    assert "NGL001" in out
    alone = tree / "alone"
    alone.mkdir()
    (alone / "broken.py").write_text("def f(:\n    pass\n")
    (alone / "good.py").write_text(GOOD)
    rc, out, _ = run(capsys, str(alone))
    assert rc == 1 and len(out.strip().splitlines()) == 1  # not clean: a file could not be checked


def test_lint_help_and_run_import_no_framework(tree):
    code = ("import sys\nfrom nanguard.cli.main import main\n"
            "try:\n    main(['lint', '--help'])\nexcept SystemExit:\n    pass\n"
            f"main(['lint', {str(tree / 'pkg')!r}])\n"
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout + p.stderr
    assert "--fix" in p.stdout


def test_flake8_plugin_runs_the_same_rules(tree):
    pytest.importorskip("flake8")
    p = subprocess.run([sys.executable, "-m", "flake8", "--select", "NGL", str(tree / "pkg")],
                       capture_output=True, text=True, timeout=120, cwd=tree)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = sorted(p.stdout.splitlines())
    assert lines == [f"{tree / 'pkg' / 'bad.py'}:11:12: NGL006 division by a standard deviation without eps: a "
                     "constant input gives x/0; add an eps (std + 1e-5) (variance_zero)",
                     f"{tree / 'pkg' / 'bad.py'}:7:13: NGL001 log of a softmax output without eps or clamp: it is "
                     "-inf where the softmax rounds to 0; use log_softmax (log_domain)"]


def test_pre_commit_hook_definition():
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "- id: nanguard-lint" in text and "entry: nanguard lint" in text and "types: [python]" in text


def test_nanguard_lint_src_finds_only_the_demos_deliberate_nan(capsys):
    """nanguard's own code passes its linter, except the built-in demo, which is written to go NaN: its
    pairwise distance sqrt(sum((z_i - z_j)^2)) has a NaN gradient when a batch drawn with replacement holds the
    same sample twice (the run-time diagnosis names it sqrt_domain)."""
    rc, out, _ = run(capsys, "--format", "json", str(ROOT / "src"))
    found = [(Path(d["path"]).relative_to(ROOT / "src").as_posix(), d["rule"], d["category"]) for d in json.loads(out)]
    assert found == [("nanguard/examples/demo_train.py", "NGL008", "sqrt_domain")], out
    line = (ROOT / "src/nanguard/examples/demo_train.py").read_text().splitlines()[json.loads(out)[0]["line"] - 1]
    assert "diff.pow(2).sum(-1)" in line and ".sqrt()" in line


def test_report_lists_the_findings_on_the_runs_origin_line(tree, capsys):
    """`--report`: the run's JSON report names the origin file and line; the lint findings on that line come
    out with the run's category beside them."""
    bad = tree / "pkg" / "bad.py"
    report = {"schema": "nanguard.report/1", "status": "nonfinite", "events": [
        {"step": 17, "phase": "forward", "origin": {"file": str(bad), "line": 7, "op": "log"},
         "cause": {"category": "log_domain"}},
        {"step": 30, "phase": "forward", "origin": {"file": str(tree / "gone.py"), "line": 3},
         "cause": {"category": "div_by_zero"}}]}
    (tree / "r.json").write_text(json.dumps(report))
    rc, out, _ = run(capsys, "--report", str(tree / "r.json"))
    lines = out.splitlines()
    assert rc == 1
    assert lines[0].startswith(f"{bad}:7:13: NGL001 log_domain ") and lines[0].endswith(
        "; at the origin of step 17 (the run's category too)")
    assert lines[1] == f"{tree / 'gone.py'}:3: the origin's file is not here"
    assert not any("NGL006" in ln for ln in lines)  # line 11 is not an origin
    report["events"] = report["events"][:1]
    report["events"][0]["origin"]["line"] = 5
    (tree / "r.json").write_text(json.dumps(report))
    rc, out, _ = run(capsys, "--report", str(tree / "r.json"))
    assert rc == 0 and "no lint finding on the origin's line" in out
    (tree / "r.json").write_text("{not json")
    assert run(capsys, "--report", str(tree / "r.json"))[0] == 2
