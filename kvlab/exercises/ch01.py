"""Chapter 1 exercises: KV bytes per token of a quantised cache, requests that fit on one GPU,
where the KV traffic overtakes the weights, the TP rule, a rule that picks the fewest GPUs for a
requirement, and a capacity estimate to debug and fix.

Every check asks for something trying cannot reach: an intermediate quantity checked before
the answer built on it, linked quantities checked together with one verdict, or a function of
the reader's that the check runs on cases drawn afresh at every call (``_common.hidden_rng``)
and compares with what kvlab's planner or cost model does on them, saying only whether it agreed
on all of them. A check with one right answer compares against its sealed truth
(``_common.sealed``; the instructor edition computes it with :mod:`kvlab.labs.capacity` under
the assumptions stated here). A wrong answer is told what to revisit, never which way it is off
or which case failed.
"""

from __future__ import annotations

from kvlab.exercises._common import hidden_rng, require_answer, sealed
from kvlab.labs.capacity import DTYPE_BYTES, GiB, kv_heads_per_rank, plan_capacity
from kvlab.reference import kv_bytes
from kvlab.sim.catalog import GPUS, MODELS, get_gpu, get_model

#: The cache of :func:`check_kv_bytes_per_token` (exercise 1).
KV_TOKEN_CASE = {"model": "Llama-3.1-405B", "kv_dtype": "int4", "scale_group": 64,
                 "scale_bytes": 2, "tp": 1}

#: Assumptions of :func:`check_mixed_pool` (exercise 2, also printed in the chapter).
H100_ASSUMPTIONS = {
    "model": "Qwen2.5-7B",
    "gpu": "H100-80GB SXM",          # total as CUDA reports it (79.11 GiB), as vLLM uses it
    "weight_dtype": "bf16",          # 2 bytes x 7,615,616,512 parameters
    "gpu_memory_utilization": 0.9,
    "reserve_bytes": 4 * GiB,        # activations and workspace
    "block_size": 16,
    "kv_dtype": "fp8",
    "pair": (32768, 8192),           # requests arrive in pairs: one of each length
}

#: The decode step of :func:`check_kv_overtakes_weights` (exercise 3): Llama 3 8B in bf16 on the
#: roofline cost model, every request holding ``context_len`` tokens (the printed case).
OVERTAKE_CASE = {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "dtype": "bf16",
                 "context_len": 4096}

#: The models exercise 3's hidden cases draw from (their bf16 weights fit one GPU).
OVERTAKE_MODELS = ("Llama-3-8B", "Qwen2.5-7B", "Mistral-7B-v0.1")

#: The model and TP sizes exercise 4 prints (the check also runs shapes it does not print).
TP_RANK_CASE = {"model": "Qwen2.5-7B", "kv_dtype": "bf16", "tp": (2, 8)}

#: Exercise 5's choices: tensor-parallel sizes, and KV dtypes from the most faithful to the
#: smallest (a rule prefers the first that holds the requirement at the fewest GPUs).
TP_CHOICES = (1, 2, 4, 8, 16)
KV_CHOICES = ("bf16", "fp8", "int4")

#: The requirement exercise 5 prints (the first case :func:`check_tp_design` runs).
TP_DESIGN = {
    "model": "Llama-3-70B",
    "gpu": "H100-80GB SXM",
    "context_len": 16384,
    "min_requests": 40,
    "reserve_bytes": 4 * GiB,
}

#: Requirements :func:`check_tp_design` always runs beside those it draws: one that no choice
#: holds, one that a bf16 cache cannot hold.
TP_DESIGN_EDGES = (
    {"model": "Llama-3.1-405B", "gpu": "H100-80GB SXM", "context_len": 131072,
     "min_requests": 64, "reserve_bytes": 4 * GiB},
    {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "context_len": 131072, "min_requests": 4,
     "reserve_bytes": 4 * GiB},
)

#: The keys a case of :func:`check_suspect_counterexample` (exercise 6) must give.
SUSPECT_CASE_KEYS = ("model", "gpu", "kv_dtype", "context_len", "tp")

