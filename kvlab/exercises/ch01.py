"""Chapter 1 exercises: KV bytes per token, requests that fit on one GPU, where the KV traffic
overtakes the weights, the TP rule, and a TP/dtype design for Llama 3 70B.

Every check computes the truth with :mod:`kvlab.core.capacity` (and the roofline cost model)
under the assumptions the exercise states, and raises ``AssertionError`` saying what is wrong
(too high, too low, which rule) without printing the expected value.
"""

from __future__ import annotations

from kvlab.core.capacity import DTYPE_BYTES, GiB, plan_capacity
from kvlab.core.catalog import get_gpu, get_model
from kvlab.reference import kv_bytes

from ._common import require_answer

#: Assumptions of :func:`check_max_requests_h100` (also printed in the chapter).
H100_ASSUMPTIONS = {
    "model": "Llama-3-8B",
    "gpu": "H100-80GB SXM",          # total as CUDA reports it: 79.11 GiB, as vLLM uses it
    "weight_dtype": "bf16",          # 2 bytes x 8,030,261,248 parameters
    "gpu_memory_utilization": 0.9,
    "reserve_bytes": 4 * GiB,        # activations and workspace
    "block_size": 16,
    "context_len": 32768,
}

#: The requirement of :func:`check_tp_design` (exercise 5).
TP_DESIGN = {
    "model": "Llama-3-70B",
    "gpu": "H100-80GB SXM",
    "context_len": 16384,
    "min_requests": 40,
    "reserve_bytes": 4 * GiB,
    "tp_choices": (1, 2, 4, 8, 16),
}


def _int_answer(value, what: str) -> int:
    require_answer(value, what)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(
            value).is_integer():
        raise AssertionError(f"{what}: expected a whole number, got {value!r}")
    return int(value)


def _direction(got: int, truth: int) -> str:
    return "too high" if got > truth else "too low"


def check_kv_bytes_per_token(answer) -> str:
    """Bytes of K and V that one token of Llama-3-70B needs in bf16, all layers, one GPU."""
    answer = _int_answer(answer, "KV bytes per token")
    m = get_model("Llama-3-70B")
    truth = kv_bytes(m.layers, 1, 1, m.kv_heads, m.head_dim, 2)
    if answer != truth:
        hint = ""
        if answer == truth // 2:
            hint = " Did you forget that both K and V are cached (the factor 2)?"
        elif answer == truth * m.gqa_group:
            hint = " Use the KV heads, not the query heads: that is GQA."
        raise AssertionError(f"{answer:,} is {_direction(answer, truth)}.{hint}")
    return f"Correct: {truth:,} bytes = {truth // 1024} KiB per token."


def check_max_requests_h100(bf16_answer, fp8_answer) -> str:
    """Concurrent 32k-token requests of Llama-3-8B on one H100-80GB, bf16 vs fp8 KV cache.

    Assumptions: :data:`H100_ASSUMPTIONS` (CUDA's total, 90% usable, bf16 weights, 4 GiB
    reserve, blocks of 16 tokens, each request needs whole blocks for 32,768 tokens).
    """
    bf16 = _int_answer(bf16_answer, "bf16 answer")
    fp8 = _int_answer(fp8_answer, "fp8 answer")
    a = H100_ASSUMPTIONS
    common = dict(context_len=a["context_len"], block_size=a["block_size"],
                  gpu_memory_utilization=a["gpu_memory_utilization"],
                  reserve_bytes=a["reserve_bytes"], weight_dtype=a["weight_dtype"])
    model, gpu = get_model(a["model"]), get_gpu(a["gpu"])
    truth = {d: plan_capacity(model, gpu, kv_dtype=d, **common).max_requests
             for d in ("bf16", "fp8")}
    datasheet = {d: plan_capacity(model, gpu, kv_dtype=d, total_memory="datasheet",
                                  **common).max_requests for d in ("bf16", "fp8")}
    wrong = [f"{d}: {got} is {_direction(got, truth[d])}" for d, got in (("bf16", bf16),
             ("fp8", fp8)) if got != truth[d]]
    if wrong:
        hint = " Budget = 0.9 x total - weights - 4 GiB; divide by one 32k request; round down."
        if (bf16, fp8) == (datasheet["bf16"], datasheet["fp8"]):
            hint = (" You planned from the datasheet's 80e9 bytes; vLLM multiplies the total"
                    " CUDA reports (79.11 GiB on an H100) by gpu_memory_utilization.")
        raise AssertionError("; ".join(wrong) + "." + hint)
    return (f"Correct: {truth['bf16']} requests with bf16 KV, {truth['fp8']} with fp8 "
            "(halving the element size doubles the concurrency).")


