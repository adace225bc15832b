"""The run-end line names the run's first failure, not the one recovery stopped at (issue 23)."""
from nanguard.core.events import Event, Report
from nanguard.core.render.terminal import summary_line


def test_a_stop_after_recoveries_names_the_first_failure_and_the_stop():
    rec = {"action": "skip_step", "ok": True}
    rep = Report(events=[Event(step=4, phase="forward", recovery=rec), Event(step=5, phase="forward", recovery=rec),
                         Event(step=7, phase="backward")], steps_watched=8)
    line = summary_line(rep)
    assert "first failure at step 4 (forward)" in line and "stopped at step 7" in line, line


def test_a_lone_failure_is_named_once():
    line = summary_line(Report(events=[Event(step=9, phase="data")], steps_watched=10))
    assert "first failure at step 9 (data)" in line and "stopped" not in line, line
