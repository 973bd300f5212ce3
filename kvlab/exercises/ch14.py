"""Chapter 14 exercises: a hybrid model's bytes per rank, gpt-oss-120b's pool predicted by hand,
the block size a recurrent state forces (vLLM issue 40696), a quick planner to debug, and a layer
pattern to design.

Checks with one right answer compare against sealed truths (``_common.sealed``; the instructor
edition computes them with :mod:`kvlab.labs.capacity.hybrid_plan` under the assumptions stated
here). An answer of several parts is graded as one (a check that named the wrong part would let
each part be found by trying values one after another), and the prediction of exercise 2 is
graded once per session (``_common.earlier_prediction``). The debug and design checks run the
planner on the reader's own case. A wrong answer is told which ideas to revisit, never which
part is wrong or whether it is too high or too low.
"""

from __future__ import annotations

from kvlab.exercises._common import earlier_prediction, graded_once, require_answer, sealed
from kvlab.labs.capacity.hf_config import ModelLayout, layout_from_hf_config, shipped_layout
from kvlab.labs.capacity.hybrid_plan import GiB, plan_layout, token_bytes
from kvlab.sim.catalog import get_gpu

#: Exercise 1: one request of ``tokens`` tokens of this model, on one rank of this TP group
#: (every layer: the full layers' KV and the rank's share of each recurrent state).
RANK_CASE = {"model": "qwen3-next-80b-a3b-instruct", "tp": 4, "kv_dtype": "bf16",
             "tokens": 10_000}

#: Exercise 2: gpt-oss-120b alone on one H100 (weights: MXFP4 experts + bf16 rest).
GPT_OSS_CASE = {
    "model": "gpt-oss-120b",
    "gpu": "H100-80GB SXM",            # CUDA's total: 79.11 GiB
    "gpu_memory_utilization": 0.9,
    "weight_bytes": 65_248_815_744,    # 60.77 GiB
    "reserve_bytes": 4 * GiB,
    "kv_dtype": "bf16",
    "block_size": 16,
    "in_flight_tokens": 1,             # steady decode
    "context_len": 65536,
}

#: Exercise 3: the fields of Qwen3.5-4B's ``config.json`` (``text_config``) that size its cache.
QWEN35_4B = {
    "num_key_value_heads": 4, "head_dim": 256,                 # full-attention layers
    "linear_num_key_heads": 16, "linear_key_head_dim": 128,    # gated-DeltaNet layers
    "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "dtype": "bfloat16", "mamba_ssm_dtype": "float32",
}
#: ... served at TP 1 with an **fp8** KV cache on vLLM's FlashAttention (kernel block 16).
HYBRID_CASE = {"tp": 1, "kv_dtype": "fp8", "kernel_block": 16, "block_size": 16}

#: Exercise 4: the windowed models a case may name, with the weights each GPU holds.
SUSPECT_WEIGHTS = {"gemma-3-27b-it": 27_432_406_640 * 2, "gpt-oss-120b": 65_248_815_744,
                   "mistral-7b-v0.1": 7_241_732_096 * 2}
SUSPECT_CASE_KEYS = ("model", "context_len", "in_flight_tokens")

#: Exercise 5: the model to lay out and what it must serve.
DESIGN = {
    "layers": 48, "kv_heads": 8, "head_dim": 128, "kv_dtype": "bf16",
    "gpu": "H100-80GB SXM", "weight_bytes": 16 * GiB, "reserve_bytes": 4 * GiB,
    "context_len": 65536, "min_requests": 40,
    "windows": (256, 512, 1024, 2048, 4096),
    "min_full_layers": 4,
    "min_reach": 8192,     # (full_every - 1) x (window - 1) tokens between two full layers
}


def _whole(value, what: str) -> int:
    require_answer(value, what)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(
            value).is_integer():
        raise AssertionError(f"{what}: expected a whole number, got {value!r}")
    return int(value)