def check_kv_overtakes_weights(answer) -> str:
    """Smallest decode batch of 4,096-token Llama-3-8B requests (bf16 weights and KV) whose
    step reads at least as many KV bytes as weight bytes (the roofline cost model's bytes)."""
    from kvlab.sim.costmodel import RooflineCostModel

    batch = _int_answer(answer, "batch")
    if batch < 1:
        raise AssertionError("a batch holds at least one request")
    cm = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM")

    def kv_at_least_weights(b: int) -> bool:
        return cm.cost([(1, 4095, True)] * b).bytes - cm.weight_bytes >= cm.weight_bytes

    if not kv_at_least_weights(batch):
        raise AssertionError(f"At batch {batch} the weights still move more bytes than the "
                             "KV: too low. Each request reads its 4,096 cached tokens and "
                             "writes one.")
    if kv_at_least_weights(batch - 1):
        raise AssertionError(f"{batch} is too high: a smaller batch already reads as many KV "
                             "bytes as weight bytes.")
    return (f"Correct: from batch {batch} on the KV cache, not the weights, is most of a "
            "decode step's memory traffic.")


def check_tp_kv_per_rank(tp8_answer, tp16_answer) -> str:
    """Per-rank KV bytes per token of Llama-3-70B (bf16, sharded cache) at TP=8 and TP=16."""
    tp8 = _int_answer(tp8_answer, "TP=8 answer")
    tp16 = _int_answer(tp16_answer, "TP=16 answer")
    m = get_model("Llama-3-70B")
    truth = {tp: int(plan_capacity(m, 10**15, tp=tp).kv_bytes_per_token) for tp in (8, 16)}
    problems = [f"TP={tp}: {got:,} is {_direction(got, truth[tp])}"
                for tp, got in ((8, tp8), (16, tp16)) if got != truth[tp]]
    if problems:
        hint = ""
        if tp8 == truth[8] and tp16 < truth[16]:
            hint = (" With 16 ranks and 8 KV heads a rank cannot hold half a head: the heads"
                    " are replicated.")
        raise AssertionError("; ".join(problems) + "." + hint)
    return (f"Correct: {truth[8]:,} bytes at both TP=8 and TP=16; beyond TP = KV heads the "
            "cache is replicated, not divided.")


def _design_plan(tp: int, kv_dtype: str):
    d = TP_DESIGN
    return plan_capacity(get_model(d["model"]), get_gpu(d["gpu"]), tp=tp, kv_dtype=kv_dtype,
                         context_len=d["context_len"], reserve_bytes=d["reserve_bytes"])


def check_tp_design(tp, kv_dtype) -> str:
    """Exercise 5: a TP size and KV dtype that hold :data:`TP_DESIGN`'s requests on the fewest
    H100s. Any KV dtype that works at the smallest sufficient TP is accepted."""
    require_answer(tp, "tp")
    require_answer(kv_dtype, "kv_dtype")
    d = TP_DESIGN
    if tp not in d["tp_choices"]:
        raise AssertionError(f"tp must be one of {d['tp_choices']}, got {tp!r}")
    dtypes = [x for x in DTYPE_BYTES if x != "fp32"]
    if kv_dtype not in dtypes:
        raise AssertionError(f"kv_dtype must be one of {dtypes}, got {kv_dtype!r}")
    plan = _design_plan(tp, kv_dtype)
    if not plan.fits:
        raise AssertionError(f"At TP={tp} the weights and reserve do not even fit on one GPU.")
    if plan.max_requests < d["min_requests"]:
        raise AssertionError(f"TP={tp} with a {kv_dtype} cache holds fewer than "
                             f"{d['min_requests']} requests of {d['context_len']:,} tokens: "
                             "more GPUs or a smaller element.")
    smaller = [t for t in d["tp_choices"] if t < tp
               and any(_design_plan(t, x).max_requests >= d["min_requests"] for x in dtypes)]
    if smaller:
        raise AssertionError(f"TP={tp} works, but a smaller TP also does with some KV dtype: "
                             "fewer GPUs suffice.")
    return (f"Correct: TP={tp} with a {kv_dtype} cache holds {plan.max_requests} requests "
            f"of {d['context_len']:,} tokens; no smaller group can. (Measure the accuracy of "
            "a quantised cache before you ship it.)")
