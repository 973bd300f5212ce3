"""Chapter 9's exercise checks (right answers pass, wrong ones fail without leaking the answer)
and its figures."""

from __future__ import annotations

import pytest

from kvlab.exercises import _common, ch09
from kvlab.exercises._common import NotYetAnswered


def _fails(check, *args, match=None):
    with pytest.raises(AssertionError, match=match) as info:
        check(*args)
    return str(info.value)


def _pmf(a, k):
    return [a ** (j - 1) * (1 - a) for j in range(1, k + 1)] + [a ** k]


def test_context_effect_grades_the_direction_and_the_limit_together_once():
    from kvlab.sim.costmodel import speculative_step_cost

    target, draft = ch09.deployment_cost_models()
    b, k, a = ch09.PREDICT["batch"], ch09.PREDICT["k"], ch09.PREDICT["alpha"]
    short, long = (speculative_step_cost(target, draft, batch=b, k=k, alpha=a, context=c,
                                         draft_forwards=k) for c in ch09.PREDICT["contexts"])
    assert short.fits and long.fits                 # the exercise's scenario is deployable
    assert long.speedup < short.speedup
    # the limit: two memory-bound reads, one of the target's KV and k of the draft's
    limit = long.expected_tokens / (1 + k * draft.kv_bytes_per_token
                                    / target.kv_bytes_per_token)
    far = speculative_step_cost(target, draft, batch=b, k=k, alpha=a, context=10**9,
                                draft_forwards=k)
    assert far.speedup == pytest.approx(limit, rel=1e-3)
    assert ch09.check_context_effect("falls", limit).startswith("Right")
    # one message whatever is wrong (the direction, the limit, or both), naming no direction
    texts = set()
    for option, value in (("rises", limit), ("unchanged", limit), ("falls", limit * 1.1),
                          ("falls", limit * 0.9), ("rises", 2 * limit)):
        _common._PREDICTIONS.clear()
        _common._PREDICTION_FILE.unlink(missing_ok=True)
        texts.add(_fails(ch09.check_context_effect, option, value))
    assert len(texts) == 1
    text = texts.pop()
    assert "revisit" in text and not {"fall", "rise", "high", "low"} & set(text.split())
    # graded once: after a wrong pair, the right pair is not graded
    again = ch09.check_context_effect("falls", limit)
    assert "not right" in again and "Right" not in again
    _common._PREDICTIONS.clear()
    _common._PREDICTION_FILE.unlink(missing_ok=True)
    _fails(ch09.check_context_effect, "drops", limit, match="answer one of")
    for bad in ("6", float("nan"), float("inf"), -1.0):
        _fails(ch09.check_context_effect, "falls", bad, match="positive number")
    assert ch09.check_context_effect("falls", limit).startswith("Right")   # nothing recorded
    with pytest.raises(NotYetAnswered):
        ch09.check_context_effect("falls", ...)


def test_the_checks_hold_no_answer_in_their_source():
    import inspect

    for check in (ch09.check_emitted_pmf, ch09.check_point_mass_residual,
                  ch09.check_context_effect):
        source = inspect.getsource(check)
        assert "alpha **" not in source and "1 - p[x]" not in source
        assert "kv_bytes_per_token" not in source


def test_emitted_pmf_check():
    assert "Correct" in ch09.check_emitted_pmf(_pmf)
    def shifted(a, k):          # a distribution, with the wrong weights
        head = [a ** j * (1 - a) for j in range(1, k + 1)]
        return [*head, 1 - sum(head)]

    text = _fails(ch09.check_emitted_pmf, shifted)
    assert "revisit" in text and "high" not in text and "low" not in text
    _fails(ch09.check_emitted_pmf, lambda a, k: _pmf(a, k)[:-1], match="entries")
    _fails(ch09.check_emitted_pmf, lambda a, k: [1.0] * (k + 1), match="not a distribution")
    expected_length = lambda a, k: sum(a ** i for i in range(k + 1))
    _fails(ch09.check_emitted_pmf, expected_length, match="list of numbers")
    with pytest.raises(NotYetAnswered):
        ch09.check_emitted_pmf(...)


