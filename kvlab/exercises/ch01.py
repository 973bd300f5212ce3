"""Chapter 1 exercises: KV bytes per token, requests that fit on one GPU, the TP rule.

Every check computes the truth with :mod:`kvlab.core.capacity` under the assumptions the
exercise states, and raises ``AssertionError`` with a hint when the answer differs.
"""

from __future__ import annotations

from kvlab.core.capacity import GiB, plan_capacity
from kvlab.core.catalog import get_gpu, get_model
from kvlab.reference import kv_bytes

from ._common import require_answer

#: Assumptions of :func:`check_max_requests_h100` (also printed in the chapter).
H100_ASSUMPTIONS = {
    "model": "Llama-3-8B",
    "gpu": "H100-80GB SXM",          # 80 GB = 80e9 bytes
    "weight_dtype": "bf16",          # 2 bytes x 8,030,261,248 parameters
    "gpu_memory_utilization": 0.9,
    "reserve_bytes": 4 * GiB,        # activations and workspace
    "block_size": 16,
    "context_len": 32768,
}


def _int_answer(value, what: str) -> int:
    require_answer(value, what)
    if isinstance(value, bool) or not float(value).is_integer():
        raise AssertionError(f"{what}: expected a whole number, got {value!r}")
    return int(value)


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
            hint = " Use the KV heads (8), not the query heads (64): that is GQA."
        raise AssertionError(f"{answer:,} is not right.{hint}")
    return f"Correct: {truth:,} bytes = {truth // 1024} KiB per token."


def check_max_requests_h100(bf16_answer, fp8_answer) -> str:
    """Concurrent 32k-token requests of Llama-3-8B on one H100-80GB, bf16 vs fp8 KV cache.

    Assumptions: :data:`H100_ASSUMPTIONS` (80e9 bytes, 90% usable, bf16 weights, 4 GiB
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
    wrong = [f"{d}: {got} is not right" for d, got in (("bf16", bf16), ("fp8", fp8))
             if got != truth[d]]
    if wrong:
        raise AssertionError("; ".join(wrong) + ". Budget = 0.9 x 80e9 - weights - 4 GiB; "
                             "divide by the bytes of one 32k-token request; round down.")
    return (f"Correct: {truth['bf16']} requests with bf16 KV, {truth['fp8']} with fp8 "
            "(halving the element size doubles the concurrency).")


def check_tp_kv_per_rank(tp8_answer, tp16_answer) -> str:
    """Per-rank KV bytes per token of Llama-3-70B (bf16, sharded cache) at TP=8 and TP=16."""
    tp8 = _int_answer(tp8_answer, "TP=8 answer")
    tp16 = _int_answer(tp16_answer, "TP=16 answer")
    m = get_model("Llama-3-70B")
    truth = {tp: int(plan_capacity(m, 10**15, tp=tp).kv_bytes_per_token) for tp in (8, 16)}
    if (tp8, tp16) != (truth[8], truth[16]):
        hint = ""
        if tp16 == truth[16] // 2:
            hint = (" With 16 ranks and 8 KV heads, a rank cannot hold half a head: the"
                    " heads are replicated, so per-rank KV stops shrinking at TP=8.")
        raise AssertionError(f"({tp8:,}, {tp16:,}) is not right.{hint}")
    return (f"Correct: {truth[8]:,} bytes at both TP=8 and TP=16; beyond TP = KV heads the "
            "cache is replicated, not divided.")
