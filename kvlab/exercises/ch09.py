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

from kvlab.exercises._common import require_answer, sealed

__all__ = ["CONTEXT_CHOICES", "CONTEXT_MS_RTOL", "DESIGN", "PREDICT", "check_context_effect",
           "check_deployment_k", "check_emitted_pmf", "check_fixed_step",
           "check_point_mass_residual", "colleague_step", "deployment_cost_models"]

#: Exercise 1: the setting (batch, drafts, acceptance, the two contexts; a proposer of ``k``
#: draft forwards). Batch 8 is the largest power of two whose KV fits four H100s at 32,768
#: tokens.
PREDICT = {"batch": 8, "k": 4, "alpha": 0.6, "contexts": (1024, 32768)}
CONTEXT_CHOICES = ("rises", "falls", "unchanged")
#: The extra milliseconds of exercise 1 pass within this relative tolerance.
CONTEXT_MS_RTOL = 0.01

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


def check_context_effect(extra_decode_ms, extra_draft_ms, prediction) -> str:
    """Exercise 1, three linked answers at :data:`PREDICT`'s batch, ``k`` and ``alpha`` when
    every request's context grows from the first to the second of ``PREDICT["contexts"]``: how
    many milliseconds the plain decode step gains (``extra_decode_ms``), how many the ``k``
    draft forwards gain together (``extra_draft_ms``), each within :data:`CONTEXT_MS_RTOL`,
    and whether the speedup then rises, falls or stays within 1 % (``prediction``, one of
    :data:`CONTEXT_CHOICES`). The two times are graded first: the direction follows from
    them."""
    require_answer(extra_decode_ms, "the decode step's extra milliseconds (a number)")
    require_answer(extra_draft_ms, "the draft forwards' extra milliseconds (a number)")
    require_answer(prediction, "one of " + ", ".join(repr(c) for c in CONTEXT_CHOICES))
    for label, value in (("extra_decode_ms", extra_decode_ms),
                         ("extra_draft_ms", extra_draft_ms)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise AssertionError(f"give {label} as a number of milliseconds, got {value!r}")
    if prediction not in CONTEXT_CHOICES:
        raise AssertionError(f"answer one of {CONTEXT_CHOICES}, got {prediction!r}")
    revisit = {
        "decode_ms": "the decode step's extra time is not right: revisit which bytes a "
                     "memory-bound decode step reads for each request, and how much bandwidth "
                     "the tensor-parallel GPUs give it",
        "draft_ms": "the draft forwards' extra time is not right: revisit whose cache a draft "
                    "forward reads, how many bytes a token takes in it, and how many draft "
                    "forwards a step runs",
    }
    problems = []
    for key, got in (("decode_ms", extra_decode_ms), ("draft_ms", extra_draft_ms)):
        truth = sealed(f"ch09.context_effect.{key}").value()
        if abs(got - truth) > CONTEXT_MS_RTOL * truth:     # the idea, never the direction
            problems.append(revisit[key])
    if problems:
        raise AssertionError("; ".join(problems))
    truth = sealed("ch09.context_effect")      # each option's verdict is sealed under it
    if truth.is_answer(prediction):
        return truth.note(prediction)
    raise AssertionError(truth.note(prediction))


def check_emitted_pmf(fn: Callable[[float, int], Sequence[float]]) -> str:
    """Exercise 2: ``fn(alpha, k)`` -> ``k + 1`` probabilities, entry ``j - 1`` the probability
    that one verification emits exactly ``j`` tokens when each draft is kept independently
    with probability ``alpha`` (the bonus token included)."""
    require_answer(fn, "your function (alpha, k) -> list of k + 1 probabilities")
    if not callable(fn):
        raise AssertionError("pass a function (alpha, k) -> list of k + 1 probabilities")
    rng = random.Random(9)
    cases = [(0.0, 3), (1.0, 4), (0.5, 1)] + [(rng.random(), rng.randint(1, 10))
                                              for _ in range(60)]
    for alpha, k in cases:
        got = fn(alpha, k)
        try:
            got = [float(x) for x in got]
        except TypeError:
            raise AssertionError(f"alpha={alpha:.3f}, k={k}: return a list of numbers, got "
                                 f"{type(got).__name__}") from None
        if len(got) != k + 1:
            raise AssertionError(f"k={k}: {len(got)} entries; a step emits between 1 and "
                                 f"k + 1 tokens, one entry each")
        if any(x < -1e-12 for x in got) or not math.isclose(sum(got), 1.0, abs_tol=1e-9):
            raise AssertionError(f"alpha={alpha:.3f}, k={k}: not a distribution (negative "
                                 "entries, or they do not sum to 1)")
        want = [alpha ** (j - 1) * (1 - alpha) for j in range(1, k + 1)] + [alpha ** k]
        for j, (g, w) in enumerate(zip(got, want, strict=True), start=1):
            if not math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-9):
                raise AssertionError(f"alpha={alpha:.3f}, k={k}: P(emit {j} tokens) is not "
                                     "right: revisit which drafts must be kept, and which "
                                     f"rejected, for a step to emit exactly {j}")
    return "Correct on 63 (alpha, k) pairs. Its mean is the expected length of the chapter."


def check_point_mass_residual(fn: Callable[[Sequence[float], int], Sequence[float]]) -> str:
    """Exercise 3: ``fn(p, x)`` -> the distribution a rejection samples from when the proposer
    put all its probability on the draft ``x`` (an n-gram match, or an argmax draft)."""
    require_answer(fn, "your function (p, x) -> list of probabilities")
    if not callable(fn):
        raise AssertionError("pass a function (p, x) -> list of probabilities")
    rng = random.Random(5)
    for trial in range(100):
        v = rng.randint(2, 8)
        p = [rng.random() ** 2 + 1e-3 for _ in range(v)]
        p = [a / sum(p) for a in p]
        x = rng.randrange(v)
        want = [0.0 if i == x else a / (1 - p[x]) for i, a in enumerate(p)]
        got = [float(a) for a in fn(list(p), x)]
        if len(got) != v:
            raise AssertionError(f"trial {trial}: {len(got)} entries for a vocabulary of {v}")
        if any(a < -1e-12 for a in got) or not math.isclose(sum(got), 1.0, abs_tol=1e-9):
            raise AssertionError(f"trial {trial}: not a distribution (negative entries, or it "
                                 "does not sum to 1)")
        if got[x] > 1e-12:
            raise AssertionError(f"trial {trial}: a rejection must never emit the token it "
                                 "just rejected")
        if any(not math.isclose(g, w, abs_tol=1e-9) for g, w in zip(got, want, strict=True)):
            raise AssertionError(f"trial {trial}: right support, wrong weights (compare with "
                                 "the residual rule for this q)")
    return "Correct on 100 random (p, x): the same rule as the residual, for a one-hot q."


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
                f"{trials:,} trials): revisit the exactness proof, and what it assumes about "
                "the draw made after a rejection")
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
