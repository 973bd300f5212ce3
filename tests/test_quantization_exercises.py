"""Chapter 8's exercise checks and figure: right answers pass, wrong ones say what is wrong
without leaking the answer."""

from __future__ import annotations

import matplotlib
import pytest

from kvlab.exercises import ch08
from kvlab.exercises._common import NotYetAnswered

matplotlib.use("Agg")


def test_error_bounds():
    sym = max(abs(ch08.ZP_MIN), ch08.ZP_MAX) / 7 / 2
    zp = (ch08.ZP_MAX - ch08.ZP_MIN) / 15 / 2
    assert "Correct" in ch08.check_error_bounds(sym, zp)
    for wrong, hint in (((ch08.ZP_MAX / 15 / 2, zp), "symmetric: too low"),
                        ((2 * sym, zp), "symmetric: too high"),
                        ((sym, zp * 3), "zero-point: too high"),
                        ((sym, ch08.ZP_MAX / 7 / 2), "zero-point: too high"),
                        ((sym, 2 * zp), "zero-point: too high")):
        with pytest.raises(AssertionError, match=hint) as err:
            ch08.check_error_bounds(*wrong)
        message = str(err.value)
        assert f"{sym:.4g}" not in message and f"{zp:.4g}" not in message
        for method in ("2^", "step", "half", "grid"):     # the hint never states the method
            assert method not in message
    with pytest.raises(NotYetAnswered):
        ch08.check_error_bounds(..., zp)
    with pytest.raises(AssertionError, match="as a number"):
        ch08.check_error_bounds("0.03", zp)


def test_greedy_prediction_is_graded_on_the_engine(monkeypatch):
    n = ch08._greedy_identical()
    assert ch08.GREEDY_PROMPTS == 64 and ch08.GREEDY_TOKENS == 64
    assert 0 < n < ch08.GREEDY_PROMPTS            # int4 g64 changes some continuations
    measured = 100 * n / ch08.GREEDY_PROMPTS
    assert "Right" in ch08.check_greedy_prediction(round(measured))
    assert "Right" in ch08.check_greedy_prediction(min(100.0, measured + 11.9))
    with pytest.raises(AssertionError, match="too high") as err:
        ch08.check_greedy_prediction(min(100.0, measured + 12.5))
    assert f"{measured:.0f}%" not in str(err.value) and str(n) not in str(err.value)
    with pytest.raises(AssertionError, match="too low"):
        ch08.check_greedy_prediction(max(0.0, measured - 12.5))
    # the band is about two binomial standard errors of the measured share
    se = (measured * (100 - measured) / ch08.GREEDY_PROMPTS) ** 0.5
    assert 1.5 * se <= ch08.GREEDY_TOLERANCE <= 2.5 * max(se, 6.25)
    monkeypatch.setattr(ch08, "_greedy_identical", lambda: 32)
    assert "Right" in ch08.check_greedy_prediction(50)
    with pytest.raises(AssertionError, match="too high"):
        ch08.check_greedy_prediction(70)
    for bad in ("half", True, 120, -1):
        with pytest.raises(AssertionError, match="between 0 and 100"):
            ch08.check_greedy_prediction(bad)
    with pytest.raises(NotYetAnswered):
        ch08.check_greedy_prediction(...)


def test_colleague_roundtrip_is_caught_and_a_fix_passes():
    import torch

    from kvlab.engine.quantization import QuantConfig, dequantize, quantize

    def fixed(w, bits, group_size):
        return dequantize(quantize(w, QuantConfig(bits, group_size)))

    assert "Fixed" in ch08.check_fixed_roundtrip(fixed)
    with pytest.raises(AssertionError) as err:
        ch08.check_fixed_roundtrip(ch08.colleague_roundtrip)
    text = str(err.value)
    assert "half a grid step" in text
    for word in ("qmax", "2^(b-1) - 1", "overflow", "wrap", "sign"):
        assert word not in text
    with pytest.raises(AssertionError, match="distinct values"):
        ch08.check_fixed_roundtrip(lambda w, b, g: w.clone())
    with pytest.raises(AssertionError, match="shape"):
        ch08.check_fixed_roundtrip(lambda w, b, g: w[:1])
    # the colleague's fault is real: a group's largest positive weight comes back negative
    w = torch.randn(4, 64) * 0.02
    w[0, 3] = 0.5
    assert float(ch08.colleague_roundtrip(w, 4, 64)[0, 3]) < 0


