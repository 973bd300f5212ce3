"""Chapter 9 exercises: what a longer context costs a speculative step, the distribution of a
step, a point-mass proposer, a colleague's verifier, and a deployment choice on the roofline.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it with the roofline cost model of :mod:`kvlab.sim.costmodel`);
the other checks test the reader's code or number (exact probabilities, the cost model). Each
raises ``AssertionError`` naming what is wrong and the idea to revisit — which property fails,
which quantity is off — never the direction of an error, the expected answer, the right option
or the method. Every roofline scenario here fits its GPUs' memory (``SpecStepCost.fits``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from kvlab.exercises._common import earlier_prediction, graded_once, require_answer, sealed

__all__ = ["CONTEXT_CHOICES", "CONTEXT_LIMIT_RTOL", "DESIGN", "PREDICT", "check_context_effect",
           "check_deployment_k", "check_emitted_pmf", "check_fixed_step",
           "check_point_mass_residual", "colleague_step", "deployment_cost_models",
           "probabilities"]

#: Exercise 1: the setting (batch, drafts, acceptance, the two contexts; a proposer of ``k``
#: draft forwards). Batch 8 is the largest power of two whose KV fits four H100s at 32,768
#: tokens.
PREDICT = {"batch": 8, "k": 4, "alpha": 0.6, "contexts": (1024, 32768)}
CONTEXT_CHOICES = ("rises", "falls", "unchanged")
#: Exercise 1's limit passes within this relative tolerance.
CONTEXT_LIMIT_RTOL = 0.01

#: Exercise 5: the deployment (4 x H100, Llama-3-70B target, Llama-3-8B draft).
DESIGN = {"batch": 32, "context": 8192, "alpha": 0.8, "k_choices": tuple(range(0, 9)),
          "tolerance": 0.02}


def deployment_cost_models():
    """The ``(target, draft)`` cost models of exercises 1 and 5: Llama-3-70B and Llama-3-8B in
    bf16 on four H100s each (tensor parallel 4; vLLM requires the draft's TP to equal the
    target's)."""
    from kvlab.sim.costmodel import RooflineCostModel

    return (RooflineCostModel.named("Llama-3-70B", "H100-80GB SXM", tp=4),
            RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM", tp=4))


def _cost(batch: int, k: int, alpha: float, context: int):
    from kvlab.sim.costmodel import speculative_step_cost

    target, draft = deployment_cost_models()
    cost = speculative_step_cost(target, draft, batch=batch, k=k, alpha=alpha,
                                 context=context, draft_forwards=k)
    assert cost.fits, f"exercise scenario does not fit: batch {batch} at {context} tokens"
    return cost


def _speedup(batch: int, k: int, alpha: float, context: int) -> float:
    return 1.0 if k == 0 else _cost(batch, k, alpha, context).speedup


def check_context_effect(prediction, speedup_limit) -> str:
    """Exercise 1, two linked answers, graded together and once, at :data:`PREDICT`'s batch,
    ``k`` and ``alpha`` when every request's context grows from the first to the second of
    ``PREDICT["contexts"]``: whether the speedup then rises, falls or stays within 1 %
    (``prediction``, one of :data:`CONTEXT_CHOICES`), and the value the speedup tends to as the
    context grows without bound (``speedup_limit``, within :data:`CONTEXT_LIMIT_RTOL`; the
    cost model prints neither). The first wrong pair is recorded
    (:func:`~kvlab.exercises._common.earlier_prediction`); a later answer is not graded."""
    require_answer(prediction, "one of " + ", ".join(repr(c) for c in CONTEXT_CHOICES))
    require_answer(speedup_limit, "the speedup's limit at unbounded context (a number)")
    if prediction not in CONTEXT_CHOICES:
        raise AssertionError(f"answer one of {CONTEXT_CHOICES}, got {prediction!r}")
    if isinstance(speedup_limit, bool) or not isinstance(speedup_limit, (int, float)) \
            or not math.isfinite(speedup_limit) or speedup_limit <= 0:
        raise AssertionError(f"give the limit as a positive number (a speedup), got "
                             f"{speedup_limit!r}")
    direction = sealed("ch09.context_effect")      # the right option's verdict is sealed
    limit = sealed("ch09.context_effect.limit").value()
    right = direction.is_answer(prediction) and \
        abs(speedup_limit - limit) <= CONTEXT_LIMIT_RTOL * limit
    answer = [prediction, round(float(speedup_limit), 4)]
    first = earlier_prediction("ch09.context_effect", answer, right)
    if first is not None:
        return graded_once(first)
    if not right:                # one message whichever of the two is wrong: no direction
        raise AssertionError("the pair is not right: revisit which forwards of a speculative "
                             "step read the context, how many times each and from which "
                             "model's cache, and what is left of the speedup's ratio once "
                             "those reads are all that grows")
    return direction.note(prediction)


def _pmf_cases() -> list[tuple[float, int]]:
    """Exercise 2's ``(alpha, k)`` cases: the edges, then seeded random ones."""
    rng = random.Random(9)
    return [(0.0, 3), (1.0, 4), (0.5, 1)] + [(round(rng.random(), 6), rng.randint(1, 10))
                                             for _ in range(37)]


def _point_mass_cases() -> list[tuple[list[float], int]]:
    """Exercise 3's ``(p, x)`` cases: seeded random distributions over 2-8 tokens."""
    rng = random.Random(5)
    out = []
    for _ in range(40):
        v = rng.randint(2, 8)
        p = [rng.random() ** 2 + 1e-3 for _ in range(v)]
        out.append(([a / sum(p) for a in p], rng.randrange(v)))
    return out


def probabilities(values) -> list[float]:
    """The form a distribution is compared in (sealed and the reader's alike): floats rounded
    to 8 decimals, so that two exact ways of computing it agree."""
    return [round(float(v), 8) + 0.0 for v in values]


def _wrong_cases(fn, key: str, cases) -> list[int]:
    return [i for i, args in enumerate(cases)
            if not sealed(f"{key}.{i}").is_answer(probabilities(fn(*args)))]


def _as_distribution(got, size: int, where: str) -> list[float]:
    try:
        got = [float(x) for x in got]
    except (TypeError, ValueError):
        raise AssertionError(f"{where}: return a list of numbers, got "
                             f"{type(got).__name__}") from None
    if len(got) != size:
        raise AssertionError(f"{where}: {len(got)} entries, expected {size}")
    if any(x < -1e-12 for x in got) or not math.isclose(sum(got), 1.0, abs_tol=1e-9):
        raise AssertionError(f"{where}: not a distribution (negative entries, or they do not "
                             "sum to 1)")
    return got


def check_emitted_pmf(fn: Callable[[float, int], Sequence[float]]) -> str:
    """Exercise 2: ``fn(alpha, k)`` -> ``k + 1`` probabilities, entry ``j - 1`` the probability
    that one verification emits exactly ``j`` tokens when each draft is kept independently
    with probability ``alpha`` (the bonus token included). Run on 40 ``(alpha, k)`` cases whose
    answers are sealed (compared as :func:`probabilities`)."""
    require_answer(fn, "your function (alpha, k) -> list of k + 1 probabilities")
    if not callable(fn):
        raise AssertionError("pass a function (alpha, k) -> list of k + 1 probabilities")
    cases = _pmf_cases()
    for alpha, k in cases:
        _as_distribution(fn(alpha, k), k + 1, f"alpha={alpha:.3f}, k={k} (a step emits 1 to "
                                              "k + 1 tokens, one entry each)")
    wrong = _wrong_cases(fn, "ch09.emitted_pmf", cases)
    if wrong:
        raise AssertionError(f"not the distribution of a step's length on {len(wrong)} of "
                             f"{len(cases)} (alpha, k) cases: revisit which drafts must be "
                             "kept, and which rejected, for a step to emit exactly j tokens, "
                             "and what the bonus token adds")
    return (f"Correct on {len(cases)} (alpha, k) pairs. Its mean is the expected length of "
            "the chapter.")


def check_point_mass_residual(fn: Callable[[Sequence[float], int], Sequence[float]]) -> str:
    """Exercise 3: ``fn(p, x)`` -> the distribution a rejection samples from when the proposer
    put all its probability on the draft ``x`` (an n-gram match, or an argmax draft). Run on 40
    random ``(p, x)`` whose answers are sealed (compared as :func:`probabilities`)."""
    require_answer(fn, "your function (p, x) -> list of probabilities")
    if not callable(fn):
        raise AssertionError("pass a function (p, x) -> list of probabilities")
    cases = _point_mass_cases()
    for trial, (p, x) in enumerate(cases):
        got = _as_distribution(fn(list(p), x), len(p), f"trial {trial} (one entry per token "
                                                       "of the vocabulary)")
        if got[x] > 1e-12:
            raise AssertionError(f"trial {trial}: a rejection must never emit the token it "
                                 "just rejected")
    wrong = _wrong_cases(fn, "ch09.point_mass_residual", [(list(p), x) for p, x in cases])
    if wrong:
        raise AssertionError(f"right support, wrong weights on {len(wrong)} of {len(cases)} "
                             "trials: revisit the residual rule, with this proposer's q in it")
    return (f"Correct on {len(cases)} random (p, x): the same rule as the residual, for a "
            "one-hot q.")


def colleague_step(p: Sequence[float], q: Sequence[float], x: int, rng: random.Random) -> int:
    """A colleague's one-position verifier (exercise 4): keep the draft ``x`` with probability
    ``min(1, p[x] / q[x])``, otherwise sample the residual. ``rng``: a ``random.Random``."""
    u = rng.random()
    if u < min(1.0, p[x] / q[x]):
        return x
    residual = [max(a - b, 0.0) for a, b in zip(p, q, strict=True)]
    total = sum(residual)
    acc = 0.0
    for token, r in enumerate(residual):
        acc += r / total
        if u < acc:
            return token
    return max(range(len(p)), key=residual.__getitem__)


_PAIRS = (
    ((0.40, 0.25, 0.20, 0.10, 0.05), (0.20, 0.45, 0.05, 0.25, 0.05)),
    ((0.05, 0.50, 0.20, 0.15, 0.10), (0.30, 0.30, 0.10, 0.10, 0.20)),
    ((0.30, 0.30, 0.20, 0.10, 0.10), (0.10, 0.10, 0.20, 0.30, 0.30)),
)


def _measure(fn, p, q, trials: int, seed: int) -> tuple[list[float], float]:
    draws, verify = random.Random(seed), random.Random(seed + 1)
    counts = [0] * len(p)
    kept = 0
    for _ in range(trials):
        x = draws.choices(range(len(q)), weights=q)[0]
        token = fn(list(p), list(q), x, verify)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < len(p):
            raise AssertionError(f"return a token id in 0..{len(p) - 1}, got {token!r}")
        counts[token] += 1
        kept += token == x
    return [c / trials for c in counts], kept / trials


def check_fixed_step(fn) -> str:
    """Exercise 4: ``fn(p, q, x, rng) -> token`` with :func:`colleague_step`'s signature. It
    passes when, over 20,000 seeded trials on each of three pairs ``(p, q)`` with drafts
    ``x ~ q``, its output frequencies match ``p`` (chi-squared below the 0.01 % critical
    value) and it keeps the draft as often as the exact rule does."""
    require_answer(fn, "your corrected step function (p, q, x, rng) -> token")
    if not callable(fn):
        raise AssertionError("pass a function (p, q, x, rng) -> token")
    trials = 20_000
    for n, (p, q) in enumerate(_PAIRS):
        freq, kept = _measure(fn, p, q, trials, seed=100 + n)
        chi2 = trials * sum((f - a) ** 2 / a for f, a in zip(freq, p, strict=True))
        if chi2 > 25.0:                    # chi-squared, 4 degrees of freedom, p = 1e-4
            raise AssertionError(
                f"pair {n}: the output is not distributed as p (chi-squared {chi2:.0f} over "
                f"{trials:,} trials): revisit the exactness proof as a whole")
        beta = sum(min(a, b) for a, b in zip(p, q, strict=True))
        if abs(kept - beta) > 4 * math.sqrt(beta * (1 - beta) / trials):
            raise AssertionError(f"pair {n}: the output follows p, but the draft is not kept "
                                 "at the rule's rate: a verifier should keep every draft the "
                                 "rule accepts, and only those")
    return "Fixed: exact on all three pairs, and it keeps drafts at the rule's rate."


def check_deployment_k(k, speedup=None) -> str:
    """Exercise 5: the ``k`` (0 = no speculation) for :data:`DESIGN`'s deployment whose
    roofline throughput is within ``DESIGN["tolerance"]`` of the best choice in
    ``DESIGN["k_choices"]`` (a proposer of ``k`` draft forwards per step), and ``speedup``, the
    speedup over plain decoding the cost model gives that ``k`` (1.0 for ``k = 0``), within
    1 %. Both must be right: the speedup is what makes the choice a measured one."""
    require_answer(k, "your k (an int; 0 turns speculation off)")
    require_answer(speedup, "the speedup your k gives (a number)")
    if isinstance(k, bool) or not isinstance(k, int) or k not in DESIGN["k_choices"]:
        raise AssertionError(f"choose an int k in {DESIGN['k_choices'][0]}.."
                             f"{DESIGN['k_choices'][-1]}")
    try:
        claimed = float(speedup)
    except (TypeError, ValueError):
        raise AssertionError(f"the speedup is a number, got {speedup!r}") from None
    if not claimed > 0:
        raise AssertionError(f"a speedup is a positive number, got {speedup!r}")
    b, c, a = DESIGN["batch"], DESIGN["context"], DESIGN["alpha"]
    got = _speedup(b, k, a, c)
    if abs(claimed - got) > 0.01 * got:
        raise AssertionError(f"{claimed:.3g} is not the speedup of k={k} at this deployment "
                             "(off by more than 1 %)")
    verdict = sealed("ch09.deployment_k").note(k)     # sealed for every k of the choices
    if not verdict.startswith("Good"):
        raise AssertionError(verdict)
    return verdict
