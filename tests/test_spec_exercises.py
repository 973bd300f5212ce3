"""Chapter 9's exercise checks (right answers pass, wrong ones fail without leaking the answer)
and its figure."""

from __future__ import annotations

import math

import pytest

from kvlab.exercises import ch09
from kvlab.exercises._common import NotYetAnswered


def _fails_without_leaking(check, *args, secret):
    with pytest.raises(AssertionError) as info:
        check(*args)
    text = str(info.value)
    assert f"{secret:.3f}" not in text and f"{secret:.2f}" not in text, text
    return text


def test_expected_length_check():
    assert "Correct" in ch09.check_expected_length(lambda a, k: sum(a ** i for i in range(k + 1)))
    msg = _fails_without_leaking(ch09.check_expected_length,
                                 lambda a, k: sum(a ** i for i in range(k)), secret=1.0)
    assert "too low" in msg
    with pytest.raises(NotYetAnswered):
        ch09.check_expected_length(...)


def test_residual_check():
    def right(p, q):
        raw = [max(a - b, 0) for a, b in zip(p, q, strict=True)]
        return [x / sum(raw) for x in raw]

    assert "Correct" in ch09.check_residual(right)
    with pytest.raises(AssertionError, match="not a distribution"):
        ch09.check_residual(lambda p, q: [max(a - b, 0) for a, b in zip(p, q, strict=True)])
    with pytest.raises(AssertionError, match="q >= p"):
        ch09.check_residual(lambda p, q: list(p))


def test_number_checks_do_not_leak():
    p, q = ch09.EXAMPLE_P, ch09.EXAMPLE_Q
    beta = sum(min(a, b) for a, b in zip(p, q, strict=True))
    assert "Correct" in ch09.check_acceptance_probability(beta)
    assert "too high" in _fails_without_leaking(ch09.check_acceptance_probability, beta + 0.1,
                                                secret=beta)
    out = [min(a, b) + (1 - beta) * a for a, b in zip(p, q, strict=True)]
    tv = 0.5 * sum(abs(o - a) for o, a in zip(out, p, strict=True))
    assert tv > 0.01
    assert "Correct" in ch09.check_buggy_tv(tv)
    assert "too low" in _fails_without_leaking(ch09.check_buggy_tv, tv / 2, secret=tv)


def test_best_k_check():
    def speedup(n):
        return sum(0.7 ** i for i in range(n + 1)) / (0.15 * n + 1)

    best = max(range(1, 65), key=speedup)
    assert "Good" in ch09.check_best_k(0.7, 0.15, best)
    with pytest.raises(AssertionError, match="larger"):
        ch09.check_best_k(0.7, 0.15, 1)
    with pytest.raises(AssertionError, match="smaller"):
        ch09.check_best_k(0.7, 0.15, 30)
    assert not math.isclose(speedup(1), speedup(best))


def test_acceptance_figure_draws_plain_data():
    pytest.importorskip("matplotlib")
    from kvlab.engine.spec_decode.acceptance import AcceptanceData
    from kvlab.viz.spec import acceptance_figure

    data = AcceptanceData("draft_model", 3, 0.8, (0.7, 0.5, 0.3),
                          {"req 0": ((1, 2), (2, 4)), "req 1": ((1, 1),)},
                          ((0.1, 0.4), (0.05, 0.3)), 0.7, 2.3)
    fig = acceptance_figure(data)
    assert len(fig.axes) == 3
    assert "2 rejected drafts" in fig.axes[2].get_title()
