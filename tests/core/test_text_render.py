"""Text that reads well (issue 25): plurals, empty lists left out, terminal escape codes stripped, in the
terminal panel, the summary and one-line status, the recovery lines, the JSON and the HTML page; the
Evidence section (labels, units, meanings, the raw dump folded); plot legends that say what happened;
the division words of a diagnosis that follow the op's own output counts.

Synthetic reports only (no framework); tests/torch/test_scenario_text.py runs the same checks
(tests/textcheck.py) over the reports of real scenario runs.
"""
from __future__ import annotations

import json

import pytest

from nanguard.core.diagnosis.rules.division import zero_division_words
from nanguard.core.diagnosis.rules.roots import sqrt_result
from nanguard.core.events import Event, Report, one_line
from nanguard.core.recovery.records import actions_tally, notice
from nanguard.core.render.html import render_html
from nanguard.core.render.html_evidence import EVIDENCE, deciding_rows
from nanguard.core.render.plots import mark_label
from nanguard.core.render.terminal import panel_title, summary_line
from nanguard.core.text import counted_list, listed, plural, strip_ansi
from textcheck import all_problems, rendered_texts

# --------------------------------------------------------------------------- the helpers

def test_plural_and_lists():
    assert plural(1, "step") == "1 step" and plural(3, "step") == "3 steps" and plural(0, "step") == "0 steps"
    assert plural(1, "backward pass") == "1 backward pass" and plural(2, "backward pass") == "2 backward passes"
    assert plural(2, "recovery") == "2 recoveries" and plural("no", "recovery") == "no recoveries"
    assert plural(1, "batch") == "1 batch" and plural(4, "batch") == "4 batches"
    assert listed([]) == "" and listed(None) == "" and listed([3, 5]) == "3, 5"
    assert listed(list(range(30)), limit=3) == "0, 1, 2..."
    assert counted_list("row", []) == "" and counted_list("row", [5]) == "row 5"
    assert counted_list("row", [3, 5]) == "rows 3, 5"


def test_strip_ansi():
    msg = "\x1b[1mCUDA error\x1b[0m: \x1b[31;1mdevice-side assert\x1b[0m \x1b]8;;http://x\x07link\x1b]8;;\x07"
    assert strip_ansi(msg) == "CUDA error: device-side assert link"
    assert strip_ansi("plain") == "plain" and strip_ansi(None) is None and strip_ansi(3) == 3


# --------------------------------------------------------------------------- synthetic reports

def _event(step=4, phase="backward", **kw) -> Event:
    ev = Event(step=step, phase=phase,
               origin={"op": "aten.div.Tensor", "file": "/tmp/train.py", "line": 25, "function": "<module>",
                       "dtype": "float32", "samples": [], "source_rows": [],
                       "output": {"nan": 0, "posinf": 2, "neginf": 0}},
               cause={"category": "sqrt_domain", "summary": "sqrt at train.py:25 received 1 zero input",
                      "confidence": 0.9,
                      "evidence": {"facts": {"sqrt_domain": {"zeros": 2, "negatives": 0, "numel": 56},
                                             "float64_check": {"finite": False}, "mystery_fact": {"a": 1}},
                                   "output": {"nan": 0, "posinf": 2, "neginf": 0},
                                   "detected": {"loss": 1.25, "n_bad_grads": 4},
                                   "experiments": [{"kind": "domain_guard", "change": "the inputs of sqrt clamped",
                                                    "finite": True, "seconds": 0.5,
                                                    "verdicts": {"sqrt_domain": "confirms"}}],
                                   "unknown_key_xyz": 12.5}},
               fixes=["add an eps"], localization={"method": "replayed", "reproduced": True},
               detected={"loss": 1.25})
    for k, v in kw.items():
        setattr(ev, k, v)
    return ev


