"""Chapter 6 exercises: one batch by hand, a policy that meets a deadline, a document's time to
first token behind finishing decodes, a token budget that meets an inter-token-latency target on
another GPU (Sarathi-Serve's trade), and a dashboard's latency numbers to debug.

A check never holds the answer it grades: the batch is compared with a sealed truth
(``_common.sealed``; the instructor edition computes it with :mod:`kvlab.reference`), a
reader's rule is run on workloads drawn afresh at each call (``_common.hidden_rng``) and
compared with what the scheduler does on them, and the policy, prediction and debug checks run
the reader's code or numbers on the scheduler and the simulator. Each raises
``AssertionError`` naming the rule or concept to revisit, never the answer, the direction of
an error, or which case failed.
"""

from __future__ import annotations

import functools
from itertools import pairwise

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler, default_order_key
from kvlab.core.request import RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.exercises._common import (
    earlier_prediction,
    graded_once,
    hidden_rng,
    require_answer,
    sealed,
)
from kvlab.labs.invariants import check_scheduler
from kvlab.reference import Phase
from kvlab.sim.tokens import drive

#: The requests of :func:`check_batch`, in the order ``build_batch`` sees them.
BATCH_REQUESTS = (
    ("p0", 10, Phase.PREFILL), ("d0", 0, Phase.DECODE), ("w0", 7, Phase.WAITING),
    ("d1", 0, Phase.DECODE), ("w1", 3, Phase.WAITING),
)
BATCH_BUDGETS = {"token_budget": 8, "max_sequences": 4, "prefill_chunk": 4}


def check_batch(answer) -> str:
    """``answer``: list of ``(request_id, tokens)`` that ``build_batch`` schedules for
    :data:`BATCH_REQUESTS` under :data:`BATCH_BUDGETS`, in batch order.

    A wrong batch is told which of ``build_batch``'s rules it breaks (a budget, a decode's one
    token, a request's prompt, the order), never which entry is wrong or what it should be."""
    require_answer(answer, "a list of (request_id, tokens) pairs")
    try:
        got = [(str(rid), n) for rid, n in answer]
    except (TypeError, ValueError):
        raise AssertionError("give a list of (request_id, tokens) pairs") from None
    if sealed("ch06.batch").is_answer(got):
        return f"Correct: {got}."
    raise AssertionError(_batch_rule_broken(got))


def _batch_rule_broken(got: list[tuple[str, object]]) -> str:
    """Why ``got`` is not ``build_batch``'s batch, as the first rule of the policy it breaks."""
    left = {rid: n for rid, n, _ in BATCH_REQUESTS}
    decode = {rid for rid, _, phase in BATCH_REQUESTS if phase == Phase.DECODE}
    listed = [rid for rid, _, _ in BATCH_REQUESTS]
    b = BATCH_BUDGETS
    for rid, n in got:
        if rid not in left:
            return f"there is no request {rid!r} in BATCH_REQUESTS."
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            return f"{rid}: a scheduled request gets a positive whole number of tokens."
    ids = [rid for rid, _ in got]
    if len(set(ids)) != len(ids):
        return "a request appears twice; build_batch schedules each at most once a step."
    if len(got) > b["max_sequences"]:
        return f"{len(got)} requests exceed max_sequences ({b['max_sequences']})."
    total = sum(n for _, n in got)
    if total > b["token_budget"]:
        return f"{total} tokens exceed the token budget ({b['token_budget']})."
    for rid, n in got:
        if rid in decode and n != 1:
            return f"{rid} is decoding: a decode computes one token a step."
        if rid not in decode and n > min(left[rid], b["prefill_chunk"]):
            return (f"{rid} gets {n} tokens, more than its prompt has left or prefill_chunk "
                    "allows.")
    phases = ["decode" if rid in decode else "prefill" for rid in ids]
    if "prefill" in phases and "decode" in phases[phases.index("prefill"):]:
        return "a prefill comes before a decode: build_batch serves every decode first."
    for group in (decode, set(left) - decode):
        mine = [rid for rid in ids if rid in group]
        if mine != [rid for rid in listed if rid in mine]:
            return ("two requests of the same phase are out of the order in which "
                    "BATCH_REQUESTS lists them.")
    prefills = [rid for rid in listed if rid not in decode]
    mine = [rid for rid in ids if rid not in decode]
    if mine and prefills[:len(mine)] != mine:
        return ("a prefill is passed over for one listed after it; build_batch does not skip "
                "a prefill it can still give tokens to.")
    if len(got) < b["max_sequences"]:
        if any(rid in decode and rid not in ids for rid in listed):
            return "a decoding request is left out: build_batch serves every decode first."
        if total < b["token_budget"] and any(rid not in ids for rid in prefills):
            return ("budget and a sequence slot are left while a prefill waits: build_batch "
                    "stops only when one of them is spent or no request is left.")
    return ("your batch obeys the budgets and the order, but it is not build_batch's: revisit "
            "how much of the budget each prefill gets once the decodes are served.")


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
    drive(scheduler, arrivals={1: deadline_workload()}, check=check_scheduler, max_steps=500)
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
            f"the urgent request got its first token at step {step}, after its deadline "
            f"(step {URGENT_DEADLINE}); the baseline gets it there at step {base}, the default "
            f"order at step {default}.")
    unfinished = [r for r, q in reqs.items() if q.status != RequestStatus.FINISHED]
    if unfinished:
        raise AssertionError(f"{unfinished} did not finish")
    return (f"Correct: first token at step {step} (baseline {base}, priority-first {default}); "
            "all four requests finished.")


