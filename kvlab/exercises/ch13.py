"""Chapter 13 exercises: how often a tenant hits, a KV-event subscriber, the weight of the
overlap term, and a router of your own.

Checks with one right answer compare against a sealed truth (``_common.sealed``; the instructor
edition computes it with the simulator); the function exercises run the reader's code on cases
it does not show, generated from kvlab's radix cache and event recorder, or on seeded workloads
of the cluster simulator. Feedback names what to revisit, never the direction of the error.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from kvlab.core.radix_cache import RadixCache
from kvlab.engine.kv_events import BlockHasher, KVEventBatch, KVEventRecorder
from kvlab.exercises._common import earlier_prediction, graded_once, require_answer, sealed
from kvlab.labs.routing import run_policy, summarize, tenant_workload
from kvlab.sim.cluster import LinearStepCost, simulate_cluster

# ------------------------------------------------------------------ 1. derive: a tenant's hits
#: Exercise 1: one tenant's requests, the cluster's replicas. A replica holds the tenant's
#: system prompt once it has served one of its requests (nothing is evicted; requests do not
#: overlap in time).
TENANT = {"requests": 3, "replicas": 2}


def check_tenant_hits(random_hits, affinity_hits) -> str:
    """Exercise 1: the expected number of the tenant's requests that find its system prompt
    cached when each request goes to a replica drawn uniformly at random, and the number when
    the router sends all of them where the prompt is cached (within 1e-6)."""
    require_answer(random_hits, "the expected hits under random placement")
    require_answer(affinity_hits, "the hits under routing by prefix")
    try:
        pair = (float(random_hits), float(affinity_hits))
    except (TypeError, ValueError):
        raise AssertionError("give two numbers") from None
    truth = sealed("ch13.tenant_hits")
    if not truth.is_answer([round(x, 6) for x in pair]):
        raise AssertionError("not both right: a request misses exactly when its replica has "
                             "not yet served this tenant; count, for each request, the chance "
                             "of that (random placement), and how many replicas ever see the "
                             "tenant (routing by prefix)")
    return ("Right. Multiply by the share of a prompt that is system prompt to get the hit "
            "rate of prompt tokens, and compare with the live run's round_robin and kv_aware.")


# ------------------------------------------------------------------ 2. a KV-event subscriber
#: Exercise 2: the block size of the hidden streams.
SUBSCRIBER_BLOCK = 4

Subscriber = Callable[[Sequence[KVEventBatch], Sequence[int], int], int]


def _stream(seed: int, kinds: tuple[str, ...]) -> tuple[list[KVEventBatch], RadixCache]:
    """A replica's event batches (one per operation) and its cache: inserts of token families
    that share prefixes, and (when asked) evictions and clears."""
    rng = random.Random(seed)
    cache = RadixCache(SUBSCRIBER_BLOCK)
    recorder = KVEventRecorder(SUBSCRIBER_BLOCK, BlockHasher("0"))
    cache.listener = recorder
    families = [[rng.randrange(3, 50) for _ in range(24)] for _ in range(3)]
    batches, next_block = [], 0
    for step in range(12):
        op = rng.choice(kinds)
        if op == "evict" and cache.num_cached_blocks():
            cache.evict(rng.randint(1, 3))
        elif op == "clear" and step > 6:
            cache.clear()
        else:
            fam = rng.choice(families)
            tail = [rng.randrange(3, 50) for _ in range(rng.randint(0, 8))]
            tokens = fam[:rng.randint(4, 24)] + tail
            n = len(tokens) // SUBSCRIBER_BLOCK
            match = cache.match(("s",), tokens, leave_last=False)
            fresh = list(range(next_block, next_block + n - len(match.blocks)))
            next_block += len(fresh)
            cache.insert(("s",), tokens[:n * SUBSCRIBER_BLOCK], [*match.blocks, *fresh])
        batches.append(KVEventBatch(ts=float(step), events=recorder.take(),
                                    data_parallel_rank=0))
    return [b for b in batches if b.events], cache


def _queries(seed: int) -> list[list[int]]:
    rng = random.Random(seed + 1000)
    fams = random.Random(seed)   # the same families as the stream
    families = [[fams.randrange(3, 50) for _ in range(24)] for _ in range(3)]
    out = []
    for _ in range(6):
        fam = rng.choice(families)
        out.append(fam[:rng.randint(1, 24)] + [rng.randrange(3, 50)
                                                for _ in range(rng.randint(0, 6))])
    return out


#: (kinds of operation, seeds) of the hidden streams, the simpler first
_SUBSCRIBER_CASES = ((("insert",), range(3)), (("insert", "evict"), range(3, 9)),
                     (("insert", "evict", "clear"), range(9, 15)))
_REVISIT = {"insert": "how BlockStored chains its blocks (parent_block_hash, and token_ids cut "
                      "into block_size pieces)",
            "evict": "what BlockRemoved leaves behind: a block that is gone ends every prefix "
                     "through it",
            "clear": "AllBlocksCleared"}


def check_subscriber(fn: Subscriber) -> str:
    """Exercise 2: ``fn(batches, tokens, block_size)`` -> how many leading full blocks of
    ``tokens`` the publisher's cache holds after ``batches``. Run on streams it does not show
    (kvlab's radix cache and event recorder; the truth is the cache's own match)."""
    require_answer(fn, "your subscriber function")
    if not callable(fn):
        raise AssertionError("pass a function fn(batches, tokens, block_size) -> int")
    for kinds, seeds in _SUBSCRIBER_CASES:
        for seed in seeds:
            batches, cache = _stream(seed, kinds)
            for tokens in _queries(seed):
                want = len(cache.match(("s",), tokens, leave_last=False).blocks)
                got = fn(list(batches), list(tokens), SUBSCRIBER_BLOCK)
                if isinstance(got, bool) or not isinstance(got, int):
                    raise AssertionError(f"your function returned {got!r}; it must return an "
                                         "int (a number of blocks)")
                if got != want:
                    raise AssertionError(f"wrong on a hidden stream with {', '.join(kinds)} "
                                         f"events: revisit {_REVISIT[kinds[-1]]}")
    return (f"Right on {sum(len(s) for _, s in _SUBSCRIBER_CASES) * 6} hidden queries: that is "
            "the index vllm-router's kv_aware keeps per replica, fed by the same events.")


# ------------------------------------------------------------------ 3. the overlap weight
#: Exercise 3: a small cluster (CPU-sized steps, :class:`~kvlab.sim.cluster.LinearStepCost`)
#: under a skewed multi-tenant stream, and the SLO.
WEIGHT_CASE = {"replicas": 4, "requests": 160, "tenants": 16, "rate": 80.0, "prompt_len": 256,
               "shared": 224, "output_len": 64, "zipf": 1.2, "num_blocks": 120,
               "block_size": 16, "seed": 5}
WEIGHT_SLO_P99_S = 0.1
WEIGHT_CHOICES = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)


def weight_workload():
    c = WEIGHT_CASE
    return tenant_workload(c["requests"], c["tenants"], c["rate"], c["prompt_len"],
                           c["output_len"], zipf=c["zipf"], seed=c["seed"])


def run_weight(weight: float) -> dict:
    """Dynamo's cost with overlap weight ``weight`` on :data:`WEIGHT_CASE`, summarized."""
    c = WEIGHT_CASE
    return run_policy(weight_workload(), "dynamo_cost", replicas=c["replicas"],
                      num_blocks=c["num_blocks"], block_size=c["block_size"],
                      shared_prefix=c["shared"], cost=LinearStepCost(),
                      overlap_weight=weight)


