"""``docs/LINT.md``, generated from the rule registry: ``python -m nanguard.lint.docs > docs/LINT.md`` (a test
keeps the file current)."""
from __future__ import annotations

from ..core.diagnosis import fixes as X
from .registry import rules
from .rules import get  # noqa: F401  (imports every rule module: the registry is complete)

__all__ = ["lint_markdown"]

_INTRO = """# `nanguard lint`: find the NaN before the run

`nanguard lint PATH...` reads PyTorch and TensorFlow/Keras code (the standard library's `ast`; nothing is
imported or run) and reports the patterns that make NaN/Inf in training, each with one of nanguard's
cause categories ([CATEGORIES.md](CATEGORIES.md)) and the fix texts the run-time diagnosis gives for that
cause. A local data flow decides: a value that comes from a softmax, a sigmoid, a ReLU, a count or a mask's
sum, a standard deviation or a norm is at risk; one that passed `clamp`/`clip`/`maximum`,
`+ eps`, `torch.where`/`tf.where`, `F.normalize`/`l2_normalize` or a fused stable op (`log_softmax`,
`logsigmoid`, `logsumexp`, `divide_no_nan`) is not, and neither is a value tested by a surrounding
condition (`x / len(b) if b else 0`). A parameter is a probability when the function's own arithmetic
says so (`log(p)` beside `1 - p`, `y * log(p)` against another parameter). Precision comes first: a value
of unknown origin is not a finding, except a tensor parameter put into a log as it came in (NGL015, the
`log(y_pred)` of hand-written losses). Values made by this file's own functions and model classes (their
return values, an `nn.Sequential`'s last layer) are followed. Measured: 26 findings in 385,000 lines of
popular training code (0.07 per 1,000 lines), 10 of them a log of a softmax/sigmoid output.

```bash
nanguard lint src/ train.py                 # text: file:line:col: RULE category message
nanguard lint --format json src/            # [{"path", "line", "col", "rule", "category", "message", "fixes", ...}]
nanguard lint --format sarif -o lint.sarif src/   # SARIF 2.1.0 for code scanning
nanguard lint --select NGL001,NGL005 --ignore NGL007 src/
nanguard lint --fix src/                    # rewrite the exactly safe patterns (needs `pip install 'nanguard[lint]'`)
nanguard lint --report nanguard_report.json # after a run: the findings on the lines where its NaNs were born
flake8 --select NGL src/                    # the same rules as a flake8 plugin
```

Exit status: 0 clean, 1 findings (or a file that could not be checked), 2 usage error (no such path, a bad
`--format` or rule code, a `pyproject.toml` that does not parse). A file with a syntax error is reported on
one line and the others are still checked.

Suppress a finding with a trailing comment on its line: `# nanguard: ignore[NGL001]` (or
`# nanguard: ignore` for every rule). Configure in `pyproject.toml`:

```toml
[tool.nanguard.lint]
paths = ["src", "train.py"]        # checked when no PATH is given
select = ["NGL0"]                  # codes or prefixes (default: all)
ignore = ["NGL007"]
exclude = ["vendored", "tests/*"]  # fnmatch patterns, relative to the pyproject's folder
```

pre-commit (`.pre-commit-hooks.yaml` in this repository):

```yaml
- repo: <this repository's URL>
  rev: <a tag>
  hooks:
    - id: nanguard-lint
```

## Rules

`--fix` rewrites only where the result is exactly the same computation, stably: `log(softmax(x, dim))` ->
`log_softmax(x, dim)` and `nn.BCELoss()(torch.sigmoid(z), y)` / `F.binary_cross_entropy(torch.sigmoid(z), y)`
-> `nn.BCEWithLogitsLoss()(z, y)` / `F.binary_cross_entropy_with_logits(z, y)`, when the softmax or sigmoid is
written inside the call; everything else is reported, never rewritten. The fix column is the run-time
diagnosis' first fix for the category, in PyTorch (TensorFlow files get the TensorFlow wording).
"""

_LIMITS = """## What it does not see

The flow is local to a function (and a class's `self.` attributes, and module-level names): a probability
made by another function or a model's last layer and passed in is only known as such when this function's
own arithmetic shows it (above). Not flagged on purpose, because healthy code does them all the time and
they rarely fail: `exp(0.5 * logvar)` of an encoder output, Keras `BinaryCrossentropy()` on a sigmoid layer
(Keras clips the probabilities to [1e-7, 1 - 1e-7], so it saturates but does not go NaN), reductions over a
dimension that might have size 1 (the shape is not known statically). The run-time diagnosis
(`nanguard run`) sees all of these with their numbers; the published bugs the linter misses are kept in
`tests/core/lint_bugs/known_misses/`."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def lint_markdown() -> str:
    lines = [_INTRO, "| code | name | category | what it finds | fix | --fix |", "|---|---|---|---|---|---|"]
    origin = {"file": "train.py", "line": 42}
    for r in rules():
        with X.speaking(X.PYTORCH):
            facts = {"producers": ["sigmoid"]} if r.code == "NGL002" else {"producers": ["softmax"]} \
                if r.code == "NGL001" else {}
            fix = r.fixes(origin, facts)[0]
        lines.append(f"| `{r.code}` | {r.name} | [`{r.category}`](CATEGORIES.md) | {_cell(r.what)} | {_cell(fix)} | "
                     f"{'yes' if r.autofix else ''} |")
    lines += ["", _LIMITS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(lint_markdown(), end="")
