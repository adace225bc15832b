"""A run in which nothing could be checked (JAX: no optax update ran) is "unwatched", never "clean": its JSON
says why, the terminal line says it, and the page says nothing was checked (a NaN run with a hand-written JAX
update was reported clean, 0 steps watched)."""
from __future__ import annotations

from nanguard.core.events import Event, Report
from nanguard.core.render.html import render_html
from nanguard.core.render.terminal import summary_line


def test_unwatched_is_a_status_of_its_own_and_round_trips():
    rep = Report(unwatched="no optax update ran", steps_watched=0)
    assert rep.status == "unwatched" and Report.from_dict(rep.as_dict()).status == "unwatched"
    assert "no optax update ran" in summary_line(rep)
    assert Report(steps_watched=0).status == "clean"  # no reason given: as before
    assert Report(unwatched="x", events=[Event(step=1, phase="forward")]).status == "nonfinite"


def test_the_page_says_nothing_was_checked():
    page = render_html(Report(unwatched="no optax update ran <b>", steps_watched=0).as_dict())
    assert "Nothing was checked" in page and "No non-finite value" not in page
    assert "no optax update ran &lt;b&gt;" in page  # escaped