def test_format_design_is_open_ended_and_graded_on_the_ordinary_columns():
    w, bulk, outl = ch08.outlier_weights(), ch08.bulk_columns(), ch08.outlier_columns()
    assert len(outl) == 8 and len(bulk) == 504 and not set(outl) & set(bulk)
    assert float(w[:, outl].abs().mean()) > 10 * float(w[:, bulk].abs().mean())
    # no group format alone meets the brief within the budget (a ternary grid no longer
    # "beats" int4: every one of them loses too much of the ordinary columns)
    for bits in range(2, 9):
        for group in (8, 16, 32, 64, 128, 256, 512):
            for symmetric in (True, False):
                if ch08.design_bits(bits, group, symmetric, 0) > ch08.DESIGN_BITS_BUDGET:
                    continue
                with pytest.raises(AssertionError, match="above the target"):
                    ch08.check_format_design(bits, group, symmetric)
    # the outlier columns kept apart in fp16 (found by their norms) make 3 bits enough
    cols = sorted(int(c) for c in w.norm(dim=0).topk(8).indices)
    assert cols == outl
    for bits, group in ((3, 64), (3, 256), (4, 512)):
        message = ch08.check_format_design(bits, group, True, cols)
        assert "Meets the brief" in message and "outlier columns 0.000" in message
    with pytest.raises(AssertionError, match="above the target"):
        ch08.check_format_design(3, 512, True, cols)              # 0.31: groups too large
    with pytest.raises(AssertionError, match="above the target"):
        ch08.check_format_design(2, 16, False, cols)              # two bits are too few
    with pytest.raises(AssertionError, match="above the target"):    # not the outliers
        ch08.check_format_design(3, 64, True, [c for c in range(16) if c not in outl][:8])
    with pytest.raises(AssertionError, match="exceeds the budget"):
        ch08.check_format_design(4, 128, True, cols)              # 4.375 bits
    assert ch08.design_bits(3, 64, True, 8) == 3.25 + 0.25
    with pytest.raises(AssertionError, match="not a valid format"):
        ch08.check_format_design(2, 384)
    for bad in ((4.5, 64), (4, 0), (4, -64), (True, 64)):    # clear errors, no truncation
        with pytest.raises(AssertionError, match="positive whole number"):
            ch08.check_format_design(*bad)
    with pytest.raises(AssertionError, match="True or False"):
        ch08.check_format_design(4, 128, "no")
    for bad_cols in ([1, 1], [512], [-1]):
        with pytest.raises(AssertionError, match="distinct column indices"):
            ch08.check_format_design(3, 64, True, bad_cols)
    with pytest.raises(AssertionError, match="column indices"):
        ch08.check_format_design(3, 64, True, [None])


def test_report_fact():
    assert "Right" in ch08.check_report_fact("kernels_executed")
    for fact in ch08.REPORT_FACTS[:-1]:
        with pytest.raises(AssertionError, match=r"^no: ") as err:
            ch08.check_report_fact(fact)
        message = str(err.value)
        assert "kernels_executed" not in message
        # why the chosen field fails, not a paraphrase of the right one
        assert "ran" not in message.split() and "what did" not in message
    with pytest.raises(AssertionError, match="answer one of"):
        ch08.check_report_fact("speed")


def test_figure_and_summary_agree_on_bytes():
    from kvlab.viz.quantization import example_row, quantization_figure, quantization_summary

    s = quantization_summary(example_row(12.0), 4, 32)
    assert s["bytes"] * 8 / 256 == s["effective_bits"] == 4.5
    assert s["max_error"] <= s["scales"].max() / 2 * (1 + 1e-6)
    fig = quantization_figure(example_row(12.0), 4, 32)
    assert len(fig.axes) == 3