def _reports() -> dict:
    one_step = Report(steps_watched=1, max_grad_norm=1.0, history=[{"step": 0, "loss": 1.0, "grad_norm": 1.0}])
    fail = Report(events=[_event()], steps_watched=1, max_grad_norm=2.0,
                  history=[{"step": 0, "loss": 1.0, "grad_norm": 1.0}])
    warn = Report(events=[_event(step=3, phase="forward", kind="warning", origin=None,
                                 cause={"category": "lr_too_high", "summary": "the loss grew", "confidence": 0.8,
                                        "evidence": {"loss_growth_factor_per_step": 2.5, "loss_growth_steps": 4,
                                                     "lr": [0.5]}})],
                  steps_watched=8, max_grad_norm=3.0,
                  history=[{"step": i, "loss": 2.0 ** i, "grad_norm": 1.0} for i in range(8)])
    rec = _event(step=2, phase="forward", recovery={
        "action": "upcast+skip_step", "ok": True, "recovery_number": 1,
        "actions": {"skip_step": {}, "upcast": {"module": "", "downstream": [], "dtype_before": ["float16"]}}})
    recovered = Report(events=[rec], steps_watched=5, max_grad_norm=1.0,
                       history=[{"step": i, "loss": 1.0, "grad_norm": 1.0} for i in range(5)])
    err = Report(steps_watched=1, script_error={
        "type": "RuntimeError", "message": "\x1b[1mCUDA error: \x1b[31mdevice-side assert triggered\x1b[0m",
        "file": "/tmp/train.py", "line": 3, "step": 0,
        "diagnosis": {"summary": "\x1b[33ma kernel assert\x1b[0m", "fixes": ["run on the CPU"]}})
    backward = Report(steps_watched=1, counting="backward")
    return {"one_step": one_step, "fail": fail, "warning": warn, "recovered": recovered, "script_error": err,
            "backward_counting": backward}


@pytest.mark.parametrize("name", sorted(_reports()))
def test_rendered_text_reads_well(name):
    report = _reports()[name]
    assert all_problems(report) == []


def test_singular_counts_and_no_empty_lists():
    r = _reports()
    assert "watched 1 step," in summary_line(r["one_step"])
    assert "watched 1 backward pass," in summary_line(r["backward_counting"])
    texts = rendered_texts(r["fail"])
    assert "batch rows" not in texts["panel"] and "dataset rows" not in texts["panel"]  # empty: left out
    assert "watched 1 step" in texts["html"]


def test_the_panel_names_the_dataset_rows_a_drop_samples_replay_proved():
    # log(0) of one zero price in a shuffled DataLoader: the origin is the op (no source_rows of bad input
    # data), the replay without batch row 10 was finite, and the DataLoader's indices named dataset row 613
    ev = _event()
    ev.origin["samples"] = [10]
    ev.cause["evidence"]["bad_samples"] = {"batch_rows": [10], "dataset_indices": [613]}
    panel = rendered_texts(Report(events=[ev]))["panel"]
    assert "batch rows   10" in panel and "dataset rows 613" in panel, panel


def test_escape_codes_stripped_from_panel_json_and_html():
    texts = rendered_texts(_reports()["script_error"])
    assert "CUDA error: device-side assert triggered" in texts["panel"]
    assert "CUDA error: device-side assert triggered" in json.loads(texts["json"])["script_error"]["message"]
    assert "\\u001b" not in texts["json"] and "\x1b" not in texts["html"]


def test_warning_is_never_called_a_non_finite_value():
    r = _reports()["warning"]
    ev = r.events[0]
    assert panel_title(ev).startswith("early warning") and "non-finite" not in panel_title(ev)
    assert one_line(ev).startswith("early warning at step 3")
    assert "non-finite value" not in rendered_texts(r)["panel"]
    assert mark_label("warning", [3]) == "early warning at step 3 (all finite)"


