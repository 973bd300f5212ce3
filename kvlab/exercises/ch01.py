"""Chapter 1 exercises: KV bytes per token of a quantised cache, requests that fit on one GPU,
where the KV traffic overtakes the weights, the TP rule, a rule that picks the fewest GPUs for a
requirement, and a capacity estimate to debug and fix.

Every check asks for something trying cannot reach: an intermediate quantity (a byte or block
count) checked before the answer built on it, linked quantities checked together, or a function
of the reader's that the check runs on cases the chapter does not print. A check with one right
answer compares against its sealed truth (``_common.sealed``; the instructor edition computes it
with :mod:`kvlab.labs.capacity` and the roofline cost model under the assumptions stated here); the
function checks compare with ``plan_capacity`` or with sealed per-case truths. A wrong answer
is told which quantity is wrong and what to revisit, never which way it is off.
"""

from __future__ import annotations

from kvlab.exercises._common import require_answer, sealed
from kvlab.labs.capacity import DTYPE_BYTES, GiB, kv_heads_per_rank, plan_capacity
from kvlab.reference import kv_bytes
from kvlab.sim.catalog import get_gpu, get_model

#: The cache of :func:`check_kv_bytes_per_token` (exercise 1).
KV_TOKEN_CASE = {"model": "Llama-3.1-405B", "kv_dtype": "int4", "scale_group": 32,
                 "scale_bytes": 2, "tp": 1}

#: Assumptions of :func:`check_max_requests_h100` (exercise 2, also printed in the chapter).
H100_ASSUMPTIONS = {
    "model": "Qwen2.5-7B",
    "gpu": "H100-80GB SXM",          # total as CUDA reports it (79.11 GiB), as vLLM uses it
    "weight_dtype": "bf16",          # 2 bytes x 7,615,616,512 parameters
    "gpu_memory_utilization": 0.9,
    "reserve_bytes": 4 * GiB,        # activations and workspace
    "block_size": 16,
    "context_len": 32768,
}

#: The decode step of :func:`check_kv_overtakes_weights` (exercise 3): Llama 3 8B in bf16 on the
#: roofline cost model, every request holding ``context_len`` tokens.
OVERTAKE_CASE = {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "dtype": "bf16",
                 "context_len": 4096}

#: The model and TP sizes of :func:`check_tp_kv_per_rank` (exercise 4).
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