def check_rank_request_bytes(answer) -> str:
    """Exercise 1: the bytes one rank keeps for one request of :data:`RANK_CASE`, exactly (no
    blocks): every layer's part on that rank."""
    got = _whole(answer, "bytes on one rank")
    if not sealed("ch14.rank_request_bytes").is_answer(got):
        raise AssertionError("Not right: revisit which layers grow with the context and how "
                             "many KV heads one rank keeps once TP exceeds the KV heads "
                             "(chapter 1), and what a recurrent state holds, in which dtypes, "
                             "and how it splits across ranks.")
    return (f"Correct: {got:,} bytes on each rank. Only the 12 full layers grow with the "
            "request; the 36 states are a fixed slot, the same at 10 tokens as at 10,000.")


def check_gpt_oss_pool(block_bytes, blocks_per_request, requests) -> str:
    """Exercise 2: a prediction, for :data:`GPT_OSS_CASE`, of the bytes of one block of the
    pool, the blocks one request holds (all groups), and the requests that fit. The three are
    graded as one answer, once per session (``_common.earlier_prediction``)."""
    answer = [_whole(block_bytes, "block bytes"), _whole(blocks_per_request,
              "blocks per request"), _whole(requests, "requests")]
    right = sealed("ch14.gpt_oss_pool").is_answer(answer)
    earlier = earlier_prediction("ch14.gpt_oss_pool", answer, right)
    if earlier is not None:
        return graded_once(earlier)
    if not right:
        raise AssertionError("Not right, at least one of the three: revisit what one block of "
                             "the shared pool holds (a page in every layer of one group), how "
                             "many blocks a sliding-window group can hold at once, and that "
                             "requests take whole blocks from the budget; then run plan_layout "
                             "on the case and find the step your prediction missed.")
    block, blocks, count = answer
    return (f"Correct: blocks of {block:,} bytes, {blocks:,} per request, {count} requests. "
            "The 18 windowed layers cost under half a percent of a request's blocks.")


def check_hybrid_block_size(state_bytes, attention_token_bytes, block_size) -> str:
    """Exercise 3: for :data:`QWEN35_4B` served as :data:`HYBRID_CASE` says, one gated-DeltaNet
    layer's state in bytes, one full-attention layer's bytes per token, and the attention
    block size vLLM picks, graded as one answer."""
    answer = [_whole(state_bytes, "state bytes"),
              _whole(attention_token_bytes, "attention bytes per token"),
              _whole(block_size, "block size")]
    if not sealed("ch14.hybrid_block").is_answer(answer):
        raise AssertionError("Not right, at least one of the three: revisit the two tensors of "
                             "a gated-DeltaNet layer and the dtype each is kept in, what a "
                             "full-attention layer keeps per token and in which format, and "
                             "the rule that makes an attention page hold a whole state in "
                             "whole kernel blocks.")
    state, per_token, block = answer
    return (f"Correct: a {state:,}-byte state, {per_token:,} bytes per token, blocks of "
            f"{block:,} tokens.")


