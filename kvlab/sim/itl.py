"""Inter-token latency (ITL) from a simulated run's step records.

A request's output tokens appear at the end of each step that sampled for it; the gaps between
consecutive appearances are what a streaming client sees as its inter-token latencies, and
their mean over one request is its TPOT. Needs a run simulated with ``record_steps=True``.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

from kvlab.sim.executor import SimResult


def token_times(result: SimResult) -> dict[str, list[float]]:
    """For each request, the simulated times at which its output tokens appeared, in order:
    its first token (the end of its last prefill chunk, ``RequestRecord.first_token``), then
    the end of every step in which it decoded."""
    if result.num_steps and not result.steps:
        raise ValueError("the run was simulated with record_steps=False: no step records")
    times: dict[str, list[float]] = defaultdict(list)
    for record in result.requests:
        if record.first_token is not None:
            times[record.request_id].append(record.first_token)
    for step in result.steps:
        end = step.start + step.duration
        for request_id, _num_tokens, is_prefill in step.chunks:
            if not is_prefill:
                times[request_id].append(end)
    return dict(times)


def inter_token_latencies(result: SimResult) -> list[float]:
    """Every gap between two consecutive output tokens of one request, sorted (seconds)."""
    return sorted(b - a for ts in token_times(result).values() for a, b in pairwise(ts))


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank below) of already sorted values."""
    if not sorted_values:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    return sorted_values[int(q / 100 * (len(sorted_values) - 1))]
