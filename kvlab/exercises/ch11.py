"""Chapter 11 exercises: goodput by hand, the capacity under an SLO, a chunk size for a TPOT budget.

The chapter's simulated set-up lives here too (:data:`COST`, :func:`chat_workload`, the
scheduler configurations), so the notebook and the checks use the same one. Checks compute the
truth with the simulator (memoised) and say only what is wrong (too high, too low) without
printing it. The two measurement exercises take the reader's measurement with the answer and
refuse one the simulator does not reproduce, so an answer cannot be found by bisecting
against the check without running anything.
"""

from __future__ import annotations

import functools
import math

from kvlab.core.scheduler_config import SchedulerConfig
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
#: A colocated instance with chunked prefill (Sarathi-Serve's design, vLLM v1's default): a
#: 256-token step budget shared by the running decodes and the prompt chunks.
COLOCATED_CHUNKED = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=256,
                                    prefill_chunk=256)
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


#: How close the attainment the reader measured must be to the simulator's (a fraction).
ATTAINMENT_TOLERANCE = 0.02


def check_max_rate(rate, attainment) -> str:
    """``rate``: the highest request rate (req/s) at which one colocated instance
    (:data:`COST`, :data:`COLOCATED`, :func:`chat_workload` of :data:`RATE_REQUESTS` requests)
    meets :data:`RATE_SLO` for at least 90% of requests; ``attainment``: the attainment you
    measured at that rate. Within 15% of the capacity counts.

    The measurement is part of the answer: the check first re-runs the simulator at ``rate``
    and refuses an attainment that is not what that run gives, so the rate cannot be found by
    guessing against the check. A wrong rate gets its direction only."""
    require_answer(rate, "a request rate in requests per second")
    require_answer(attainment, "the attainment you measured at that rate (a fraction)")
    rate, attainment = float(rate), float(attainment)
    if not rate > 0 or math.isinf(rate):
        raise AssertionError("give a positive, finite rate")
    if not 0 <= attainment <= 1:
        raise AssertionError("attainment is a fraction between 0 and 1")
    att = _attainment(round(rate, 3))
    if abs(attainment - att) > ATTAINMENT_TOLERANCE:
        raise AssertionError(f"that is not the attainment of chat_workload({RATE_REQUESTS}, "
                             f"{rate:g}) on COST and COLOCATED under RATE_SLO: run it, and "
                             "pass the attainment that run gives")
    truth = _capacity()
    if abs(rate - truth) <= RATE_TOLERANCE * truth:
        return "Correct: within 15% of the simulated capacity."
    if rate > truth:
        raise AssertionError("too high: past the capacity (look at where attainment crosses "
                             "90% between the rates you ran)")
    raise AssertionError("too low: the instance can take more before dropping under 90%")


# ------------------------------------------------------------------- 3. chunk for a TPOT budget

TPOT_BUDGET_S = 0.010
CHUNK_RATE = 12.0
CHUNK_REQUESTS = 100
CHUNK_CHOICES = (128, 256, 512, 1024, 2048, 4096)


@functools.lru_cache(maxsize=16)
def _chunk_row(chunk: int) -> dict:
    return chunk_sweep(chat_workload(CHUNK_REQUESTS, CHUNK_RATE, seed=2), COST, [chunk])[0]


def check_chunk_for_tpot(chunk, tpot_p99_ms) -> str:
    """``chunk``: the largest token budget of :data:`CHUNK_CHOICES` (budget = prefill chunk)
    whose TPOT p99 stays within :data:`TPOT_BUDGET_S` at :data:`CHUNK_RATE` req/s;
    ``tpot_p99_ms``: the TPOT p99 (milliseconds) you measured with that budget. Larger budgets
    give lower TTFT and more throughput, so the largest that fits is the one to deploy.

    As in :func:`check_max_rate`, the measurement must be the simulator's (within 1%), so the
    choice cannot be found by trying the options against the check."""
    require_answer(chunk, "a token budget from CHUNK_CHOICES")
    require_answer(tpot_p99_ms, "the TPOT p99 you measured with it, in milliseconds")
    if chunk not in CHUNK_CHOICES:
        raise AssertionError(f"choose one of {CHUNK_CHOICES}")
    row = _chunk_row(chunk)
    measured = row["tpot_p99_s"] * 1e3
    if not math.isclose(float(tpot_p99_ms), measured, rel_tol=0.01):
        raise AssertionError(f"that is not the TPOT p99 of chunk_sweep(chat_workload("
                             f"{CHUNK_REQUESTS}, {CHUNK_RATE:g}, seed=2), COST, [{chunk}]): "
                             "run it, and pass what that run gives, in ms")
    if row["tpot_p99_s"] > TPOT_BUDGET_S:
        raise AssertionError(f"too large: this budget's TPOT p99 is over the "
                             f"{TPOT_BUDGET_S * 1e3:g} ms objective")
    best = max(c for c in CHUNK_CHOICES if _chunk_row(c)["tpot_p99_s"] <= TPOT_BUDGET_S)
    if chunk < best:
        raise AssertionError("meets the objective, but it is not the largest budget that "
                             "does: you leave TTFT and throughput on the table")
    return (f"Correct: TPOT p99 {measured:.1f} ms, TTFT p99 "
            f"{row['ttft_p99_s'] * 1e3:.0f} ms.")