#: The cases :func:`check_suspect_counterexample` runs the reader's fixed estimate on (4 GiB
#: reserve, the other settings at their defaults): contexts on and off the block size, a plan
#: whose weights do not fit, sharded and replicated KV heads.
SUSPECT_FIX_CASES = (
    {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "kv_dtype": "bf16", "context_len": 32768,
     "tp": 1},
    {"model": "Llama-3-8B", "gpu": "H200-141GB SXM", "kv_dtype": "fp8", "context_len": 3000,
     "tp": 1},
    {"model": "Qwen2.5-7B", "gpu": "H100-80GB SXM", "kv_dtype": "bf16", "context_len": 517,
     "tp": 8},
    {"model": "Llama-3-70B", "gpu": "H100-80GB SXM", "kv_dtype": "int8", "context_len": 9001,
     "tp": 4},
    {"model": "Llama-3-70B", "gpu": "H100-80GB SXM", "kv_dtype": "bf16", "context_len": 8192,
     "tp": 1},
    {"model": "Llama-3.1-405B", "gpu": "H200-141GB SXM", "kv_dtype": "int4",
     "context_len": 100_003, "tp": 16},
    {"model": "Mistral-7B-v0.1", "gpu": "H100-80GB SXM", "kv_dtype": "fp8",
     "context_len": 1, "tp": 2},
)


def _int_answer(value, what: str) -> int:
    require_answer(value, what)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(
            value).is_integer():
        raise AssertionError(f"{what}: expected a whole number, got {value!r}")
    return int(value)


def _float_answer(value, what: str) -> float:
    require_answer(value, what)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AssertionError(f"{what}: expected a number, got {value!r}")
    return float(value)


def check_kv_bytes_per_token(element_bytes, bytes_per_token) -> str:
    """Exercise 1: the bytes one K or V element of :data:`KV_TOKEN_CASE`'s int4 cache takes,
    scales included, then the bytes of K and V one token needs (all layers, one GPU). Checked
    in that order: the per-token bytes only once the element size is right."""
    element = _float_answer(element_bytes, "bytes per element")
    per_token = _float_answer(bytes_per_token, "KV bytes per token")
    if not sealed("ch01.kv_bytes_per_token.element").is_answer(element):
        raise AssertionError("the bytes per element are not right: revisit what one fp16 "
                             "scale shared by a group of elements adds to each of them.")
    if not sealed("ch01.kv_bytes_per_token").is_answer((element, per_token)):
        raise AssertionError("the element size is right, the bytes per token are not: "
                             "revisit which factors of M_KV make up one token (K and V, "
                             "every layer, every KV head, the head dimension).")
    return (f"Correct: {per_token:,.0f} bytes per token, scales included "
            f"({per_token / 1024:.1f} KiB).")


def check_mixed_pool(blocks, pairs, idle_blocks) -> str:
    """Exercise 2: :data:`H100_ASSUMPTIONS`'s pool with an fp8 cache, filled with requests that
    come in pairs (one of each length of ``pair``): its KV blocks, the most whole pairs it holds
    at once, and the blocks those pairs leave idle. The planner counts one context length; the
    pairs are the reader's. The three are graded together, with one verdict."""
    answer = [_int_answer(blocks, "blocks"), _int_answer(pairs, "pairs"),
              _int_answer(idle_blocks, "idle blocks")]
    if not sealed("ch01.mixed_pool").is_answer(answer):
        raise AssertionError("the three numbers are not all right: revisit the budget "
                             "(utilization x CUDA's total - weights - reserve), the bytes of "
                             "one fp8 block, the whole blocks each request of a pair needs, "
                             "and what is left once whole pairs are placed.")
    return (f"Correct: {answer[0]:,} blocks hold {answer[1]} pairs ({2 * answer[1]} requests), "
            f"with {answer[2]:,} blocks idle: too few for another pair, though a lone short "
            "request would fit.")