def test_recovery_lines():
    rec = {"action": "rollback+drop_samples", "recovery_number": 1,
           "actions": {"rollback": {"elements_only": True, "elements_restored": 1, "to_step": 2},
                       "drop_samples": {"rows": [5]}, "quarantine": {"rows": []}}}
    line = notice(7, "bad_input_data", rec)
    assert "1 non-finite element restored" in line and "without row 5" in line and "[" not in line
    assert actions_tally([_event(step=4, recovery={"action": "skip_step"})]) == " (skip_step x1) at step 4"


# --------------------------------------------------------------------------- the HTML page

def test_evidence_section_labels_units_and_folded_dump():
    page = render_html(_reports()["fail"].as_dict(), plots=False)
    sec = page[page.index('id="evidence"'):page.index('id="fixes"')]
    deciding = sec[sec.index('id="evidence-deciding"'):sec.index("</table>", sec.index('id="evidence-deciding"'))]
    for label, unit in (("inputs of the root at 0", "elements"), ("+inf outputs", "elements"),
                        ("non-finite gradients", "parameters")):
        row = deciding[deciding.index(label):]
        row = row[:row.index("</tr>")]
        assert unit in row and 'class="meaning"' in row, row
    assert "2 of 56" in deciding and "still non-finite" in deciding
    assert "NaN outputs" not in deciding  # a count of 0 says nothing: left out
    assert 'id="evidence-experiments"' in sec and "the inputs of sqrt clamped" in sec
    dump = sec[sec.index('<details class="all-evidence"'):]
    assert "unknown_key_xyz" in dump and "mystery_fact" in dump and "unknown_key_xyz" not in deciding
    assert "<details" in sec and " open" not in dump[:dump.index(">")]  # folded


def test_evidence_registry_is_well_formed():
    paths = [k.path for k in EVIDENCE]
    assert len(paths) == len(set(paths))
    for k in EVIDENCE:
        assert k.label and k.meaning and k.kind in {"count", "number", "factor", "finite", "rows", "list"}
    rows = deciding_rows(_reports()["warning"].events[0].cause)
    assert [k.path for k, _, _ in rows] == ["loss_growth_factor_per_step", "loss_growth_steps", "lr"]
    assert "×2.5" in rows[0][1] and "per step" in rows[0][1]


def test_plot_legends_say_what_happened():
    pytest.importorskip("matplotlib")
    page = render_html(_reports()["fail"].as_dict())
    assert "<svg" in page
    assert "gradients non-finite at step 4" in page  # not "non-finite (step 4)" on a finite loss
    assert "non-finite (step" not in page
    assert mark_label("failure", [4], {4: "forward"}) == "loss non-finite at step 4"
    assert mark_label("recovery", [2]) == "non-finite, recovered at step 2"
    assert mark_label("failure", [1, 2, 3]) == "non-finite at 3 steps"
    warn_page = render_html(_reports()["warning"].as_dict())
    assert "early warning at step 3 (all finite)" in warn_page and "went non-finite" not in warn_page


# --------------------------------------------------------------------------- the division words

def test_division_words_follow_the_op_output():
    assert zero_division_words({"output": {"posinf": 2}}) == "x/0 = +inf (2 elements)"
    assert zero_division_words({"output": {"nan": 1}}) == "0/0 = NaN (1 element)"
    assert zero_division_words({"output": {"nan": 3, "neginf": 1}}) == "x/0 = -inf (1 element) and 0/0 = NaN (3 elements)"
    origin = {"op": "aten.div.Tensor", "file": "/t/demo.py", "line": 25, "stage": "backward",
              "autograd_node": "SqrtBackward0", "forward_op": "aten.sqrt.default", "forward_api": "Tensor.sqrt",
              "output": {"nan": 0, "posinf": 2, "neginf": 0}}
    res = sqrt_result(origin, {"sqrt_domain": {"zeros": 2, "negatives": 0, "numel": 56}}, {}, "m", backward=True)
    assert "x/0 = +inf (2 elements)" in res["summary"] and "0/0" not in res["summary"]
    assert "2 of 56 inputs are exactly 0" in res["summary"]
