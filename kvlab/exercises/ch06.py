"""Chapter 6 exercises: one batch by hand, a policy that meets a deadline, the starvation
bound, and a token budget that meets an inter-token-latency target (Sarathi-Serve's trade).

Each check computes the truth with :mod:`kvlab.core` (and the simulator) and raises
``AssertionError`` saying what is wrong (which entry, too high or too low), never the answer.
"""

from __future__ import annotations

import math

from kvlab.core.kv_manager import KVCacheManager
from kvlab.core.scheduler import (
    BaselineScheduler,
    ProductionScheduler,
    SchedulerConfig,
    default_order_key,
    starvation_bound,
)
from kvlab.core.scheduler_api import RequestStatus, RuntimeRequest
from kvlab.reference import Phase, Request, build_batch
from kvlab.sim.tokens import drive

from ._common import require_answer

#: The requests of :func:`check_batch`, in the order ``build_batch`` sees them.
BATCH_REQUESTS = (
    ("p0", 10, Phase.PREFILL), ("d0", 0, Phase.DECODE), ("w0", 7, Phase.WAITING),
    ("d1", 0, Phase.DECODE), ("w1", 3, Phase.WAITING),
)
BATCH_BUDGETS = {"token_budget": 8, "max_sequences": 4, "prefill_chunk": 4}


def check_batch(answer) -> str:
    """``answer``: list of ``(request_id, tokens)`` that ``build_batch`` schedules for
    :data:`BATCH_REQUESTS` under :data:`BATCH_BUDGETS`, in batch order."""
    require_answer(answer, "a list of (request_id, tokens) pairs")
    reqs = [Request(rid, left, phase=phase) for rid, left, phase in BATCH_REQUESTS]
    want = [(rid, n) for rid, _, n in build_batch(reqs, **BATCH_BUDGETS)]
    got = [(rid, int(n)) for rid, n in answer]
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            what = "the wrong request" if g[0] != w[0] else f"the wrong token count for {g[0]}"
            raise AssertionError(f"entry {i} {g} has {what}; the entries before it are right. "
                                 "Decodes first (one token each), then prefills in order, each "
                                 "min(prompt left, chunk, budget left).")
    if len(got) != len(want):
        raise AssertionError("your batch is right as far as it goes, but "
                             + ("more requests fit." if len(got) < len(want)
                                else "it schedules more than the budgets allow."))
    return f"Correct: {want}."


# ------------------------------------------------------------------- a deadline the baseline misses

DEADLINE_CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=16)
URGENT_DEADLINE = 3    # the urgent request must have its first token by this step


def deadline_workload() -> list[RuntimeRequest]:
    """Three long, important (priority 0) document prompts, then one short, less important
    (priority 1) request that must answer by step :data:`URGENT_DEADLINE`."""
    reqs = [RuntimeRequest(f"doc{i}", tuple(range(100 * i + 1, 100 * i + 65)), max_tokens=4,
                           priority=0) for i in range(3)]
    reqs.append(RuntimeRequest("urgent", (7, 8, 9, 10, 11, 12, 13, 14), max_tokens=4,
                               priority=1, deadline=float(URGENT_DEADLINE)))
    return reqs


def run_deadline(scheduler) -> dict[str, RuntimeRequest]:
    """Run :func:`deadline_workload` through ``scheduler``; deadlines are in steps."""
    drive(scheduler, arrivals={1: deadline_workload()}, check=True, max_steps=500)
    return {r.request_id: r for r in scheduler.requests()}


def urgent_first_token_step(scheduler) -> int:
    return run_deadline(scheduler)["urgent"].first_token_step


def check_deadline_policy(order_key) -> str:
    """``order_key(request, prefix_hit_tokens, step) -> tuple``: a waiting-queue order for
    ``ProductionScheduler`` (smaller first) under which the urgent request of
    :func:`deadline_workload` gets its first token by step :data:`URGENT_DEADLINE`, and every
    request still finishes."""
    require_answer(order_key, "your order_key function")
    if not callable(order_key):
        raise AssertionError("pass a function (request, prefix_hit_tokens, step) -> tuple")
    base = urgent_first_token_step(BaselineScheduler(KVCacheManager(64, 4), DEADLINE_CONFIG))
    default = urgent_first_token_step(
        ProductionScheduler(KVCacheManager(64, 4), DEADLINE_CONFIG, order_key=default_order_key))
    assert base > URGENT_DEADLINE and default > URGENT_DEADLINE  # the point of the exercise
    reqs = run_deadline(ProductionScheduler(KVCacheManager(64, 4), DEADLINE_CONFIG,
                                            order_key=order_key))
    step = reqs["urgent"].first_token_step
    if step is None or step > URGENT_DEADLINE:
        raise AssertionError(
            f"the urgent request got its first token at step {step} (deadline "
            f"{URGENT_DEADLINE}; the baseline: {base}, priority-first: {default}). Hint: order "
            "by deadline before priority (a request without one sorts last: math.inf)")
    unfinished = [r for r, q in reqs.items() if q.status != RequestStatus.FINISHED]
    if unfinished:
        raise AssertionError(f"{unfinished} did not finish")
    return (f"Correct: first token at step {step} (baseline {base}, priority-first {default}); "
            "all four requests finished.")