def test_point_mass_residual_check():
    def right(p, x):
        return [0.0 if i == x else a / (1 - p[x]) for i, a in enumerate(p)]

    assert "Correct" in ch09.check_point_mass_residual(right)
    _fails(ch09.check_point_mass_residual, lambda p, x: list(p), match="just rejected")
    _fails(ch09.check_point_mass_residual,
           lambda p, x: [0.0 if i == x else a for i, a in enumerate(p)],
           match="not a distribution")

    def flat(p, x):
        return [0.0 if i == x else 1 / (len(p) - 1) for i in range(len(p))]

    _fails(ch09.check_point_mass_residual, flat, match="wrong weights")


def test_fixed_step_check_catches_the_colleague_and_passes_a_fix():
    import random

    def fixed(p, q, x, rng):
        if rng.random() < min(1.0, p[x] / q[x]):
            return x
        residual = [max(a - b, 0.0) for a, b in zip(p, q, strict=True)]
        return rng.choices(range(len(p)), weights=residual)[0]

    assert "Fixed" in ch09.check_fixed_step(fixed)
    colleague = _fails(ch09.check_fixed_step, ch09.colleague_step, match="not distributed")
    for word in ("uniform", "same random", "reuse", "twice", "correlat", "often", "rarely"):
        assert word not in colleague.lower()
    target_only = _fails(ch09.check_fixed_step,
                         lambda p, q, x, rng: rng.choices(range(len(p)), weights=p)[0],
                         match="not kept at the rule's rate")
    assert "follows p" in target_only and "rarely" not in target_only
    _fails(ch09.check_fixed_step, lambda p, q, x, rng: 9, match="token id")
    # the colleague really is wrong: its exact output distribution differs from p
    p, q = ch09._PAIRS[0]
    rng = random.Random(0)
    counts = [0] * 5
    for _ in range(50_000):
        x = rng.choices(range(5), weights=q)[0]
        counts[ch09.colleague_step(p, q, x, rng)] += 1
    assert max(abs(c / 50_000 - a) for c, a in zip(counts, p, strict=True)) > 0.02


def test_deployment_check_has_no_direction_and_grades_on_the_cost_model():
    from kvlab.sim.costmodel import speculative_step_cost

    target, draft = ch09.deployment_cost_models()
    d = ch09.DESIGN
    speed = {k: 1.0 if k == 0 else speculative_step_cost(
        target, draft, batch=d["batch"], k=k, alpha=d["alpha"], context=d["context"],
        draft_forwards=k).speedup for k in d["k_choices"]}
    best = max(speed.values())
    passing = {k for k, v in speed.items() if v >= (1 - d["tolerance"]) * best}
    assert 0 not in passing and len(passing) < len(speed) - 2
    for k in d["k_choices"]:
        if k in passing:
            assert "Good" in ch09.check_deployment_k(k, speed[k])
            # the right k with a speedup it does not give fails, without the direction
            for off in (0.9, 1.1):
                text = _fails(ch09.check_deployment_k, k, off * speed[k],
                              match="not the speedup")
                assert "high" not in text and "low" not in text
        else:
            text = _fails(ch09.check_deployment_k, k, speed[k])
            assert "larger" not in text and "smaller" not in text and "x" not in text.split(
                "k=")[-1].split()[0][1:]
    # trying every k without computing its speedup fails on the speedup, not on the k
    best_k = max(speed, key=speed.get)
    _fails(ch09.check_deployment_k, best_k, 1.0, match="not the speedup")
    _fails(ch09.check_deployment_k, 9, 1.0, match="choose an int")
    _fails(ch09.check_deployment_k, True, 1.0, match="choose an int")
    _fails(ch09.check_deployment_k, best_k, "fast", match="is a number")
    with pytest.raises(NotYetAnswered):
        ch09.check_deployment_k(best_k, ...)


def test_acceptance_figure_draws_plain_data():
    pytest.importorskip("matplotlib")
    from kvlab.labs.speculation.acceptance import AcceptanceData
    from kvlab.viz.spec import acceptance_figure

    data = AcceptanceData("draft_model", 3, 0.8, (0.7, 0.5, 0.3),
                          {"req 0": ((1, 2), (2, 4)), "req 1": ((1, 1),)},
                          ((0.1, 0.4), (0.05, 0.3)), 0.7, 2.3)
    fig = acceptance_figure(data)
    assert len(fig.axes) == 3
    assert "2 rejected drafts" in fig.axes[2].get_title()


