"""docs/schedules.svg is drawn from the schedule code (benchmarks/schedule_plot.py): it fails
here when the code and the committed plot part."""

import pytest

from benchmarks import schedule_plot

pytestmark = pytest.mark.tier("unit")


def test_the_schedules_plot_is_up_to_date_with_the_code():
    assert schedule_plot.PLOT.read_text() == schedule_plot.render(), (
        "docs/schedules.svg is out of date: run python benchmarks/schedule_plot.py")
    assert schedule_plot.main(["--check"]) == 0


def test_the_plot_draws_what_the_run_computes():
    lines = schedule_plot.curves()
    assert set(lines) >= {"linear", "cosine", "wsd", "constant", "inv_sqrt"}
    steps, moved = lines["wsd, re-planned at step 400 to end at 1300"]
    assert moved[1040] == pytest.approx(1.0) and moved[1300] == pytest.approx(0.1)
    assert moved[1170] == pytest.approx(0.55)  # half-way down its 260 decay steps
