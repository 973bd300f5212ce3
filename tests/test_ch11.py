"""Chapter 11: exercise checks accept the solutions, reject wrong answers with a direction,
and never print the expected answer; the goodput figure and widget draw."""

from __future__ import annotations

import pytest

from kvlab.core.slo import SLO
from kvlab.exercises import ch11
from kvlab.exercises._common import NotYetAnswered
from kvlab.sim.serving import run_colocated


def test_goodput_by_hand() -> None:
    assert "3 of 8" in ch11.check_goodput_by_hand(3 / 4, 3 / 8)
    with pytest.raises(AssertionError, match="attainment"):
        ch11.check_goodput_by_hand(3 / 4, 3 / 6)       # failures left out of the denominator
    with pytest.raises(AssertionError, match="window"):
        ch11.check_goodput_by_hand(3 / 8, 3 / 8)
    with pytest.raises(NotYetAnswered):
        ch11.check_goodput_by_hand(..., 0.5)


def test_max_rate_check_gives_direction_without_the_answer() -> None:
    truth = ch11._capacity()
    assert 5 < truth < 30
    assert ch11.check_max_rate(truth * 1.1).startswith("Correct")
    with pytest.raises(AssertionError, match="too high") as high:
        ch11.check_max_rate(truth * 1.5)
    with pytest.raises(AssertionError, match="too low") as low:
        ch11.check_max_rate(truth * 0.5)
    for err in (high, low):
        assert f"{truth:g}" not in str(err.value) and f"{truth:.1f}" not in str(err.value)
    with pytest.raises(AssertionError):
        ch11.check_max_rate(-1)


def test_chunk_check_truth_is_the_largest_budget_within_tpot() -> None:
    rows = {c: ch11._chunk_row(c) for c in ch11.CHUNK_CHOICES}
    ok = [c for c, r in rows.items() if r["tpot_p99_s"] <= ch11.TPOT_BUDGET_S]
    best = max(ok)
    assert ch11.check_chunk_for_tpot(best).startswith("Correct")
    smaller = [c for c in ok if c < best]
    if smaller:
        with pytest.raises(AssertionError, match="larger budget"):
            ch11.check_chunk_for_tpot(smaller[0])
    too_big = [c for c in ch11.CHUNK_CHOICES if c not in ok]
    assert too_big, "the exercise needs a budget that fails"
    with pytest.raises(AssertionError, match="too large"):
        ch11.check_chunk_for_tpot(too_big[-1])
    with pytest.raises(AssertionError, match="one of"):
        ch11.check_chunk_for_tpot(300)


def test_goodput_figure_and_widget_draw() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.viz.goodput import attainment_curve, goodput_explorer, goodput_figure

    rates = [4.0, 40.0]
    runs = [run_colocated(ch11.chat_workload(30, r), ch11.COST, ch11.COLOCATED) for r in rates]
    curves = {"one": (rates, runs)}
    att, good = attainment_curve(rates, runs, SLO(ttft=0.3))
    assert att[0] >= att[1] and all(0 <= a <= 1 for a in att) and good[0] > 0
    fig = goodput_figure(curves, SLO(ttft=0.3), rate=4.0)
    assert len(fig.axes) == 2
    widget = goodput_explorer(curves)
    assert widget.children