# ------------------------------------------------------------------- TTFT behind finishing decodes

#: Exercise 3: ``chats`` requests are decoding, each with ``left`` tokens still to generate,
#: when a ``doc``-token prompt arrives (before step ``arrive``); one budget for all.
DOC_BEHIND_DECODES = {"chats": 40, "left": 10, "doc": 1000, "budget": 64, "prefill_chunk": 48,
                      "max_num_seqs": 64, "arrive": 3}

def _measured_doc_ttft(chats: int, left: int, doc: int, budget: int, prefill_chunk: int,
                       max_num_seqs: int = 64, arrive: int = 3) -> int:
    """The document's TTFT in steps (first-token step minus arrival step) under
    ``BaselineScheduler``, measured on the real scheduler stepped by ``EngineCore``."""
    from kvlab.core.engine_core import EngineCore
    from kvlab.sim.executor import CostModelExecutor

    if chats > max_num_seqs - 1 or chats >= budget:
        raise ValueError("the chats must leave a sequence slot and budget for the document")
    sched = BaselineScheduler(KVCacheManager(num_blocks=4 * (doc + chats * (arrive + left)),
                                             block_size=16),
                              SchedulerConfig(max_num_seqs=max_num_seqs,
                                              max_num_batched_tokens=budget,
                                              prefill_chunk=prefill_chunk))
    # one-token prompts: each chat has its first token after step 1, then decodes one per step,
    # so before step ``arrive`` it has ``left`` tokens still to generate
    for i in range(chats):
        sched.add_request(RuntimeRequest(f"c{i}", (i + 1,), max_tokens=arrive - 1 + left))
    core = EngineCore(sched, CostModelExecutor(sched.get_request, lambda request: 5),
                      forget_ended=False)
    for step in range(1, 100_000):
        if step == arrive:
            core.add_request(RuntimeRequest("doc", tuple(range(1, doc + 1)), max_tokens=1))
        core.step()
        if step >= arrive:
            request = sched.get_request("doc")
            if request.first_token_step is not None:
                return request.first_token_step - request.arrival_step
    raise AssertionError("the document never got its first token")  # pragma: no cover


def _draw_doc_case(rng) -> dict:
    budget = rng.choice((64, 96, 128))
    return {"chats": rng.randint(0, min(60, budget - 1)), "left": rng.randint(1, 30),
            "doc": rng.randint(1, 1200), "budget": budget,
            "prefill_chunk": rng.randint(4, budget)}