def edf_then_priority(request: RuntimeRequest, hit_tokens: int, step: int) -> tuple:
    """A solution of :func:`check_deadline_policy`: earliest deadline first, then priority."""
    deadline = request.deadline if request.deadline is not None else math.inf
    return (deadline, request.priority, -hit_tokens)


# ------------------------------------------------------------------- the starvation bound

BOUND_CASE = {"max_wait_steps": 16, "longest_request_tokens": 2048 + 512, "older_waiting": 3}


def check_starvation_bound(answer) -> str:
    """``answer``: the step bound of ``ProductionScheduler``'s docstring for
    :data:`BOUND_CASE` (reserve admission, no preemption)."""
    require_answer(answer, "an integer number of steps")
    case = BOUND_CASE
    want = starvation_bound(SchedulerConfig(max_wait_steps=case["max_wait_steps"]),
                            case["longest_request_tokens"], case["older_waiting"])
    if int(answer) != want:
        raise AssertionError(f"{int(answer):,} is {'too high' if int(answer) > want else 'too low'}"
                             ": the bound is max_wait_steps plus one longest request's worth of "
                             "steps for each aged request ahead of yours and for yours.")
    return f"Correct: {want} steps."


# ------------------------------------------------------------------- chunked prefill and ITL

#: The chunk-size sweep of the chapter and of :func:`check_chunk_design`.
CHUNK_SWEEP = {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "requests": 80, "rate": 12.0,
               "prompt": (1024, 4096), "output": (64, 256), "seed": 0, "max_num_seqs": 64,
               "chunks": (256, 512, 1024, 2048, 4096), "itl_p99_slo_s": 0.020}


def run_chunk(chunk: int):
    """Simulate :data:`CHUNK_SWEEP`'s workload with a token budget (and prefill chunk) of
    ``chunk`` tokens per step under the baseline scheduler; returns the ``SimResult``."""
    from kvlab.sim.costmodel import RooflineCostModel
    from kvlab.sim.executor import simulate
    from kvlab.sim.workload import make_workload, uniform

    d = CHUNK_SWEEP
    cm = RooflineCostModel.named(d["model"], d["gpu"])
    workload = make_workload(d["requests"], d["rate"], uniform(*d["prompt"]),
                             uniform(*d["output"]), seed=d["seed"])
    cfg = SchedulerConfig(max_num_seqs=d["max_num_seqs"], max_num_batched_tokens=chunk,
                          prefill_chunk=chunk)
    kv = KVCacheManager(cm.kv_blocks(block_size=16), 16, enable_prefix_caching=False)
    return simulate(BaselineScheduler(kv, cfg), workload, cm)


def itl_p99(chunk: int) -> float:
    from kvlab.sim.itl import inter_token_latencies, percentile

    return percentile(inter_token_latencies(run_chunk(chunk)), 99)


def check_chunk_design(chunk) -> str:
    """Exercise 4: the largest token budget in ``CHUNK_SWEEP['chunks']`` whose p99 inter-token
    latency meets ``CHUNK_SWEEP['itl_p99_slo_s']``."""
    require_answer(chunk, "your token budget")
    d = CHUNK_SWEEP
    if chunk not in d["chunks"]:
        raise AssertionError(f"choose one of {d['chunks']}, got {chunk!r}")
    slo_ms = d["itl_p99_slo_s"] * 1e3
    if itl_p99(chunk) > d["itl_p99_slo_s"]:
        raise AssertionError(f"with a budget of {chunk} tokens the p99 inter-token latency "
                             f"exceeds {slo_ms:.0f} ms: too large.")
    larger = [c for c in d["chunks"] if c > chunk]
    if larger and itl_p99(larger[0]) <= d["itl_p99_slo_s"]:
        raise AssertionError(f"a budget of {chunk} meets the target, but a larger one does too "
                             "(and larger budgets give lower TTFT and fewer steps): too small.")
    return (f"Correct: {chunk} tokens is the largest budget whose p99 ITL stays within "
            f"{slo_ms:.0f} ms. Each step's time is bounded by its token budget, so the budget "
            "bounds how long a decode waits behind a prefill chunk.")