def _overtake_truth(model: str, context_len: int) -> tuple[int, int]:
    """(KV bytes one request holding ``context_len`` tokens moves per decode step, the smallest
    batch whose KV bytes reach the weights'), as the roofline cost model counts them."""
    from kvlab.sim.costmodel import RooflineCostModel

    cm = RooflineCostModel.named(model, OVERTAKE_CASE["gpu"], dtype=OVERTAKE_CASE["dtype"])
    one = (1, context_len - 1, True)            # one new token after context_len - 1 cached

    def kv(batch: int) -> float:
        return cm.cost([one] * batch).bytes - cm.weight_bytes

    low, high = 1, 1
    while kv(high) < cm.weight_bytes:           # the cost model's bytes grow with the batch
        low, high = high, 2 * high
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if kv(mid) < cm.weight_bytes else (low, mid)
    return int(kv(1)), low


def check_kv_overtakes_weights(overtake) -> str:
    """Exercise 3: ``overtake(model, context_len)`` returns ``(request_bytes, batch)``: the KV
    bytes one decoding request holding ``context_len`` tokens moves in one step (the roofline
    cost model's count, bf16, :data:`OVERTAKE_CASE`'s GPU) and the smallest batch of such
    requests whose step moves at least as many KV bytes as weight bytes. Run on the printed
    case and on cases drawn at each call (models of :data:`OVERTAKE_MODELS`, contexts from 256
    to 131,072 tokens), compared with the cost model: one verdict for all of them."""
    require_answer(overtake, "your overtake function")
    if not callable(overtake):
        raise AssertionError("pass a function overtake(model, context_len) -> (request_bytes, "
                             "batch)")
    rng = hidden_rng()
    cases = [(OVERTAKE_CASE["model"], OVERTAKE_CASE["context_len"])] + [
        (rng.choice(OVERTAKE_MODELS), rng.randint(256, 131072)) for _ in range(12)]
    for model, context_len in cases:
        got = overtake(model, context_len)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise AssertionError(f"your function returned {got!r}: return a pair "
                                 "(request_bytes, batch)")
        if [_int_answer(g, "overtake's values") for g in got] != list(
                _overtake_truth(model, context_len)):
            raise AssertionError("your function is not right on every case: revisit what a "
                                 "decoding request reads and writes (the K and V of every "
                                 "position, every layer), what the weights cost per step "
                                 "whatever the batch, and that the batch is the smallest that "
                                 "reaches them.")
    request_bytes, batch = _overtake_truth(OVERTAKE_CASE["model"], OVERTAKE_CASE["context_len"])
    return (f"Correct on {len(cases)} cases. For the printed one, {request_bytes:,} bytes per "
            f"request: from batch {batch} on the KV cache, not the weights, is most of a decode "
            "step's memory traffic.")


def check_tp_kv_per_rank(kv_per_rank) -> str:
    """Exercise 4: ``kv_per_rank(layers, kv_heads, head_dim, element_bytes, tp)`` returns
    ``(kv_heads_on_one_rank, kv_bytes_per_token_on_one_rank)`` for a cache sharded by head.
    Run on :data:`TP_RANK_CASE`'s model at its TP sizes and on shapes drawn at each call; one
    verdict for all of them."""
    require_answer(kv_per_rank, "your kv_per_rank function")
    if not callable(kv_per_rank):
        raise AssertionError("pass a function kv_per_rank(layers, kv_heads, head_dim, "
                             "element_bytes, tp) -> (heads, bytes)")
    qwen = get_model(TP_RANK_CASE["model"])
    printed = [(qwen.layers, qwen.kv_heads, qwen.head_dim, 2, tp) for tp in TP_RANK_CASE["tp"]]
    rng = hidden_rng()
    drawn = [(rng.randint(1, 128), rng.choice((1, 2, 4, 8, 16, 32)),
              rng.choice((64, 80, 96, 128, 256)), rng.choice((1, 2, 4)),
              rng.choice((1, 2, 4, 8, 16, 32, 64))) for _ in range(20)]
    for layers, heads, head_dim, element, tp in printed + drawn:
        per_rank = kv_heads_per_rank(heads, tp)
        want = [per_rank, kv_bytes(layers, 1, 1, per_rank, head_dim, element)]
        got = kv_per_rank(layers, heads, head_dim, element, tp)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise AssertionError(f"your function returned {got!r}: return a pair (heads, "
                                 "bytes)")
        if [_float_answer(g, "kv_per_rank's values") for g in got] != want:
            raise AssertionError("your function is not right on every shape: revisit how a "
                                 "cache sharded by head divides across ranks, and what one "
                                 "rank holds once TP exceeds the number of KV heads.")
    (h2, b2), (h8, b8) = (kv_per_rank(*case) for case in printed)
    return (f"Correct on {len(printed) + len(drawn)} shapes. Qwen2.5-7B: {h2} and {h8} KV "
            f"heads per rank, {b2:,} and {b8:,} bytes per token: "
            f"{TP_RANK_CASE['tp'][1] // TP_RANK_CASE['tp'][0]} times the ranks divide the "
            f"per-rank cache by only {b2 // b8}.")