def test_both_alphas_are_drawn_and_the_caption_says_why_they_differ():
    pytest.importorskip("matplotlib")
    from kvlab.labs.speculation.acceptance import AcceptanceData
    from kvlab.viz.spec import acceptance_caption, acceptance_figure, conditional_rates

    # a first draft kept 60% of the time, later ones (once reached) more often
    data = AcceptanceData("draft_model", 3, 0.8, (0.6, 0.5, 0.45), {"req 0": ((1, 2),)},
                          ((0.1, 0.4),), 0.75, 2.5)
    assert conditional_rates(data) == pytest.approx((0.6, 0.5 / 0.6, 0.9))
    labels = [t.get_text() for t in acceptance_figure(data).axes[0].get_legend().get_texts()]
    assert any("0.60" in t and "first position" in t for t in labels)
    assert any("0.75" in t and "all positions" in t for t in labels)
    caption = acceptance_caption(data)
    assert "alpha_1 = 0.60" in caption and "alpha-hat = 0.75" in caption
    assert "kept more often" in caption and "0.60, 0.83, 0.90" in caption
    assert "not independent" in caption
    same = AcceptanceData("draft_model", 2, 0.8, (0.7, 0.49), {"req 0": ((1, 2),)},
                          ((0.1, 0.4),), 0.71, 2.2)
    assert "hardly depends on the position" in acceptance_caption(same)
    one = AcceptanceData("draft_model", 1, 0.8, (0.62,), {"req 0": ((1, 2),)},
                         ((0.1, 0.4),), 0.62, 1.6)
    assert "same estimate" in acceptance_caption(one)
    fewer = AcceptanceData("draft_model", 2, 0.8, (0.7, 0.2), {"req 0": ((1, 2),)},
                           ((0.1, 0.4),), 0.5, 1.9)
    assert "kept less often" in acceptance_caption(fewer)


def test_an_empty_ngram_panel_says_why():
    pytest.importorskip("matplotlib")
    from kvlab.labs.speculation.acceptance import AcceptanceData
    from kvlab.viz.spec import acceptance_caption, acceptance_figure

    empty = AcceptanceData("ngram", 4, 0.0, (0.0, 0.0, 0.0, 0.0),
                           {"req 0": ((7, 1), (14, 1))}, ((1.0, 0.2), (1.0, 0.1)), 0.0, 1.0)
    texts = " ".join(t.get_text() for t in acceptance_figure(empty).axes[0].texts)
    assert "n-gram drafts copy" in texts and "rejected" in texts
    assert "rarely repeats itself" in acceptance_caption(empty)
    kept = AcceptanceData("draft_model", 2, 0.8, (0.6, 0.4), {"req 0": ((1, 2),)},
                          ((0.1, 0.4),), 0.6, 2.0)
    assert not acceptance_figure(kept).axes[0].texts         # only where the panel is empty
    assert "rarely" not in acceptance_caption(kept)


def test_speedup_figure_marks_the_roof_of_each_point():
    pytest.importorskip("matplotlib")
    from kvlab.sim.costmodel import speculative_step_cost
    from kvlab.viz.spec import speedup_figure

    target, draft = ch09.deployment_cost_models()
    curve = [speculative_step_cost(target, draft, batch=b, k=4, alpha=0.6, context=1024)
             for b in (1, 64, 256)]
    fig = speedup_figure({"k=4": curve}, max_batch=300)
    ax = fig.axes[0]
    points = [ln for ln in ax.lines if ln.get_marker() == "o" and len(ln.get_xdata()) == 1]
    assert [p.get_xdata()[0] for p in points] == [1, 64, 256]
    hollow = [p.get_markerfacecolor() == "white" for p in points]
    assert hollow == [c.verify_bound == "memory" for c in curve] == [True, True, False]
    assert any("memory full: 300" in t.get_text() for t in ax.get_legend().get_texts())
    with pytest.raises(ValueError, match="ascend"):
        speedup_figure({"k=4": curve[::-1]})
    # a batch whose KV does not fit the GPUs is not plotted: it is not a deployment
    over = speculative_step_cost(target, draft, batch=512, k=4, alpha=0.6, context=1024)
    with pytest.raises(ValueError, match="batch 512 needs"):
        speedup_figure({"k=4": [*curve, over]})
