"""Chapter 9 exercises: speculative decoding's arithmetic and its exactness.

Each check computes the truth itself (the verifier of :mod:`kvlab.engine.spec_decode`, or the
formulas of Leviathan et al. 2023) and raises ``AssertionError`` with a hint that says what is
wrong — too high, too low, which property fails — without printing the expected answer.
"""

from __future__ import annotations

import math
import random

from ._common import require_answer

__all__ = ["EXAMPLE_P", "EXAMPLE_Q", "check_acceptance_probability", "check_best_k",
           "check_buggy_tv", "check_expected_length", "check_residual"]

#: The target and draft distributions of exercises 3 and 5 (five tokens).
EXAMPLE_P = (0.40, 0.25, 0.20, 0.10, 0.05)
EXAMPLE_Q = (0.20, 0.45, 0.05, 0.25, 0.05)


def _direction(got: float, want: float) -> str:
    return "too high" if got > want else "too low"


def check_expected_length(fn) -> str:
    """``fn(alpha, k) -> float``: expected tokens emitted per verification when each of ``k``
    drafts is accepted independently with probability ``alpha`` (the bonus token included)."""
    require_answer(fn, "your expected-length function")
    if not callable(fn):
        raise AssertionError("pass a function (alpha, k) -> expected tokens per step")
    rng = random.Random(9)
    cases = [(0.0, 3), (0.5, 0), (0.999999, 4)] + [(rng.random(), rng.randint(1, 10))
                                                   for _ in range(100)]
    for alpha, k in cases:
        want = sum(alpha ** i for i in range(k + 1))
        got = float(fn(alpha, k))
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9):
            hint = ("with alpha = 0 only the token after the first rejection is emitted"
                    if alpha == 0 else "with k = 0 a step emits exactly one token" if k == 0
                    else "as alpha -> 1 every draft and the bonus token are emitted"
                    if alpha > 0.99 else "count the bonus token; draft i survives with "
                    "probability alpha^i")
            raise AssertionError(f"alpha={alpha:.3f}, k={k}: your value is "
                                 f"{_direction(got, want)} ({hint}).")
    return "Correct: your formula matches on 103 (alpha, k) pairs."


def check_residual(fn) -> str:
    """``fn(p, q) -> list[float]``: the distribution a rejection samples from."""
    require_answer(fn, "your residual function")
    if not callable(fn):
        raise AssertionError("pass a function (p, q) -> list of probabilities")
    rng = random.Random(5)
    for trial in range(100):
        v = rng.randint(2, 8)
        p = [rng.random() ** 2 for _ in range(v)]
        q = [rng.random() ** 2 for _ in range(v)]
        p = [x / sum(p) for x in p]
        q = [x / sum(q) for x in q]
        raw = [max(a - b, 0.0) for a, b in zip(p, q, strict=True)]
        want = [x / sum(raw) for x in raw]
        got = [float(x) for x in fn(list(p), list(q))]
        if len(got) != v:
            raise AssertionError(f"trial {trial}: {len(got)} entries for a vocabulary of {v}")
        if any(x < -1e-12 for x in got) or not math.isclose(sum(got), 1.0, abs_tol=1e-9):
            raise AssertionError(f"trial {trial}: not a distribution (negative entries, or it "
                                 "does not sum to 1)")
        if any(g > 1e-12 and a <= b for g, a, b in zip(got, p, q, strict=True)):
            raise AssertionError(f"trial {trial}: mass on a token where q >= p: a rejection "
                                 "must never produce a token the draft already over-proposes")
        if any(not math.isclose(g, w, abs_tol=1e-9) for g, w in zip(got, want, strict=True)):
            raise AssertionError(f"trial {trial}: right support, wrong weights: they should be "
                                 "proportional to how much p exceeds q")
    return "Correct: your residual is exact on 100 random pairs (p, q)."


def check_acceptance_probability(answer) -> str:
    """The probability that a draft sampled from ``EXAMPLE_Q`` is accepted against
    ``EXAMPLE_P`` (one position)."""
    require_answer(answer, "the acceptance probability")
    want = sum(min(a, b) for a, b in zip(EXAMPLE_P, EXAMPLE_Q, strict=True))
    got = float(answer)
    if not math.isclose(got, want, abs_tol=1e-6):
        raise AssertionError(f"Your value is {_direction(got, want)}. Sum over tokens: "
                             "P(draft x) * P(accept x | x).")
    return "Correct: and 1 minus it is the total-variation distance between p and q."


def check_buggy_tv(answer) -> str:
    """A buggy verifier resamples from ``p`` (not the residual) after a rejection. Its output
    distribution differs from ``EXAMPLE_P``: give the total-variation distance."""
    require_answer(answer, "the total-variation distance")
    accept = [min(a, b) for a, b in zip(EXAMPLE_P, EXAMPLE_Q, strict=True)]
    reject = 1 - sum(accept)
    out = [a + reject * p for a, p in zip(accept, EXAMPLE_P, strict=True)]
    want = 0.5 * sum(abs(o - p) for o, p in zip(out, EXAMPLE_P, strict=True))
    got = float(answer)
    if not math.isclose(got, want, abs_tol=1e-6):
        raise AssertionError(f"Your value is {_direction(got, want)}. Output(x) = "
                             "q(x)·min(1, p/q) + P(reject)·p(x); TV = half the L1 distance.")
    return "Correct: small, but a χ² test with a few thousand samples sees it."


def check_best_k(alpha: float, c: float, k) -> str:
    """Open design question: with acceptance ``alpha`` and draft/target cost ratio ``c``, which
    ``k`` maximises Leviathan et al.'s speedup ``(1 - alpha^(k+1)) / ((1 - alpha)(c k + 1))``?
    Any answer within 1 % of the best speedup passes."""
    require_answer(k, "your choice of k")
    if not isinstance(k, int) or k < 1:
        raise AssertionError("k must be an int >= 1")

    def speedup(n: int) -> float:
        return sum(alpha ** i for i in range(n + 1)) / (c * n + 1)

    best = max(speedup(n) for n in range(1, 65))
    got = speedup(k)
    if got < 0.99 * best:
        better = "larger" if speedup(k + 1) > got else "smaller"
        raise AssertionError(f"k={k} gives {got:.3f}x, {100 * (1 - got / best):.1f} % below "
                             f"the best k: try a {better} one.")
    return f"Good: k={k} gives {got:.3f}x, within 1 % of the best."