def _holds(case: dict, tp: int, kv_dtype: str) -> bool:
    """Whether ``plan_capacity`` holds ``case``'s requests at ``(tp, kv_dtype)``."""
    plan = plan_capacity(get_model(case["model"]), get_gpu(case["gpu"]), tp=tp,
                         kv_dtype=kv_dtype, context_len=case["context_len"],
                         reserve_bytes=case["reserve_bytes"])
    return plan.max_requests >= case["min_requests"]


def _meets(case: dict, got) -> bool:
    """Whether ``got`` is what exercise 5 asks for on ``case``: a choice that holds the
    requests while no choice before it in the stated order (fewer GPUs first, then the KV
    dtypes in :data:`KV_CHOICES`'s order) does, or None when no choice holds them."""
    order = [(tp, kv) for tp in TP_CHOICES for kv in KV_CHOICES]
    if got is None:
        return not any(_holds(case, *choice) for choice in order)
    place = order.index((got[0], got[1]))
    return _holds(case, *order[place]) and not any(_holds(case, *c) for c in order[:place])


def check_tp_design(rule) -> str:
    """Exercise 5: ``rule(model, gpu, context_len, min_requests, reserve_bytes)`` (names of the
    catalogue's model and GPU) returns ``(tp, kv_dtype)``: the smallest TP of
    :data:`TP_CHOICES` at which some KV dtype of :data:`KV_CHOICES` holds ``min_requests``
    requests, with the first such dtype in that order; or None when no choice does. Run on
    :data:`TP_DESIGN` and on requirements drawn at each call, judged with ``plan_capacity``;
    one verdict for all of them."""
    require_answer(rule, "your rule")
    if not callable(rule):
        raise AssertionError("pass a function rule(model, gpu, context_len, min_requests, "
                             "reserve_bytes) -> (tp, kv_dtype) or None")
    rng = hidden_rng()
    cases = [TP_DESIGN, *TP_DESIGN_EDGES] + [
        {"model": rng.choice(sorted(MODELS)), "gpu": rng.choice(sorted(GPUS)),
         "context_len": rng.choice((2048, 4096, 8192, 16384, 32768, 131072)),
         "min_requests": round(2 ** rng.uniform(0, 10)), "reserve_bytes": 4 * GiB}
        for _ in range(16)]
    for case in cases:
        got = rule(**case)
        if got is not None and not (
                isinstance(got, (tuple, list)) and len(got) == 2 and got[0] in TP_CHOICES
                and got[1] in KV_CHOICES):
            raise AssertionError(f"your rule returned {got!r}: return a pair (tp, kv_dtype) "
                                 f"with tp in {TP_CHOICES} and kv_dtype in {KV_CHOICES}, or "
                                 "None")
        if not _meets(case, got):
            raise AssertionError(
                "your rule's choice is not the one asked for on every requirement: revisit "
                "the order of the criteria (fewest GPUs first, then the most faithful KV "
                "dtype that holds the requests at that size), what max_requests says at each "
                "choice, and the case where no choice holds them.")
    d = TP_DESIGN
    tp, kv_dtype = rule(**d)
    plan = plan_capacity(get_model(d["model"]), get_gpu(d["gpu"]), tp=tp, kv_dtype=kv_dtype,
                         context_len=d["context_len"], reserve_bytes=d["reserve_bytes"])
    return (f"Correct on {len(cases)} requirements. For the printed one: TP={tp} "
            f"with {kv_dtype} KV holds {plan.max_requests} requests of {d['context_len']:,} "
            "tokens. (Measure the accuracy of a quantised cache before you ship it.)")


