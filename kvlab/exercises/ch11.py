"""Chapter 11 exercises: goodput by hand, the capacity under an SLO, a chunk size for a TPOT budget.

The chapter's simulated set-up lives here too (:data:`COST`, :func:`chat_workload`, the
scheduler configurations), so the notebook and the checks use the same one. Checks compare
against sealed truths (``_common.sealed``; the instructor edition computes them with the
simulator) and say only that an answer is wrong and which concept to revisit, never its
direction, without printing the truth. The two measurement exercises take the reader's
measurements with the answer and refuse ones the simulator does not reproduce, so no answer
passes without the runs it claims.

Every capacity measurement excludes a warm-up (:func:`after_warmup`): the first tenth of a run's
requests, which meet a server whose batch is still filling.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.exercises._common import require_answer, sealed
from kvlab.labs.serving import chunk_sweep, run_colocated
from kvlab.labs.slo import SLO, LatencyRecord
from kvlab.sim.costmodel import RooflineCostModel
from kvlab.sim.workload import RequestSpec, lognormal, make_workload

#: Llama-3-8B on one H100, at 60% of peak FLOP/s and 80% of peak bandwidth (the pure roofline
#: is a bound no kernel reaches).
COST = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM", compute_efficiency=0.6,
                               bandwidth_efficiency=0.8)
#: A colocated instance that prefills a whole prompt in one step (vLLM before chunked prefill).
COLOCATED = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096, prefill_chunk=4096)
#: A colocated instance with chunked prefill (Sarathi-Serve's design; vLLM v1 chunks by default
#: too, with a larger budget, 8,192 tokens for `vllm serve` on an H100): a 256-token step budget
#: shared by the running decodes and the prompt chunks.
COLOCATED_CHUNKED = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=256,
                                    prefill_chunk=256)
PREFILL = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, prefill_chunk=4096)
DECODE = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, prefill_chunk=8192)


def chat_workload(n: int, rate: float, seed: int = 1) -> list[RequestSpec]:
    """Chat-like requests: prompts log-normal around 1,024 tokens, answers around 100."""
    return make_workload(n, rate, lognormal(1024, 0.5, 16, 4000), lognormal(100, 0.5, 4, 800),
                         seed=seed)


#: The share of a run's requests (the earliest arrivals) excluded as its warm-up.
WARMUP_SHARE = 0.1


def after_warmup(records: Sequence[LatencyRecord],
                 share: float = WARMUP_SHARE) -> list[LatencyRecord]:
    """The records of one run with its warm-up excluded: the earliest ``share`` of the
    arrivals are dropped and the clock restarts at the first arrival kept, so
    ``evaluate_slo(after_warmup(recs), slo, window_s="arrivals")`` equals
    ``evaluate_slo(recs, slo, warmup_s=t, window_s="arrivals")`` with ``t`` that arrival.
    ValueError for a share outside [0, 1) or no records."""
    if not 0 <= share < 1:
        raise ValueError(f"share must be in [0, 1), got {share!r}")
    if not records:
        raise ValueError("no records")
    ordered = sorted(records, key=lambda r: (r.arrival, r.request_id))
    kept = ordered[math.floor(share * len(ordered)):]
    t0 = kept[0].arrival
    return [dataclasses.replace(r, arrival=r.arrival - t0) for r in kept]


def _number(value, what: str) -> float:
    """``value`` as a float; AssertionError naming ``what`` if it is not a real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AssertionError(f"{what}: expected a number, got {value!r}")
    return float(value)


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
    :data:`HAND_RECORDS` under :data:`HAND_SLO`.

    Attainment is graded first, then the goodput rate. A wrong value is told only that it is
    wrong, not its direction: attainment takes one of nine values (k of 8), so a direction
    would find it in three guesses. The messages do not state how to compute either."""
    require_answer(goodput, "goodput in requests per second")
    require_answer(attainment, "attainment as a fraction")
    goodput, attainment = _number(goodput, "goodput"), _number(attainment, "attainment")
    if not 0 <= attainment <= 1:
        raise AssertionError(f"attainment {attainment:g} is not a fraction of the requests: "
                             "give it between 0 and 1")
    if sealed("ch11.goodput_by_hand.attainment").direction(attainment, tolerance=1e-9):
        raise AssertionError(
            f"attainment {attainment:g} is not right: take HAND_RECORDS one request at a time "
            "against the chapter's definitions of meeting the SLO and of attainment")
    if sealed("ch11.goodput_by_hand.goodput").direction(goodput, tolerance=1e-9):
        raise AssertionError(f"attainment is right; goodput {goodput:g} req/s is not: re-read "
                             "what a run's goodput rate is a rate over")
    measured = len(HAND_RECORDS)
    return f"Correct: {round(attainment * measured)} of {measured} requests met the SLO."


# ------------------------------------------------------------------- 2. capacity under an SLO

RATE_SLO = SLO(ttft=0.3, tpot=0.02)
#: The rates at which the check measures the capacity itself (1 req/s apart).
RATE_GRID = tuple(range(18, 29))
RATE_REQUESTS = 120
#: The crossing passes within this fraction of the capacity (the attainments are exact).
RATE_TOLERANCE = 0.01


def _run(rate: float) -> list[LatencyRecord]:
    return run_colocated(chat_workload(RATE_REQUESTS, rate), COST, COLOCATED)


def check_max_rate(attainments, capacity) -> str:
    """Exercise 2, linked answers graded together: ``attainments``, a dict ``{rate:
    attainment}`` for the two neighbouring rates of :data:`RATE_GRID` (1 req/s apart) between
    which one colocated instance (:data:`COST`, :data:`COLOCATED`, :func:`chat_workload` of
    :data:`RATE_REQUESTS` requests) stops meeting :data:`RATE_SLO` for 90% of its requests
    after the warm-up (:func:`after_warmup`), each attainment as a fraction; and
    ``capacity``, the rate (req/s) at which the attainment crosses 90%, interpolated linearly
    between the two (within 1%).

    The attainments are compared exactly with the simulator's (sealed: the instructor edition
    runs it), so no answer passes without the two runs; one message answers whichever value is
    wrong, with no direction, so trying rates against the check learns nothing a run would not.
    """
    require_answer(attainments, "a dict {rate: attainment} for two neighbouring rates")
    require_answer(capacity, "the rate at which the attainment crosses 90%")
    if not isinstance(attainments, dict) or len(attainments) != 2:
        raise AssertionError("give attainments as a dict of two entries, {rate: attainment}")
    pairs = []
    for rate, att in attainments.items():
        rate, att = _number(rate, "a rate"), _number(att, "an attainment")
        if rate not in RATE_GRID:
            raise AssertionError(f"the rates are two neighbours of RATE_GRID, {RATE_GRID[0]} to "
                                 f"{RATE_GRID[-1]} req/s, got {rate:g}")
        if not 0 <= att <= 1:
            raise AssertionError(f"an attainment is a fraction of the requests, got {att:g}")
        pairs.append((int(rate), att))
    (lo, att_lo), (hi, att_hi) = sorted(pairs)
    if hi - lo != 1:
        raise AssertionError("the two rates are neighbours on RATE_GRID (1 req/s apart)")
    capacity = _number(capacity, "capacity")
    truth = sealed("ch11.max_rate")
    right = (sealed("ch11.max_rate.bracket").is_answer([lo, hi])
             and abs(att_lo - sealed("ch11.max_rate.attainment_lo").value()) <= 1e-6
             and abs(att_hi - sealed("ch11.max_rate.attainment_hi").value()) <= 1e-6
             and abs(capacity - truth.value()) <= RATE_TOLERANCE * truth.value())
    if not right:                 # one message, whichever value is wrong: no direction
        raise AssertionError("not all right: revisit what capacity under an SLO is (the "
                             "attainment after the warm-up against the offered rate, measured "
                             "at each rate, and where it crosses 90%), and run the simulator "
                             "at both rates you give")
    return (f"Correct: the capacity under this SLO is about {capacity:.1f} req/s; past it, "
            "each extra request per second costs attainment fast, as the queue starts to "
            "grow.")


# ------------------------------------------------------------------- 3. chunk for a TPOT budget

TPOT_BUDGET_S = 0.010
CHUNK_RATE = 12.0
CHUNK_REQUESTS = 100
CHUNK_CHOICES = (128, 256, 512, 1024, 2048, 4096)


@functools.lru_cache(maxsize=16)
def _chunk_row(chunk: int) -> dict:
    return chunk_sweep(chat_workload(CHUNK_REQUESTS, CHUNK_RATE, seed=2), COST, [chunk])[0]


def check_chunk_for_tpot(chunk, tpot_p99_ms) -> str:
    """``chunk``: the token budget of :data:`CHUNK_CHOICES` (budget = prefill chunk) to deploy
    at :data:`CHUNK_RATE` req/s: of the budgets whose TPOT p99 stays within
    :data:`TPOT_BUDGET_S`, the one with the lowest TTFT p99; ``tpot_p99_ms``: the TPOT p99
    (milliseconds) you measured with that budget.

    The measurement must be the simulator's (within 1%), so each option tried against the
    check costs a run of it; with the six options that is the sweep the exercise asks for,
    and the choice is graded, not the reasoning (the notebook asks for that in words)."""
    require_answer(chunk, "a token budget from CHUNK_CHOICES")
    require_answer(tpot_p99_ms, "the TPOT p99 you measured with it, in milliseconds")
    if chunk not in CHUNK_CHOICES:
        raise AssertionError(f"choose one of {CHUNK_CHOICES}")
    tpot_p99_ms = _number(tpot_p99_ms, "tpot_p99_ms")
    row = _chunk_row(chunk)
    measured = row["tpot_p99_s"] * 1e3
    if not math.isclose(tpot_p99_ms, measured, rel_tol=0.01):
        raise AssertionError(f"that is not the TPOT p99 of chunk_sweep(chat_workload("
                             f"{CHUNK_REQUESTS}, {CHUNK_RATE:g}, seed=2), COST, [{chunk}]): "
                             "run it, and pass what that run gives, in ms")
    if row["tpot_p99_s"] > TPOT_BUDGET_S:
        raise AssertionError(f"this budget's TPOT p99 is over the {TPOT_BUDGET_S * 1e3:g} ms "
                             "objective")
    if not sealed("ch11.chunk_for_tpot").is_answer(chunk):
        raise AssertionError("meets the objective, but another budget that meets it has a "
                             "lower TTFT p99: you leave first-token latency on the table")
    return (f"Correct: TPOT p99 {measured:.1f} ms, TTFT p99 "
            f"{row['ttft_p99_s'] * 1e3:.0f} ms.")
