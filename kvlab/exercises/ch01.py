"""Chapter 1 exercises: KV bytes per token of a quantised cache, requests that fit on one GPU,
where the KV traffic overtakes the weights, the TP rule, a TP/dtype design for Llama 3 70B, and
a capacity estimate to debug.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it with :mod:`kvlab.labs.capacity` and the roofline cost model under the
assumptions stated here). Design and debug checks evaluate the reader's own choice with
kvlab. Each raises ``AssertionError`` saying what is wrong (a numeric answer: only too high
or too low) without printing the expected value.
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

#: The model and TP sizes of :func:`check_tp_kv_per_rank` (exercise 4).
TP_RANK_CASE = {"model": "Qwen2.5-7B", "kv_dtype": "bf16", "tp": (2, 8)}

#: The requirement of :func:`check_tp_design` (exercise 5).
TP_DESIGN = {
    "model": "Llama-3-70B",
    "gpu": "H100-80GB SXM",
    "context_len": 16384,
    "min_requests": 40,
    "reserve_bytes": 4 * GiB,
    "tp_choices": (1, 2, 4, 8, 16),
}

#: The keys a case of :func:`check_suspect_counterexample` (exercise 6) must give.
SUSPECT_CASE_KEYS = ("model", "gpu", "kv_dtype", "context_len", "tp")


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


def _wrong(key: str, got: float, tolerance: float = 0.0) -> str | None:
    """``"<got> is too high/low"`` against the sealed number ``key``, or None if right."""
    way = sealed(key).direction(got, tolerance)
    return None if way is None else f"{got:,} is {way}"


def check_kv_bytes_per_token(answer) -> str:
    """Exercise 1: bytes of K and V one token of :data:`KV_TOKEN_CASE`'s model needs, all
    layers, one GPU, in its int4 cache with one fp16 scale per ``scale_group`` elements."""
    answer = _float_answer(answer, "KV bytes per token")
    wrong = _wrong("ch01.kv_bytes_per_token", answer, tolerance=0.5)
    if wrong:
        raise AssertionError(f"{wrong}.")
    return (f"Correct: {answer:,.0f} bytes per token, scales included "
            f"({answer / 1024:.1f} KiB).")


def check_max_requests_h100(bf16_answer, fp8_answer) -> str:
    """Exercise 2: concurrent 32k-token requests of :data:`H100_ASSUMPTIONS`'s model on one
    H100-80GB, with a bf16 and with an fp8 KV cache (each request needs whole blocks)."""
    bf16 = _int_answer(bf16_answer, "bf16 answer")
    fp8 = _int_answer(fp8_answer, "fp8 answer")
    wrong = [f"{d}: {w}" for d, got in (("bf16", bf16), ("fp8", fp8))
             if (w := _wrong(f"ch01.max_requests_h100.{d}", got))]
    if wrong:
        raise AssertionError("; ".join(wrong) + ".")
    return (f"Correct: {bf16} requests with bf16 KV, {fp8} with fp8 "
            "(halving the element size doubles the concurrency).")


def check_kv_overtakes_weights(answer) -> str:
    """Smallest decode batch of 4,096-token Llama-3-8B requests (bf16 weights and KV) whose
    step reads at least as many KV bytes as weight bytes (the roofline cost model's bytes)."""
    batch = _int_answer(answer, "batch")
    if batch < 1:
        raise AssertionError("a batch holds at least one request")
    wrong = _wrong("ch01.kv_overtakes_weights", batch)
    if wrong:
        raise AssertionError(f"{wrong}.")
    return (f"Correct: from batch {batch} on the KV cache, not the weights, is most of a "
            "decode step's memory traffic.")


def check_tp_kv_per_rank(first_answer, second_answer) -> str:
    """Exercise 4: per-rank KV bytes per token of :data:`TP_RANK_CASE`'s model (sharded
    cache) at its two TP sizes, in that order."""
    c = TP_RANK_CASE
    answers = (_int_answer(first_answer, f"TP={c['tp'][0]} answer"),
               _int_answer(second_answer, f"TP={c['tp'][1]} answer"))
    problems = [f"TP={tp}: {w}" for tp, got, which in zip(c["tp"], answers,
                                                          ("first", "second"), strict=True)
                if (w := _wrong(f"ch01.tp_kv_per_rank.{which}", got))]
    if problems:
        raise AssertionError("; ".join(problems) + ".")
    first, second = answers     # both right by now
    return (f"Correct: {first:,} and {second:,} bytes per rank: {c['tp'][1] // c['tp'][0]}"
            f" times the ranks divide the per-rank cache by only {first // second}, "
            "because a KV head cannot be split: past TP = KV heads it is replicated.")


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
        raise AssertionError(f"TP={tp} with {kv_dtype} KV holds fewer than "
                             f"{d['min_requests']} requests of {d['context_len']:,} tokens.")
    if sealed("ch01.tp_design.min_tp").direction(tp) == "too high":
        raise AssertionError(f"TP={tp} works, but it is not the fewest GPUs.")
    return (f"Correct: TP={tp} with {kv_dtype} KV holds {plan.max_requests} requests "
            f"of {d['context_len']:,} tokens; no smaller group can. (Measure the accuracy of "
            "a quantised cache before you ship it.)")


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


def check_suspect_counterexample(case) -> str:
    """Exercise 6: a case (dict with :data:`SUSPECT_CASE_KEYS`) on which
    :func:`suspect_max_requests` promises more requests than ``plan_capacity`` holds."""
    require_answer(case, "case")
    if not isinstance(case, dict) or set(case) != set(SUSPECT_CASE_KEYS):
        raise AssertionError(f"give a dict with exactly the keys {SUSPECT_CASE_KEYS}")
    try:
        model, gpu = get_model(case["model"]), get_gpu(case["gpu"])
        args = dict(kv_dtype=case["kv_dtype"], context_len=case["context_len"], tp=case["tp"])
        truth = plan_capacity(model, gpu, reserve_bytes=4 * GiB, **args).max_requests
    except (KeyError, ValueError) as err:
        raise AssertionError(f"that case is not valid: {err}") from None
    promised = suspect_max_requests(model, gpu, **args)
    if promised == truth:
        raise AssertionError(f"both give {truth} requests here: the bug does not show on "
                             "this case.")
    if promised < truth:
        raise AssertionError(f"the suspect promises fewer requests ({promised}) than fit "
                             f"({truth}) here: safe, if wasteful. Find a case where it "
                             "promises more.")
    return (f"Correct: the suspect promises {promised} requests where {truth} fit. An engine "
            "that admitted them would run out of KV memory while they are all still running.")