def check_weight(weight, hit_rate, ttft_p99_s) -> str:
    """Exercise 3: the weight of :data:`WEIGHT_CHOICES` with the highest hit rate among those
    whose TTFT p99 stays within :data:`WEIGHT_SLO_P99_S`, with the hit rate and TTFT p99 your
    own run of :func:`run_weight` measured for it. The check re-runs your weight: numbers that
    are not that run's are refused, so nothing passes without a run. The weight is graded once
    per session (``_common.earlier_prediction``): after a wrong one, trying the other choices
    one by one learns nothing."""
    for value, what in ((weight, "the weight"), (hit_rate, "its hit rate"),
                        (ttft_p99_s, "its TTFT p99")):
        require_answer(value, what)
    if isinstance(weight, bool) or weight not in WEIGHT_CHOICES:
        raise AssertionError(f"choose the weight among {WEIGHT_CHOICES}")
    try:
        measured = (float(hit_rate), float(ttft_p99_s))
    except (TypeError, ValueError):
        raise AssertionError("give the hit rate and the TTFT p99 as numbers") from None
    row = run_weight(float(weight))
    if not (math.isclose(measured[0], row["hit_rate"], rel_tol=1e-9)
            and math.isclose(measured[1], row["ttft_p99_s"], rel_tol=1e-9)):
        raise AssertionError("those are not the numbers of a run at this weight: report what "
                             "run_weight returned")
    keeps_slo = row["ttft_p99_s"] <= WEIGHT_SLO_P99_S
    right = keeps_slo and sealed("ch13.weight").is_answer(float(weight))
    earlier = earlier_prediction("ch13.weight", float(weight), right)
    if earlier is not None:
        return graded_once(earlier)
    if not keeps_slo:
        raise AssertionError("at this weight TTFT p99 misses the objective: look at the hot "
                             "spot (requests per replica) and what keeps a load term in play")
    if not right:
        raise AssertionError("this weight keeps the objective, but another that does finds more "
                             "of the prompts cached")
    return ("Right. Compare its requests per replica with weight 0 (load alone) and with the "
            "largest weight: the load term is what spreads a hot tenant.")


