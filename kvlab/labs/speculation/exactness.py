"""Statistics for checking that speculation leaves the output distribution unchanged.

A χ² goodness-of-fit test of observed token counts against exactly computed target
probabilities (cells with small expectation pooled), its p-value from the regularised upper
incomplete gamma function (no SciPy needed), and its power against a total-variation error,
estimated by simulation with the least favourable error of that size (:func:`tv_perturbation`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

__all__ = ["chi2_sf", "chi_square_test", "power_against_tv", "tv_perturbation"]


def chi2_sf(x: float, df: int) -> float:
    """``P(X >= x)`` for ``X ~ χ²(df)``: ``Q(df/2, x/2)`` by series / continued fraction."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    lead = math.exp(-z + a * math.log(z) - math.lgamma(a))
    if z < a + 1:                          # P by its series, Q = 1 - P
        term = total = 1.0 / a
        n = a
        while term > total * 1e-15:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - lead * total)
    b, c, d = z + 1 - a, 1e300, 1.0 / (z + 1 - a)   # Q by Lentz's continued fraction
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return lead * h


def _pool(probs: Sequence[float], n: int, min_expected: float) -> list[list[int]]:
    """Cells (indices) sorted by probability; the smallest pooled until each group expects
    at least ``min_expected``."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    groups: list[list[int]] = []
    tail: list[int] = []
    for i in order:
        if n * probs[i] >= min_expected:
            groups.append([i])
        else:
            tail.append(i)
    if tail:
        if n * sum(probs[i] for i in tail) >= min_expected or not groups:
            groups.append(tail)
        else:
            groups[-1].extend(tail)
    return groups


def chi_square_test(counts: Mapping[object, int], probs: Mapping[object, float],
                    min_expected: float = 5.0) -> tuple[float, int, float]:
    """``(statistic, df, p-value)`` of observed ``counts`` against exact ``probs`` (keys are
    outcomes; an observed outcome of probability 0 gives p-value 0)."""
    n = sum(counts.values())
    if any(probs.get(key, 0.0) <= 0 for key, c in counts.items() if c):
        return math.inf, 0, 0.0
    keys = list(probs)
    p = [probs[k] for k in keys]
    groups = _pool(p, n, min_expected)
    stat = 0.0
    for g in groups:
        expected = n * sum(p[i] for i in g)
        observed = sum(counts.get(keys[i], 0) for i in g)
        stat += (observed - expected) ** 2 / expected
    df = max(1, len(groups) - 1)
    return stat, df, chi2_sf(stat, df)


def tv_perturbation(probs: Sequence[float], tv: float) -> list[float]:
    """A distribution at total-variation distance ``tv`` from ``probs`` that a χ² test finds
    hardest: mass ``tv`` moved proportionally from the likelier half of the cells to the
    rest (the χ² distance ``Σ δ²/p`` is then ``tv² (1/P(A) + 1/P(B))``, near its minimum
    ``4 tv²``)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    a, mass = [], 0.0
    for i in order:
        if mass >= 0.5:
            break
        a.append(i)
        mass += probs[i]
    pa = sum(probs[i] for i in a)
    pb = 1.0 - pa
    if not 0 < tv < min(pa, pb):
        raise ValueError(f"tv={tv} must lie in (0, {min(pa, pb):.3f}) for these cells")
    return [p * (1 - tv / pa) if i in a else p * (1 + tv / pb) for i, p in enumerate(probs)]


def power_against_tv(probs: Sequence[float], n: int, tv: float, alpha: float,
                     trials: int = 400, seed: int = 0) -> float:
    """Share of ``trials`` samples of size ``n`` from :func:`tv_perturbation` that the test
    rejects at level ``alpha`` (the test's power against that error)."""
    bad = torch.tensor(tv_perturbation(probs, tv), dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    exact = dict(enumerate(probs))
    hits = 0
    for _ in range(trials):
        draw = torch.multinomial(bad, n, replacement=True, generator=gen).bincount(
            minlength=len(probs)).tolist()
        hits += chi_square_test(dict(enumerate(draw)), exact)[2] < alpha
    return hits / trials