#: The other requirements :func:`check_tp_design` runs the reader's rule on (the chapter does
#: not print them; their answers are sealed, one per case, in the same order).
TP_DESIGN_CASES = (
    TP_DESIGN,
    {"model": "Llama-3-70B", "gpu": "H200-141GB SXM", "context_len": 16384,
     "min_requests": 40, "reserve_bytes": 4 * GiB},
    {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "context_len": 8192, "min_requests": 40,
     "reserve_bytes": 4 * GiB},
    {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "context_len": 131072, "min_requests": 4,
     "reserve_bytes": 4 * GiB},
    {"model": "Llama-3-8B", "gpu": "H200-141GB SXM", "context_len": 8192,
     "min_requests": 600, "reserve_bytes": 4 * GiB},
    {"model": "Qwen2.5-7B", "gpu": "H100-80GB SXM", "context_len": 131072,
     "min_requests": 16, "reserve_bytes": 4 * GiB},
    {"model": "Llama-3-70B", "gpu": "H100-80GB SXM", "context_len": 4096, "min_requests": 8,
     "reserve_bytes": 4 * GiB},
    {"model": "Llama-3.1-405B", "gpu": "H100-80GB SXM", "context_len": 8192,
     "min_requests": 10, "reserve_bytes": 4 * GiB},
    {"model": "Llama-3.1-405B", "gpu": "H200-141GB SXM", "context_len": 32768,
     "min_requests": 64, "reserve_bytes": 4 * GiB},
    {"model": "Llama-3.1-405B", "gpu": "H100-80GB SXM", "context_len": 131072,
     "min_requests": 64, "reserve_bytes": 4 * GiB},
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


def check_max_requests_h100(bf16_blocks, bf16_requests, fp8_requests) -> str:
    """Exercise 2: the KV blocks of :data:`H100_ASSUMPTIONS`'s bf16 pool, then the concurrent
    32k-token requests it holds with a bf16 and with an fp8 cache (whole blocks each). The
    request counts are checked, together, only once the block count is right."""
    blocks = _int_answer(bf16_blocks, "bf16 blocks")
    bf16 = _int_answer(bf16_requests, "bf16 requests")
    fp8 = _int_answer(fp8_requests, "fp8 requests")
    if not sealed("ch01.max_requests_h100.blocks").is_answer(blocks):
        raise AssertionError("the bf16 pool's block count is not right: revisit the budget "
                             "(utilization x CUDA's total - weights - reserve) and the bytes "
                             "of one block (block size x KV bytes per token), whole blocks "
                             "only.")
    if not sealed("ch01.max_requests_h100").is_answer((blocks, bf16, fp8)):
        raise AssertionError("the block count is right, the request counts are not: revisit "
                             "how many whole blocks one request needs, and what a one-byte "
                             "element does to the number of blocks the same budget holds.")
    return (f"Correct: {blocks:,} blocks; {bf16} requests with bf16 KV, {fp8} with fp8 "
            "(halving the element size doubles the concurrency).")


def check_kv_overtakes_weights(request_bytes, batch) -> str:
    """Exercise 3: the KV bytes one :data:`OVERTAKE_CASE` request moves in one decode step (the
    roofline cost model's count), then the smallest batch whose step moves at least as many
    KV bytes as weight bytes. The batch is checked only once the bytes are right."""
    moved = _int_answer(request_bytes, "KV bytes one request moves")
    size = _int_answer(batch, "batch")
    if size < 1:
        raise AssertionError("a batch holds at least one request")
    if not sealed("ch01.kv_overtakes_weights.request_bytes").is_answer(moved):
        raise AssertionError("the KV bytes one request moves are not right: revisit what a "
                             "decoding request reads (the K and V of its whole context, every "
                             "layer) and writes (its one new token).")
    if not sealed("ch01.kv_overtakes_weights").is_answer((moved, size)):
        raise AssertionError("the bytes per request are right, the batch is not: revisit what "
                             "the batch's KV is compared with (every weight, read once per "
                             "step whatever the batch, at two bytes each) and that the answer "
                             "is the smallest batch that reaches it.")
    return (f"Correct: from batch {size} on the KV cache, not the weights, is most of a "
            "decode step's memory traffic.")


def check_tp_kv_per_rank(first_answer, second_answer) -> str:
    """Exercise 4: per-rank KV bytes per token of :data:`TP_RANK_CASE`'s model (sharded
    cache) at its two TP sizes, in that order."""
    c = TP_RANK_CASE
    answers = (_int_answer(first_answer, f"TP={c['tp'][0]} answer"),
               _int_answer(second_answer, f"TP={c['tp'][1]} answer"))
    concepts = ("revisit how a cache sharded by head divides across ranks",
                "revisit what one rank holds once TP exceeds the number of KV heads")
    problems = [f"TP={tp} is not right: {concept}"
                for tp, got, which, concept in zip(c["tp"], answers, ("first", "second"),
                                                   concepts, strict=True)
                if not sealed(f"ch01.tp_kv_per_rank.{which}").is_answer(got)]
    if problems:
        raise AssertionError("; ".join(problems) + ".")
    first, second = answers     # both right by now
    return (f"Correct: {first:,} and {second:,} bytes per rank: {c['tp'][1] // c['tp'][0]}"
            f" times the ranks divide the per-rank cache by only {first // second}, "
            "because a KV head cannot be split: past TP = KV heads it is replicated.")


def _describe(case: dict) -> str:
    return (f"{case['min_requests']} requests of {case['context_len']:,} tokens of "
            f"{case['model']} on {case['gpu']}s ({case['reserve_bytes'] / GiB:g} GiB reserve)")


def check_tp_design(rule) -> str:
    """Exercise 5: ``rule(model, gpu, context_len, min_requests, reserve_bytes)`` (names of the
    catalogue's model and GPU) returns ``(tp, kv_dtype)``: the smallest TP of
    :data:`TP_CHOICES` at which some KV dtype of :data:`KV_CHOICES` holds ``min_requests``
    requests, with the first such dtype in that order; or None when no choice does. Run on
    :data:`TP_DESIGN_CASES` (the printed requirement first); each case's answer is sealed."""
    require_answer(rule, "your rule")
    if not callable(rule):
        raise AssertionError("pass a function rule(model, gpu, context_len, min_requests, "
                             "reserve_bytes) -> (tp, kv_dtype) or None")
    for i, case in enumerate(TP_DESIGN_CASES):
        got = rule(**case)
        where = ("the printed requirement" if i == 0 else
                 f"another requirement ({_describe(case)})")
        if got is not None and not (
                isinstance(got, (tuple, list)) and len(got) == 2 and got[0] in TP_CHOICES
                and got[1] in KV_CHOICES):
            raise AssertionError(f"for {where} your rule returned {got!r}: return a pair "
                                 f"(tp, kv_dtype) with tp in {TP_CHOICES} and kv_dtype in "
                                 f"{KV_CHOICES}, or None")
        answer = None if got is None else [got[0], got[1]]
        if not sealed(f"ch01.tp_design.case{i}").is_answer(answer):
            raise AssertionError(
                f"for {where} your rule's choice is not the one asked for: revisit the order "
                "of the criteria (fewest GPUs first, then the most faithful KV dtype that "
                "holds the requests at that size), what max_requests says at each choice, "
                "and the case where no choice holds them.")
    d = TP_DESIGN
    tp, kv_dtype = rule(**d)
    plan = plan_capacity(get_model(d["model"]), get_gpu(d["gpu"]), tp=tp, kv_dtype=kv_dtype,
                         context_len=d["context_len"], reserve_bytes=d["reserve_bytes"])
    return (f"Correct on all {len(TP_DESIGN_CASES)} requirements. For the printed one: TP={tp} "
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
            shown = "your case" if other is case else f"the case {other}"
            raise AssertionError(f"the case is right; your repaired estimate disagrees with "
                                 f"plan_capacity on {shown}: revisit what one request of "
                                 "context_len tokens needs of the pool (and what the pool "
                                 "holds when the weights do not fit).")
    return (f"Correct: the suspect promises {promised} requests where {truth} fit, and your "
            f"repair agrees with plan_capacity on {len(SUSPECT_FIX_CASES) + 1} cases. An "
            "engine that trusted the suspect would run out of KV memory while the requests it "
            "admitted were all still running.")