# ------------------------------------------------------------------ 4. a router of your own
#: Exercise 5: the cluster and stream your router runs on; :data:`POLICY_SEEDS` are workloads to
#: practise on with :func:`run_router`, the check grades on others it does not show (their bars
#: sealed).
POLICY_CASE = {"replicas": 8, "requests": 240, "tenants": 24, "rate": 160.0,
               "prompt_len": 256, "shared": 224, "output_len": 64, "zipf": 1.2,
               "num_blocks": 120, "block_size": 16}
POLICY_SEEDS = (11, 12, 13)
_GRADED_SEEDS = (17, 22, 26)


def policy_workload(seed: int):
    c = POLICY_CASE
    return tenant_workload(c["requests"], c["tenants"], c["rate"], c["prompt_len"],
                           c["output_len"], zipf=c["zipf"], seed=seed)


def run_router(policy, seed: int) -> dict:
    """Your ``policy`` (an object with ``name``, ``choose(request, keys, replicas)`` and
    ``finished(i, request)``, as :mod:`kvlab.sim.routers`) on :data:`POLICY_CASE`, seed
    ``seed``, summarized."""
    c = POLICY_CASE
    result = simulate_cluster(policy_workload(seed), policy, replicas=c["replicas"],
                              num_blocks=c["num_blocks"], block_size=c["block_size"],
                              cost=LinearStepCost(), shared_prefix=c["shared"])
    return summarize(result)


def check_router(make_policy: Callable[[], object]) -> str:
    """Exercise 5: ``make_policy()`` returns a fresh router. On each of three workloads of
    :data:`POLICY_CASE` that the page does not show (seeds other than :data:`POLICY_SEEDS`) it
    must reach at least 93% of precise_index's hit rate and keep TTFT p99 under 40% of
    least_loaded's (both measured by the instructor edition, sealed)."""
    require_answer(make_policy, "a function that returns your router")
    if not callable(make_policy):
        raise AssertionError("pass a function that returns a new router each time")
    for seed in _GRADED_SEEDS:
        row = run_router(make_policy(), seed)
        hit_bar = 0.93 * sealed(f"ch13.router_precise_hit.{seed}").value()
        p99_bar = 0.4 * sealed(f"ch13.router_least_loaded_p99.{seed}").value()
        if row["hit_rate"] < hit_bar:
            raise AssertionError("on a hidden workload your router finds fewer prompts cached "
                                 "than the bar: revisit what affinity keeps")
        if row["ttft_p99_s"] > p99_bar:
            raise AssertionError("on a hidden workload your router's TTFT p99 is over the bar: "
                                 "revisit where the hot tenant's requests pile up")
    return ("Right on every hidden workload: affinity where it pays, load where affinity would "
            "make a hot spot.")


__all__ = ["POLICY_CASE", "POLICY_SEEDS", "SUBSCRIBER_BLOCK", "TENANT", "WEIGHT_CASE",
           "WEIGHT_CHOICES", "WEIGHT_SLO_P99_S", "check_router", "check_subscriber",
           "check_tenant_hits", "check_weight", "policy_workload", "run_router", "run_weight",
           "weight_workload"]
