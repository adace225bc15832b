"""Structured fixes (issue 22, core/diagnosis/fixes.py): the rules' numeric fixes carry their kind, value and
scope beside the text, and reconcile reads those, never the text; the fields survive a JSON round trip
(``cause.fix_specs``) and a pickle (an event sent between ranks)."""
from __future__ import annotations

import json
import pickle

from nanguard.core.diagnosis import fixes as X
from nanguard.core.diagnosis.early import warning_cause
from nanguard.core.events import Event, Report
from nanguard.core.experiments import tested as tested_mod
from nanguard.core.experiments.reconcile import reconcile

TEXT = "lower the learning rate from 0.1 to about 0.01"


def _event(fixes, lr=0.001):
    exp = {"kind": "lr_replay", "finite": True, "replays": 3, "params": {"factor": lr / 0.1, "from_step": 6},
           "details": {"lr": [lr], "steps": 3, "losses": [2.0, 1.5]}}
    cause = {"category": "lr_too_high", "summary": "s", "confidence": 0.8,
             "evidence": {"experiments": [exp], "experiments_cost": {"replays": 3}}}
    ev = Event(step=9, phase="forward", origin=None, cause=cause, fixes=list(fixes), localization={"reproduced": True})
    ev.cause["tested_fixes"] = tested_mod.tested_fixes([exp])
    return ev


def test_reconcile_reads_the_fixs_fields_not_its_text():
    plain = _event([TEXT])  # the same words, written without a builder: nothing says it is a learning rate
    reconcile(plain, "pytorch")
    assert plain.fixes == [TEXT] and "untested_fixes" not in plain.cause and "fix_specs" not in plain.cause
    structured = _event([X.lr_sentence("lower the learning rate from 0.1 to {about}", "0.01")])
    assert structured.fixes == [TEXT]  # the text is the same
    reconcile(structured, "pytorch")
    assert structured.fixes == ["lower the learning rate from 0.1 to 0.001"]
    f = structured.fixes[0]
    assert isinstance(f, X.Fix) and f.kind == "lr" and f.value == 0.001 and f[f.spans[0][0]:f.spans[0][1]] == "0.001"


def test_the_fields_survive_the_report_json_and_a_pickle():
    with X.speaking("pytorch"):
        fixes = X.bind(["clip first: " + X.clip_grad_norm("0.25"), "check the data"])
    ev = _event([X.lr_sentence("lower the learning rate from 0.1 to {about}", "0.01")] + fixes)
    reconcile(ev, "pytorch")
    specs = ev.cause["fix_specs"]
    assert [s and s["kind"] for s in specs] == ["lr", "clip", None]
    back = Report.from_dict(json.loads(json.dumps(Report(events=[ev]).as_dict(), default=str))).events[0]
    assert all(type(f) is str for f in back.fixes)
    # a later replay of the clip, reconciled on the event read back: its value is found from fix_specs
    back.cause["evidence"]["experiments"].append({"kind": "clip_replay", "finite": True, "replays": 3,
                                                  "params": {"max_norm": 0.5, "from_step": 6},
                                                  "details": {"steps": 3, "losses": [2.0, 1.0]}})
    back.cause["tested_fixes"] = tested_mod.tested_fixes(back.cause["evidence"]["experiments"])
    reconcile(back, "pytorch")
    assert back.fixes[1] == "clip first: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)"
    assert back.fixes[1].value == 0.5
    p = pickle.loads(pickle.dumps(back.fixes[1]))
    assert (p, p.kind, p.value, p.spans) == (back.fixes[1], "clip", 0.5, back.fixes[1].spans)


def test_every_place_a_clip_value_is_written_is_reworded():
    with X.speaking("tensorflow"):
        f = X.bind(["or clip: " + X.clip_grad_norm("1.5")])[0]
    assert f.kind == "clip" and len(f.spans) == 3
    g = f.reworded(0.25, "0.25")
    assert "1.5" not in g and g.count("0.25") == 3 and g.value == 0.25


def test_a_float32_scope_names_the_fix_only_where_it_starts_the_sentence():
    origin = {"module": "enc.1", "module_type": "Linear"}
    with X.speaking("pytorch"):
        first, inside = X.bind([X.float32_layer(origin, "t.py:3"), "or else " + X.float32_layer(origin, "t.py:3")])
    assert first.kind == "dtype" and first.scope == "enc.1"
    assert not isinstance(inside, X.Fix)


def test_an_early_warnings_lr_fix_is_structured():
    hist = [{"step": s, "loss": 1.0 * 2 ** s, "grad_norm": 1.0 * 2 ** s, "param_norm": 1.0 + s, "lr": [0.5],
             "update_ratio": 0.5} for s in range(6)]
    cause = warning_cause({"rule": "growth", "signal": "loss", "step": 5, "loss": 32.0}, hist,
                          {"optimizer": "SGD", "lr": [0.5]})
    lr = [f for f in cause["fixes"] if isinstance(f, X.Fix) and f.kind == "lr"]
    assert cause["category"] == "lr_too_high" and lr and lr[0].value is not None and lr[0].value < 0.5
