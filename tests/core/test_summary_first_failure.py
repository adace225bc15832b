"""The run-end line names the run's first failure, not the one recovery stopped at (issue 23)."""
from nanguard.core.events import Event, Report
from nanguard.core.render.terminal import summary_line


def test_a_stop_after_recoveries_names_the_first_failure_and_the_stop():
    rec = {"action": "skip_step", "ok": True}
    rep = Report(events=[Event(step=4, phase="forward", recovery=rec), Event(step=5, phase="forward", recovery=rec),
                         Event(step=7, phase="backward")], steps_watched=8)
    line = summary_line(rep)
    assert "first failure at step 4 (forward)" in line and "stopped at step 7" in line, line


def test_recovered_failures_and_a_later_warning_name_the_first_failure():
    # (the line said "first warning at step 14" after 19 recoveries from step 5 on)
    rec = {"action": "skip_step", "ok": True}
    rep = Report(events=[Event(step=5, phase="forward", recovery=rec),
                         Event(step=14, phase="forward", kind="warning")], steps_watched=100)
    line = summary_line(rep)
    assert "first failure at step 5 (forward)" in line and "warning" not in line and "stopped" not in line, line


def test_a_lone_failure_is_named_once():
    line = summary_line(Report(events=[Event(step=9, phase="data")], steps_watched=10))
    assert "first failure at step 9 (data)" in line and "stopped" not in line, line


def test_an_origin_in_the_top_level_model_is_not_shown_as_module_quote_quote():
    import io

    from rich.console import Console

    from nanguard.core.render.terminal import render
    ev = Event(step=3, phase="forward", origin={"op": "div", "module": "", "dtype": "float32"},
               cause={"category": "div_by_zero", "summary": "x / 0", "confidence": 0.9})
    buf = io.StringIO()
    render(Report(events=[ev], steps_watched=4), None, console=Console(file=buf, width=100))
    out = buf.getvalue()
    assert "top-level model" in out and "module ''" not in out, out


def test_a_stop_on_per_sample_failures_of_finite_data_does_not_blame_the_data():
    from nanguard.core.recovery.budget import RecoveryBudget
    b = RecoveryBudget()
    for s in range(8):
        b.spend(s, "div_by_zero", data_skip=True)
    why = b.exhausted(8, "div_by_zero", data=True)
    assert why and "most of the data is bad" not in why and "data is finite" in why, why
    b = RecoveryBudget()
    for s in range(8):
        b.spend(s, "bad_input_data", data_skip=True)
    assert "most of the data is bad" in b.exhausted(8, "bad_input_data")
