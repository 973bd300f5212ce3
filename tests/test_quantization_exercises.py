"""Chapter 8's exercise checks and figure: right answers pass, wrong ones say what is wrong
without leaking the answer."""

from __future__ import annotations

import matplotlib
import pytest

from kvlab.exercises import ch08
from kvlab.exercises._common import NotYetAnswered

matplotlib.use("Agg")


def test_error_bound():
    truth = ch08.BOUND_ABSMAX / 7 / 2
    assert "Correct" in ch08.check_error_bound(truth)
    for wrong, hint in ((ch08.BOUND_ABSMAX / 15 / 2, "on each side of zero"),
                        (2 * truth, "whole grid"), (truth * 3, "too high"),
                        (truth / 3, "too low")):
        with pytest.raises(AssertionError, match=hint) as err:
            ch08.check_error_bound(wrong)
        assert f"{truth:.4g}" not in str(err.value)
    with pytest.raises(NotYetAnswered):
        ch08.check_error_bound(...)


def test_group_size():
    w = ch08.outlier_weights()
    ok = [g for g in ch08.GROUP_CHOICES if ch08.relative_error(w, 4, g) <= ch08.ERROR_BUDGET]
    best = max(ok)
    assert "Correct" in ch08.check_group_size(best)
    with pytest.raises(AssertionError, match="misses the budget"):
        ch08.check_group_size(min(g for g in ch08.GROUP_CHOICES if g > best))
    smaller = [g for g in ok if g < best]
    if smaller:
        with pytest.raises(AssertionError, match="a larger group does too") as err:
            ch08.check_group_size(smaller[0])
        assert str(best) not in str(err.value).split("group")[-1]
    with pytest.raises(AssertionError, match="choose one of"):
        ch08.check_group_size(48)


def test_capacity_gain():
    auto = ch08.CAPACITY_MEMORY // (2048 * 16)
    int8 = ch08.CAPACITY_MEMORY // (544 * 16)
    assert "Correct" in ch08.check_capacity_gain(auto, int8)
    with pytest.raises(AssertionError, match="scales take bytes") as err:
        ch08.check_capacity_gain(auto, ch08.CAPACITY_MEMORY // (2 * 4 * 2 * 32 * 16))
    assert str(int8) not in str(err.value)
    with pytest.raises(AssertionError, match=r"float32: .* too high"):
        ch08.check_capacity_gain(auto + 1, int8)


def test_format_design_is_open_ended_and_graded():
    assert "Meets the brief" in ch08.check_format_design(3, 32)
    assert "Meets the brief" in ch08.check_format_design(4, 128, symmetric=False)
    with pytest.raises(AssertionError, match="exceeds the budget"):
        ch08.check_format_design(4, 64, symmetric=False)       # 4.375 bits
    with pytest.raises(AssertionError, match="does not beat"):
        ch08.check_format_design(4, 128)
    with pytest.raises(AssertionError, match="not a valid format"):
        ch08.check_format_design(2, 384)


def test_figure_and_summary_agree_on_bytes():
    from kvlab.viz.quantization import example_row, quantization_figure, quantization_summary

    s = quantization_summary(example_row(12.0), 4, 32)
    assert s["bytes"] * 8 / 256 == s["effective_bits"] == 4.5
    assert s["max_error"] <= s["scales"].max() / 2 * (1 + 1e-6)
    fig = quantization_figure(example_row(12.0), 4, 32)
    assert len(fig.axes) == 3
