"""Chapter 11 exercises: goodput by hand, the capacity under an SLO, a chunk size for a TPOT budget.

The chapter's simulated set-up lives here too (:data:`COST`, :func:`chat_workload`, the
scheduler configurations), so the notebook and the checks use the same one. Checks compute the
truth with the simulator (memoised) and say what is wrong (too high, too low, which objective
fails at the reader's answer) without printing it.
"""

from __future__ import annotations

import functools
import math

from kvlab.core.scheduler import SchedulerConfig
from kvlab.core.slo import SLO, LatencyRecord, evaluate_slo
from kvlab.sim.costmodel import RooflineCostModel
from kvlab.sim.serving import chunk_sweep, rate_at_attainment, run_colocated
from kvlab.sim.workload import RequestSpec, lognormal, make_workload

from ._common import require_answer

#: Llama-3-8B on one H100, at 60% of peak FLOP/s and 80% of peak bandwidth (the pure roofline
#: is a bound no kernel reaches).
COST = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM", compute_efficiency=0.6,
                               bandwidth_efficiency=0.8)
#: A colocated instance that prefills a whole prompt in one step (vLLM before chunked prefill).
COLOCATED = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096, prefill_chunk=4096)
PREFILL = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, prefill_chunk=4096)
DECODE = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, prefill_chunk=8192)


def chat_workload(n: int, rate: float, seed: int = 1) -> list[RequestSpec]:
    """Chat-like requests: prompts log-normal around 1,024 tokens, answers around 100."""
    return make_workload(n, rate, lognormal(1024, 0.5, 16, 4000), lognormal(100, 0.5, 4, 800),
                         seed=seed)


# ------------------------------------------------------------------- 1. goodput by hand

HAND_SLO = SLO(ttft=0.5, tpot=0.05)
HAND_WINDOW_S = 4.0
HAND_RECORDS = (
    LatencyRecord("a", 0.0, ttft=0.20, tpot=0.030, e2e=3.2, output_tokens=101),
    LatencyRecord("b", 0.5, ttft=0.70, tpot=0.020, e2e=2.7, output_tokens=101),
    LatencyRecord("c", 1.0, status="rejected"),
    LatencyRecord("d", 1.5, ttft=0.10, tpot=0.060, e2e=6.1, output_tokens=101),
    LatencyRecord("e", 2.0, ttft=0.30, e2e=0.30, output_tokens=1),
    LatencyRecord("f", 2.5, status="timeout", ttft=0.4),
    LatencyRecord("g", 3.0, ttft=0.45, tpot=0.049, e2e=5.35, output_tokens=101,
                  quality_ok=False),
    LatencyRecord("h", 3.5, ttft=0.05, tpot=0.010, e2e=1.05, output_tokens=101),
)


def check_goodput_by_hand(goodput, attainment) -> str:
    """``goodput`` (requests/s over :data:`HAND_WINDOW_S`) and ``attainment`` (a fraction) of
    :data:`HAND_RECORDS` under :data:`HAND_SLO`."""
    require_answer(goodput, "goodput in requests per second")
    require_answer(attainment, "attainment as a fraction")
    rep = evaluate_slo(list(HAND_RECORDS), HAND_SLO, window_s=HAND_WINDOW_S)
    if not math.isclose(float(attainment), rep.attainment, abs_tol=1e-9):
        raise AssertionError(
            "attainment is wrong: count the requests that finished, passed the quality check "
            "and met every bound (a one-token answer has no TPOT), over ALL requests, the "
            "rejected and timed-out ones included")
    if not math.isclose(float(goodput), rep.goodput, abs_tol=1e-9):
        raise AssertionError("goodput is wrong: it is the same count divided by the window "
                             "length, not by the number of requests")
    return f"Correct: {rep.met} of {rep.measured} requests met the SLO."


# ------------------------------------------------------------------- 2. capacity under an SLO

RATE_SLO = SLO(ttft=0.3, tpot=0.02)
RATE_GRID = (5, 10, 15, 20, 25, 30)
RATE_REQUESTS = 120
RATE_TOLERANCE = 0.15


@functools.lru_cache(maxsize=64)
def _attainment(rate: float) -> float:
    recs = run_colocated(chat_workload(RATE_REQUESTS, rate), COST, COLOCATED)
    return evaluate_slo(recs, RATE_SLO).attainment


@functools.lru_cache(maxsize=1)
def _capacity() -> float:
    return rate_at_attainment(RATE_GRID, [_attainment(r) for r in RATE_GRID], 0.9)


def check_max_rate(rate) -> str:
    """``rate``: the highest request rate (req/s) at which one colocated instance
    (:data:`COST`, :data:`COLOCATED`, :func:`chat_workload` of :data:`RATE_REQUESTS`) meets
    :data:`RATE_SLO` for at least 90% of requests. Within 15% counts."""
    require_answer(rate, "a request rate in requests per second")
    rate = float(rate)
    if not rate > 0 or math.isinf(rate):
        raise AssertionError("give a positive, finite rate")
    truth = _capacity()
    if abs(rate - truth) <= RATE_TOLERANCE * truth:
        return "Correct: within 15% of the simulated capacity."
    att = _attainment(round(rate, 3))
    if rate > truth:
        raise AssertionError(f"too high: at {rate:g} req/s attainment is {att:.0%}, below 90%")
    raise AssertionError(f"too low: at {rate:g} req/s attainment is still {att:.0%}; the "
                         "instance can take more before dropping under 90%")


# ------------------------------------------------------------------- 3. chunk for a TPOT budget

TPOT_BUDGET_S = 0.010
CHUNK_RATE = 12.0
CHUNK_REQUESTS = 100
CHUNK_CHOICES = (128, 256, 512, 1024, 2048, 4096)


@functools.lru_cache(maxsize=16)
def _chunk_row(chunk: int) -> dict:
    return chunk_sweep(chat_workload(CHUNK_REQUESTS, CHUNK_RATE, seed=2), COST, [chunk])[0]


def check_chunk_for_tpot(chunk) -> str:
    """``chunk``: the largest token budget of :data:`CHUNK_CHOICES` (budget = prefill chunk)
    whose TPOT p99 stays within :data:`TPOT_BUDGET_S` at :data:`CHUNK_RATE` req/s. Larger
    budgets give lower TTFT and more throughput, so the largest that fits is the one to
    deploy."""
    require_answer(chunk, "a token budget from CHUNK_CHOICES")
    if chunk not in CHUNK_CHOICES:
        raise AssertionError(f"choose one of {CHUNK_CHOICES}")
    row = _chunk_row(chunk)
    if row["tpot_p99_s"] > TPOT_BUDGET_S:
        raise AssertionError(f"too large: TPOT p99 is {row['tpot_p99_s'] * 1e3:.1f} ms, over "
                             f"the {TPOT_BUDGET_S * 1e3:g} ms budget")
    best = max(c for c in CHUNK_CHOICES if _chunk_row(c)["tpot_p99_s"] <= TPOT_BUDGET_S)
    if chunk < best:
        raise AssertionError(f"meets the budget (TPOT p99 {row['tpot_p99_s'] * 1e3:.1f} ms) but "
                             "a larger budget does too: you leave TTFT and throughput on the "
                             "table")
    return (f"Correct: TPOT p99 {row['tpot_p99_s'] * 1e3:.1f} ms, TTFT p99 "
            f"{row['ttft_p99_s'] * 1e3:.0f} ms.")