def check_doc_ttft(doc_ttft) -> str:
    """Exercise 3: ``doc_ttft(chats, left, doc, budget, prefill_chunk)``: the document's TTFT, in
    steps, behind ``chats`` decoding requests with ``left`` tokens each to generate, under the
    baseline scheduler (``max_num_seqs=64``, the document arriving before step 3). The check
    runs it on :data:`DOC_BEHIND_DECODES` and on workloads drawn at each call, compared with the
    scheduler: one verdict, naming no workload."""
    require_answer(doc_ttft, "your doc_ttft function")
    if not callable(doc_ttft):
        raise AssertionError("pass a function (chats, left, doc, budget, prefill_chunk) -> "
                             "steps")
    rng = hidden_rng()
    shown = {k: DOC_BEHIND_DECODES[k] for k in ("chats", "left", "doc", "budget",
                                                 "prefill_chunk")}
    for case in [shown] + [_draw_doc_case(rng) for _ in range(10)]:
        if doc_ttft(**case) != _measured_doc_ttft(**case):
            raise AssertionError("your rule does not agree with the scheduler on every "
                                 "workload: revisit what caps the document's share of a step "
                                 "while the chats decode and after they finish, and a document "
                                 "that is done before they are.")
    return ("Correct on every workload. While the chats decode, the document gets what their "
            "tokens leave of the budget, capped by the prefill chunk; once they finish, the "
            "chunk alone (or the budget, if smaller) caps it.")


# ------------------------------------------------------------------- chunked prefill and ITL

#: The chunk-size sweep of the chapter and of :func:`check_chunk_design`.
CHUNK_SWEEP = {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "requests": 80, "rate": 12.0,
               "prompt": (1024, 4096), "output": (64, 256), "seed": 0, "max_num_seqs": 64,
               "chunks": (256, 512, 1024, 2048, 4096), "itl_p99_slo_s": 0.020}


#: Exercise 4: the same workload, at half the rate, on another GPU, against another target.
CHUNK_DESIGN = {**CHUNK_SWEEP, "gpu": "A100-80GB SXM", "rate": 6.0, "itl_p99_slo_s": 0.030}


def run_chunk(chunk: int, setting: dict | None = None):
    """Simulate the workload of ``setting`` (default :data:`CHUNK_SWEEP`) with a token budget
    (and prefill chunk) of ``chunk`` tokens per step under the baseline scheduler; returns the
    ``SimResult``."""
    from kvlab.sim.costmodel import RooflineCostModel
    from kvlab.sim.executor import simulate
    from kvlab.sim.workload import make_workload, uniform

    d = CHUNK_SWEEP if setting is None else setting
    cm = RooflineCostModel.named(d["model"], d["gpu"])
    workload = make_workload(d["requests"], d["rate"], uniform(*d["prompt"]),
                             uniform(*d["output"]), seed=d["seed"])
    cfg = SchedulerConfig(max_num_seqs=d["max_num_seqs"], max_num_batched_tokens=chunk,
                          prefill_chunk=chunk)
    kv = KVCacheManager(cm.kv_blocks(block_size=16), 16, enable_prefix_caching=False)
    return simulate(BaselineScheduler(kv, cfg), workload, cm)


@functools.lru_cache(maxsize=32)
def _itl_p99(chunk: int, setting: tuple) -> float:
    from kvlab.sim.itl import inter_token_latencies, percentile

    return percentile(inter_token_latencies(run_chunk(chunk, dict(setting))), 99)


def itl_p99(chunk: int, setting: dict | None = None) -> float:
    """The p99 inter-token latency (seconds) of :func:`run_chunk` (memoised per setting)."""
    d = CHUNK_SWEEP if setting is None else setting
    return _itl_p99(chunk, tuple(sorted(d.items())))



#: Exercise 4: a predicted p99 ITL passes within this fraction of the simulator's. A prediction
#: scaled from the H100 sweep by the two GPUs' FLOP rates lands within a few percent.
CHUNK_PREDICTION_TOLERANCE = 0.25


