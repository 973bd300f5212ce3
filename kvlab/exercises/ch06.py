"""Chapter 6 exercises: one batch by hand, a policy that meets a deadline, the starvation bound.

Each check computes the truth with :mod:`kvlab.core` and raises ``AssertionError`` with a hint
when the answer differs.
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
    if got != want:
        raise AssertionError(f"expected {want}, got {got}: decodes first (one token each), then "
                             "prefills in order, each min(prompt left, chunk, budget left)")
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
        raise AssertionError(f"expected {want}: max_wait_steps + (older_waiting + 1) * T, with T "
                             "the largest prompt + max_tokens")
    return f"Correct: {want} steps."