def suspect_max_requests(model, gpu, *, kv_dtype="bf16", context_len=8192, tp=1,
                         block_size=16, gpu_memory_utilization=0.9,
                         reserve_bytes=4 * GiB):
    """Exercise 6: a colleague's quick capacity estimate. It matches
    ``plan_capacity`` on every example of the chapter."""
    per_token = kv_bytes(model.layers, 1, 1, kv_heads_per_rank(model.kv_heads, tp),
                         model.head_dim, DTYPE_BYTES[kv_dtype])
    budget = (gpu_memory_utilization * gpu.engine_memory_bytes
              - model.weight_bytes("bf16") / tp - reserve_bytes)
    blocks = int(max(budget, 0) // (per_token * block_size))
    return blocks * block_size // context_len


def _suspect_args(case) -> tuple:
    """``(model, gpu, keyword arguments)`` of a case dict, or AssertionError naming the flaw."""
    if not isinstance(case, dict) or set(case) != set(SUSPECT_CASE_KEYS):
        raise AssertionError(f"give a dict with exactly the keys {SUSPECT_CASE_KEYS}")
    try:
        model, gpu = get_model(case["model"]), get_gpu(case["gpu"])
        args = dict(kv_dtype=case["kv_dtype"], context_len=case["context_len"], tp=case["tp"])
        plan_capacity(model, gpu, reserve_bytes=4 * GiB, **args)
    except (KeyError, ValueError) as err:
        raise AssertionError(f"that case is not valid: {err}") from None
    return model, gpu, args


def check_suspect_counterexample(case, fixed_max_requests) -> str:
    """Exercise 6: a case (dict with :data:`SUSPECT_CASE_KEYS`) on which
    :func:`suspect_max_requests` promises more requests than ``plan_capacity`` holds (4 GiB
    reserve), and ``fixed_max_requests``, the estimate repaired (same signature as the
    suspect), which must agree with ``plan_capacity`` on that case and on
    :data:`SUSPECT_FIX_CASES`."""
    require_answer(case, "case")
    require_answer(fixed_max_requests, "fixed_max_requests")
    model, gpu, args = _suspect_args(case)
    truth = plan_capacity(model, gpu, reserve_bytes=4 * GiB, **args).max_requests
    promised = suspect_max_requests(model, gpu, **args)
    if promised == truth:
        raise AssertionError("both give the same number of requests here: the bug does not "
                             "show on this case.")
    if promised < truth:
        raise AssertionError("the suspect promises fewer requests than fit here: safe, if "
                             "wasteful. Find a case where it promises more.")
    if not callable(fixed_max_requests):
        raise AssertionError("the case is right; pass your repaired estimate as a function "
                             "with the suspect's signature")
    for other in (case, *SUSPECT_FIX_CASES):
        m, g, a = _suspect_args(other)
        want = plan_capacity(m, g, reserve_bytes=4 * GiB, **a).max_requests
        got = fixed_max_requests(m, g, **a)
        if isinstance(got, bool) or not isinstance(got, int) or got != want:
            raise AssertionError("the case is right; your repaired estimate disagrees with "
                                 "plan_capacity on some case: revisit what one request of "
                                 "context_len tokens needs of the pool (and what the pool "
                                 "holds when the weights do not fit).")
    return (f"Correct: the suspect promises {promised} requests where {truth} fit, and your "
            f"repair agrees with plan_capacity on {len(SUSPECT_FIX_CASES) + 1} cases. An "
            "engine that trusted the suspect would run out of KV memory while the requests it "
            "admitted were all still running.")