def check_chunk_design(budget, predicted_p99_ms) -> str:
    """Exercise 4: the largest token budget in ``CHUNK_DESIGN['chunks']`` whose p99 inter-token
    latency meets ``CHUNK_DESIGN['itl_p99_slo_s']`` on ``CHUNK_DESIGN``'s GPU and load.

    ``predicted_p99_ms``: ``{budget: ms}``, your predicted p99 ITL at the chosen budget and at
    the next larger one (if any), each of which must be within
    :data:`CHUNK_PREDICTION_TOLERANCE` of what the simulator measures (a prediction outside it
    is refused without a direction, so the budget cannot be found by trying the options). The
    first wrong answer is recorded as the prediction (``_common.earlier_prediction``): a later,
    different answer is not graded, so the simulator cannot stand in for the prediction."""
    require_answer(budget, "your token budget")
    require_answer(predicted_p99_ms, "your predicted p99 ITL in ms, {budget: ms}")
    d = CHUNK_DESIGN
    chunks = d["chunks"]
    if isinstance(budget, bool) or budget not in chunks:
        raise AssertionError(f"choose one of {chunks}, got {budget!r}")
    larger = [c for c in chunks if c > budget]
    needed = [budget, *larger[:1]]
    if not isinstance(predicted_p99_ms, dict):
        raise AssertionError(f"give your predictions as a dict {{budget: ms}} for {needed}")
    for c in needed:
        ms = predicted_p99_ms.get(c)
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms > 0:
            raise AssertionError(f"give a predicted p99 ITL in ms (a positive number) for each "
                                 f"of {needed}; missing or not a number: {c}")
    close = all(abs(predicted_p99_ms[c] - itl_p99(c, d) * 1e3)
                <= CHUNK_PREDICTION_TOLERANCE * itl_p99(c, d) * 1e3 for c in needed)
    right = close and sealed("ch06.chunk_design").is_answer(budget)
    answer = [budget, {str(c): predicted_p99_ms[c] for c in needed}]
    earlier = earlier_prediction("ch06.chunk_design", answer, right)
    if earlier is not None:
        return graded_once(earlier)
    if not close:
        raise AssertionError(
            f"your predicted p99 ITLs are not both within {CHUNK_PREDICTION_TOLERANCE:.0%} of "
            "what the simulator measures: revisit what a step that carries a full prefill "
            "chunk costs on this GPU (is it bound by compute or by memory?), and which step "
            "sets the 99th percentile.")
    slo_ms = d["itl_p99_slo_s"] * 1e3
    if not sealed("ch06.chunk_design").is_answer(budget):  # the largest budget that meets it
        raise AssertionError(f"{budget} tokens is not the largest budget whose p99 inter-token "
                             f"latency stays within {slo_ms:.0f} ms: read your predictions "
                             "against the target again, budget by budget.")
    return (f"Correct: {budget} tokens is the largest budget whose p99 ITL stays within "
            f"{slo_ms:.0f} ms on the {d['gpu']}. A step that carries a full prefill chunk is "
            "compute-bound, so its time scales with the chunk and inversely with the GPU's "
            "FLOP rate: the budget that met a target on one GPU is the wrong one on another.")


# ------------------------------------------------------------------- a dashboard's ITL to debug

#: Exercise 5: a chat service with short answers, on the simulated H100, budget 512.
DASHBOARD = {**CHUNK_SWEEP, "requests": 40, "prompt": (256, 1024), "output": (8, 24)}


def stream_gaps(result) -> list[float]:
    """The gaps between consecutive output tokens of each request, sorted (seconds), as the
    service's dashboard computes them from a simulated run (``SimResult``): every request's
    stream of token times, then the differences within each stream."""
    streams: dict[str, list[float]] = {}
    for record in result.requests:
        streams[record.request_id] = [record.arrival]
    for step in result.steps:
        end = step.start + step.duration
        for request_id, _num_tokens, is_prefill in step.chunks:
            if not is_prefill:
                streams[request_id].append(end)
    return sorted(b - a for times in streams.values() for a, b in pairwise(times))


def check_stream_gaps(gaps_fn) -> str:
    """Exercise 5: ``gaps_fn(result)`` must return exactly the inter-token gaps a streaming
    client sees, sorted, on :data:`DASHBOARD`'s run (and on a second run with another budget)."""
    from kvlab.sim.itl import inter_token_latencies

    require_answer(gaps_fn, "your gaps function")
    if not callable(gaps_fn):
        raise AssertionError("pass a function result -> sorted list of gaps in seconds")
    for budget in (512, 2048):
        result = run_chunk(budget, {**DASHBOARD, "chunks": (budget,)})
        want = inter_token_latencies(result)
        got = sorted(float(g) for g in gaps_fn(result))
        if len(got) == len(want) and all(abs(a - b) <= 1e-12
                                         for a, b in zip(got, want, strict=True)):
            continue
        if not got:
            raise AssertionError(f"with a budget of {budget}, your function returns no gaps")
        raise AssertionError(f"with a budget of {budget}, your gaps are not the ones a "
                             "streaming client sees: revisit where a request's stream of "
                             "tokens starts, and which steps give it a token.")
    return ("Correct: your gaps are the client's. A stream starts at the first token, not at "
            "the arrival: the wait before it is the TTFT, a different number with its own SLO, "
            "and mixing it into the ITL makes the tail look like a scheduling problem.")