def suspect_requests(layout: ModelLayout, gpu, *, weight_bytes: float, context_len: int,
                     in_flight_tokens: int = 1, block_size: int = 16,
                     gpu_memory_utilization: float = 0.9, reserve_bytes: float = 4 * GiB,
                     kv_dtype: str = "bf16") -> int:
    """Exercise 4: a colleague's quick hybrid planner. Every layer keeps its tokens (all of
    them, or its window) in whole blocks; the budget is divided by what one request keeps."""
    per_request = 0.0
    for layer in layout.layers:
        kept_blocks = -(-layer.tokens_kept(context_len) // block_size)
        per_request += kept_blocks * block_size * token_bytes(layer, kv_dtype)
        per_request += layer.state_bytes()
    budget = gpu.engine_memory_bytes * gpu_memory_utilization - weight_bytes - reserve_bytes
    return int(max(budget, 0) // per_request)


def check_suspect_counterexample(case) -> str:
    """Exercise 4: a case (a dict with :data:`SUSPECT_CASE_KEYS`) on which
    :func:`suspect_requests` promises more requests than ``plan_layout`` fits (one H100, the
    model's weights from :data:`SUSPECT_WEIGHTS`, a 4 GiB reserve, 16-token blocks)."""
    require_answer(case, "case")
    if not isinstance(case, dict) or set(case) != set(SUSPECT_CASE_KEYS):
        raise AssertionError(f"give a dict with exactly the keys {SUSPECT_CASE_KEYS}")
    if case["model"] not in SUSPECT_WEIGHTS:
        raise AssertionError(f"model must be one of {sorted(SUSPECT_WEIGHTS)}")
    gpu, weights = get_gpu("H100-80GB SXM"), SUSPECT_WEIGHTS[case["model"]]
    layout = shipped_layout(case["model"])
    try:
        truth = plan_layout(layout, gpu, weight_bytes=weights, context_len=case["context_len"],
                            in_flight_tokens=case["in_flight_tokens"],
                            reserve_bytes=4 * GiB).max_requests
    except ValueError as err:
        raise AssertionError(f"that case is not valid: {err}") from None
    promised = suspect_requests(layout, gpu, weight_bytes=weights,
                                context_len=case["context_len"],
                                in_flight_tokens=case["in_flight_tokens"])
    if promised <= truth:
        raise AssertionError(f"here the suspect promises {promised} and {truth} fit: the "
                             "flaw does not show on this case.")
    return (f"Correct: the suspect promises {promised} requests where {truth} fit. An engine "
            "that admitted them all would run out of blocks while they run.")


def design_layout(full_every: int, window: int) -> ModelLayout:
    """Exercise 5: :data:`DESIGN`'s model with layer ``i`` full iff ``(i + 1) % full_every ==
    0`` (Gemma 3's pattern) and a ``window``-token window in the other layers."""
    d = DESIGN
    types = ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
             for i in range(d["layers"])]
    return layout_from_hf_config({
        "model_type": "qwen3", "num_hidden_layers": d["layers"],
        "num_attention_heads": 4 * d["kv_heads"], "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"], "use_sliding_window": True, "sliding_window": window,
        "layer_types": types}, name=f"design (full every {full_every}, window {window})")


def check_layer_pattern(full_every, window) -> str:
    """Exercise 5: a pattern and window for :data:`DESIGN` that keep at least
    ``min_full_layers`` full layers and ``min_reach`` tokens of stacked-window reach between
    two full layers, and fit ``min_requests`` requests of ``context_len`` tokens."""
    d = DESIGN
    every = _whole(full_every, "full_every")
    w = _whole(window, "window")
    if not 2 <= every <= d["layers"]:
        raise AssertionError(f"full_every must be between 2 and {d['layers']}")
    if w not in d["windows"]:
        raise AssertionError(f"window must be one of {d['windows']}")
    full = d["layers"] // every
    if full < d["min_full_layers"]:
        raise AssertionError(f"that keeps {full} full layers; the model needs at least "
                             f"{d['min_full_layers']}.")
    if (every - 1) * (w - 1) < d["min_reach"]:
        raise AssertionError(f"{every - 1} windowed layers of {w} tokens between two full "
                             f"layers carry information only {(every - 1) * (w - 1):,} "
                             f"positions; the model needs {d['min_reach']:,}.")
    plan = plan_layout(design_layout(every, w), get_gpu(d["gpu"]),
                       weight_bytes=d["weight_bytes"], reserve_bytes=d["reserve_bytes"],
                       kv_dtype=d["kv_dtype"], context_len=d["context_len"])
    if plan.max_requests < d["min_requests"]:
        raise AssertionError(f"it holds {plan.max_requests} requests of "
                             f"{d['context_len']:,} tokens; {d['min_requests']} are needed.")
    return (f"Meets the requirement: {full} full layers, reach {(every - 1) * (w - 1):,}, "
            f"{plan.max_requests} requests of {d['context_len']:,} tokens. Now write down what "
            "it costs that the planner cannot see.")
