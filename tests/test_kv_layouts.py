"""Per-layer KV layouts: rule 1 applied layer by layer, the layouts read from the shipped
``config.json`` files, and the hybrid planner, against hand computations, against the uniform
planner of chapter 1, against a token-by-token simulation of sliding-window freeing, and against
vLLM's own specs and grouping (when vLLM's environment is present)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest

from kvlab.labs.capacity import GiB, plan_capacity
from kvlab.labs.capacity.hf_config import (
    SHIPPED,
    ModelLayout,
    layout_from_hf_config,
    load_hf_config,
    shipped_config,
    shipped_layout,
)
from kvlab.labs.capacity.hybrid_plan import (
    KVGroup,
    bytes_by_layer,
    hybrid_block_size,
    max_in_flight_tokens,
    plan_layout,
)
from kvlab.labs.capacity.layer_kv import LayerKV, StatePart, kv_bytes_by_layer
from kvlab.reference import kv_bytes
from kvlab.sim.catalog import ModelShape, get_gpu, get_model

ROOT = Path(__file__).resolve().parents[1]
H100, H200 = get_gpu("H100-80GB SXM"), get_gpu("H200-141GB SXM")


# --- the per-layer rule -------------------------------------------------------------------------

def test_per_layer_rule_is_rule_one_for_identical_full_layers():
    rng = random.Random(1)
    for _ in range(200):
        layers, heads = rng.randint(1, 96), rng.choice([1, 2, 4, 8, 16])
        dim, tokens, s = rng.choice([64, 80, 128, 256]), rng.randint(1, 200_000), \
            rng.choice([0.5, 1, 2, 4])
        per_layer = kv_bytes_by_layer([LayerKV("full", heads, dim, dim)] * layers, tokens, s)
        assert sum(per_layer) == kv_bytes(layers, 1, tokens, heads, dim, s)


def test_per_layer_rule_per_kind():
    full = LayerKV("full", 8, 128, 128)
    window = LayerKV("sliding", 8, 128, 128, window=1024)
    latent = LayerKV("mla", 1, 576)
    state = LayerKV("state", state=(StatePart("conv", (8192, 3), "bf16"),
                                     StatePart("ssm", (32, 128, 128), "fp32")))
    assert kv_bytes_by_layer([full, window, latent, state], 4096, 2) == [
        4096 * 8 * 256 * 2,          # every token
        1024 * 8 * 256 * 2,          # the window only
        4096 * 576 * 2,              # one latent per token, no heads, no V
        8192 * 3 * 2 + 32 * 128 * 128 * 4,   # fixed: no tokens at all
    ]
    assert kv_bytes_by_layer([window], 100, 2) == [100 * 8 * 256 * 2]   # shorter than W
    with pytest.raises(ValueError):
        kv_bytes_by_layer([full], 0, 2)


@pytest.mark.parametrize("bad", [
    dict(kind="dense", kv_heads=8, head_dim=128, head_dim_v=128),
    dict(kind="full", kv_heads=0, head_dim=128, head_dim_v=128),
    dict(kind="full", kv_heads=8, head_dim=128, head_dim_v=0),
    dict(kind="full", kv_heads=8, head_dim=128, head_dim_v=128, window=4),
    dict(kind="sliding", kv_heads=8, head_dim=128, head_dim_v=128),
    dict(kind="sliding", kv_heads=8, head_dim=128, head_dim_v=128, window=-1),
    dict(kind="mla", kv_heads=2, head_dim=576),
    dict(kind="mla", kv_heads=1, head_dim=512, head_dim_v=64),
    dict(kind="state"),
])
def test_layer_kv_refuses_inconsistent_layers(bad):
    with pytest.raises(ValueError):
        LayerKV(**bad)


def test_state_parts_split_by_tp_or_refuse():
    part = StatePart("ssm", (32, 128, 128), "bf16")
    assert part.nbytes(1) == 32 * 128 * 128 * 2 and part.nbytes(4) == 8 * 128 * 128 * 2
    with pytest.raises(ValueError, match="does not divide"):
        part.nbytes(3)
    with pytest.raises(ValueError):
        StatePart("conv", (8192, 0), "bf16")
    with pytest.raises(ValueError):
        StatePart("conv", (8192, 3), "bf17")


# --- layouts from the shipped configs -----------------------------------------------------------

def test_every_shipped_config_is_read():
    for name in SHIPPED:
        layout = shipped_layout(name)
        assert layout.name == name and layout.num_layers == len(layout.layers) > 0
        assert layout_from_hf_config(ROOT / "kvlab/labs/capacity/configs" / f"{name}.json",
                                     name=name) == ModelLayout(
            name, layout.model_type, layout.layers, layout.max_position_embeddings,
            str(ROOT / "kvlab/labs/capacity/configs" / f"{name}.json"))


def test_llama_qwen_are_uniform_full_attention():
    for name, layers, heads, dim in (("llama-3.1-8b-instruct", 32, 8, 128),
                                     ("qwen2.5-7b-instruct", 28, 4, 128),
                                     ("qwen3-8b", 36, 8, 128)):
        layout = shipped_layout(name)
        assert layout.kind_counts() == {"full": layers}
        assert set(layout.layers) == {LayerKV("full", heads, dim, dim)}


def test_mistral_v01_windows_every_layer():
    layout = shipped_layout("mistral-7b-v0.1")
    assert set(layout.layers) == {LayerKV("sliding", 8, 128, 128, window=4096)}
    # bytes per token stop growing at the window: 32 layers x 4,096 tokens x 8 x 256 x 2
    assert sum(bytes_by_layer(layout, 100_000)) == 32 * 4096 * 8 * 256 * 2


def test_gemma3_27b_keeps_a_window_in_five_of_six_layers():
    layout = shipped_layout("gemma-3-27b-it")
    full = [i for i, layer in enumerate(layout.layers) if layer.kind == "full"]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert layout.kind_counts() == {"full": 10, "sliding": 52} and layout.windows() == {1024}
    # hand computation at 32k tokens, bf16: 16 KV heads x (128 + 128) elements x 2 bytes
    per_token = 16 * 256 * 2
    assert sum(bytes_by_layer(layout, 32768)) == (10 * 32768 + 52 * 1024) * per_token
    assert sum(bytes_by_layer(layout.without_windows(), 32768)) == 62 * 32768 * per_token


def test_gpt_oss_alternates_a_128_token_window():
    layout = shipped_layout("gpt-oss-120b")
    assert [layer.kind for layer in layout.layers[:4]] == ["sliding", "full"] * 2
    assert layout.kind_counts() == {"full": 18, "sliding": 18} and layout.windows() == {128}
    per_token = 8 * (64 + 64) * 2                 # 8 KV heads of 64, K and V, bf16
    assert sum(bytes_by_layer(layout, 1)) == 36 * per_token == 73_728
    assert sum(bytes_by_layer(layout, 8192)) == (18 * 8192 + 18 * 128) * per_token


def test_deepseek_v3_caches_one_576_latent_per_token_on_every_rank():
    layout = shipped_layout("deepseek-v3")
    assert set(layout.layers) == {LayerKV("mla", 1, 512 + 64)}
    assert sum(bytes_by_layer(layout, 1)) == 61 * 576 * 2 == 70_272
    assert sum(bytes_by_layer(layout, 1, kv_dtype="fp8")) == 35_136
    for tp in (2, 8, 16):   # the latent has no heads to split: every rank holds all of it
        assert sum(bytes_by_layer(layout, 1, tp=tp)) == 70_272


def test_qwen3_next_keeps_a_fixed_state_in_three_of_four_layers():
    layout = shipped_layout("qwen3-next-80b-a3b-instruct")
    assert layout.kind_counts() == {"full": 12, "state": 36}
    assert [layer.kind for layer in layout.layers[:4]] == ["state"] * 3 + ["full"]
    state = layout.layers[0]
    # conv: (2 x 16 x 128 + 32 x 128) channels x (4 - 1); ssm: 32 heads x 128 x 128; bf16
    assert state.state_bytes() == 8192 * 3 * 2 + 32 * 128 * 128 * 2 == 1_097_728
    assert state.state_bytes(tp=2) == 1_097_728 // 2
    one = sum(bytes_by_layer(layout, 1))
    assert one == 36 * 1_097_728 + 12 * 2 * 256 * 2 * 2
    # the state does not grow: 1,000 more tokens cost only the 12 full layers
    assert sum(bytes_by_layer(layout, 1001)) - one == 1000 * 12 * 2 * 512 * 2


def _qwen2(**overrides):
    return {**shipped_config("qwen2.5-7b-instruct"), **overrides}


def test_qwen2_window_follows_use_sliding_window_and_max_window_layers():
    layout = layout_from_hf_config(_qwen2(use_sliding_window=True, sliding_window=4096,
                                          max_window_layers=20))
    assert [layer.kind for layer in layout.layers] == ["full"] * 20 + ["sliding"] * 8
    types = ["sliding_attention", "full_attention"] * 14
    layout = layout_from_hf_config(_qwen2(use_sliding_window=True, sliding_window=512,
                                          layer_types=types))
    assert [layer.kind for layer in layout.layers] == ["sliding", "full"] * 14
    assert layout.windows() == {512}
    with pytest.raises(ValueError, match="use_sliding_window"):
        layout_from_hf_config(_qwen2(layer_types=types))   # transformers raises too


def test_gated_deltanet_ssm_dtype_comes_from_the_config():
    cfg = {**shipped_config("qwen3-next-80b-a3b-instruct"), "mamba_ssm_dtype": "float32"}
    state = layout_from_hf_config(cfg).layers[0]
    assert state.state_bytes() == 8192 * 3 * 2 + 32 * 128 * 128 * 4


@pytest.mark.parametrize("cfg, message", [
    ({"model_type": "bert"}, "not supported"),
    ({"model_type": "llama"}, "num_hidden_layers"),
    ({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 0}, "positive"),
    ({**shipped_config("gpt-oss-120b"), "layer_types": ["full_attention"]}, "layer_types"),
    ({**shipped_config("gpt-oss-120b"), "layer_types": ["chunked_attention"] * 36}, "unknown"),
    ({**shipped_config("deepseek-v3"), "kv_lora_rank": None}, "kv_lora_rank"),
])
def test_bad_configs_are_named(cfg, message):
    with pytest.raises(ValueError, match=message):
        layout_from_hf_config(cfg)


def test_config_paths(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(shipped_config("qwen3-8b")))
    assert load_hf_config(tmp_path) == load_hf_config(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_hf_config(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_hf_config(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="unknown shipped"):
        shipped_config("gpt-5")


# --- the planner ---------------------------------------------------------------------------------

LLAMA_WEIGHTS = get_model("Llama-3-8B").weight_bytes("bf16")


@pytest.mark.parametrize("tp, kv_dtype, context", [(1, "bf16", 8192), (1, "fp8", 32768),
                                                   (2, "bf16", 1000), (16, "bf16", 4096)])
def test_a_uniform_model_plans_as_chapter_one_does(tp, kv_dtype, context):
    """Llama 3.1 8B has Llama 3 8B's attention shape: one group, the same pool and requests."""
    layout = shipped_layout("llama-3.1-8b-instruct")
    plan = plan_layout(layout, H100, weight_bytes=LLAMA_WEIGHTS / tp, kv_dtype=kv_dtype,
                       context_len=context, tp=tp, reserve_bytes=4 * GiB)
    uniform = plan_capacity(get_model("Llama-3-8B"), H100, kv_dtype=kv_dtype,
                            context_len=context, tp=tp, reserve_bytes=4 * GiB)
    assert len(plan.groups) == 1 and plan.padding_slots == 0
    assert plan.block_bytes == uniform.block_bytes
    assert plan.num_blocks == uniform.num_blocks
    assert plan.max_requests == uniform.max_requests
    assert plan.kv_bytes_per_request() == uniform.blocks_per_request * uniform.block_bytes
    if context % 16 == 0:
        assert plan.token_capacity == uniform.token_capacity


GEMMA_WEIGHTS = 27_432_406_640 * 2      # google/gemma-3-27b-it safetensors, bf16


def test_gemma3_groups_pad_52_sliding_layers_to_60_slots():
    plan = plan_layout(shipped_layout("gemma-3-27b-it"), H100, weight_bytes=GEMMA_WEIGHTS,
                       context_len=32768, reserve_bytes=4 * GiB)
    kinds = [(g.kind, len(g.layers), g.slots) for g in plan.groups]
    assert kinds == [("sliding", 9, 10)] * 4 + [("sliding", 8, 10)] * 2 + [("full", 10, 10)]
    assert plan.padding_slots == 8
    assert sorted(i for g in plan.groups for i in g.layers) == list(range(62))
    page = 16 * 16 * 256 * 2                      # 16 tokens x 16 heads x 256 x 2 bytes
    assert plan.block_bytes == 10 * page
    # a sliding group holds (1024 - 1 + 1) / 16 + 1 blocks, the full group 32768 / 16
    assert plan.group_blocks() == (65,) * 6 + (2048,)
    budget = 0.9 * H100.cuda_total_bytes - GEMMA_WEIGHTS - 4 * GiB
    assert plan.num_blocks == math.floor(budget / (10 * page))
    assert plan.max_requests == plan.num_blocks // (6 * 65 + 2048)
    assert plan.token_capacity == int(plan.num_blocks / (6 * 65 + 2048) * 32768)
    flat = plan_layout(shipped_layout("gemma-3-27b-it"), H100, weight_bytes=GEMMA_WEIGHTS,
                       context_len=32768, reserve_bytes=4 * GiB, windows=False)
    assert [(g.kind, len(g.layers)) for g in flat.groups] == [("full", 62)]
    assert flat.max_requests == flat.num_blocks // 2048 < plan.max_requests


def test_vllm_counts_windows_with_its_in_flight_bound():
    """vLLM sizes a windowed group for ``max_in_flight_tokens`` (16,384 for ``vllm serve`` on
    an H100) where the steady-decode packing keeps one token in flight."""
    assert max_in_flight_tokens() == 2 * 8192 == 16384
    assert max_in_flight_tokens(2048, 1) == 2048
    for bad in (dict(max_num_batched_tokens=0), dict(max_concurrent_batches=1.5)):
        with pytest.raises(ValueError):
            max_in_flight_tokens(**bad)
    gemma = shipped_layout("gemma-3-27b-it")

    def plan(context, in_flight, windows=True):
        return plan_layout(gemma, H100, weight_bytes=GEMMA_WEIGHTS, context_len=context,
                           in_flight_tokens=in_flight, reserve_bytes=4 * GiB, windows=windows)

    steady, vllm = plan(32768, 1), plan(32768, max_in_flight_tokens())
    # each windowed group: the blocks of W - 1 + 16,384 tokens, plus the straddling one
    assert vllm.group_blocks() == (-(-(1023 + 16384) // 16) + 1,) * 6 + (2048,)
    assert vllm.num_blocks == steady.num_blocks            # the same pool, counted otherwise
    assert vllm.max_concurrency == vllm.num_blocks / (6 * 1089 + 2048)
    assert 1 <= vllm.max_requests < steady.max_requests
    assert vllm.token_capacity == int(vllm.max_concurrency * 32768)
    # at 8k the window and the tokens in flight cover the whole request: each windowed group
    # holds what the full group holds, and 70 paid slots per block position against 62 layers
    # make the windowed plan the larger one
    windowed, flat = plan(8192, max_in_flight_tokens()), plan(8192, 16384, windows=False)
    assert windowed.group_blocks() == (512,) * 7
    assert windowed.kv_bytes_per_request() * 62 == flat.kv_bytes_per_request() * 70
    assert windowed.max_requests < flat.max_requests


def test_memory_identity_and_leftover_below_one_block():
    for name in SHIPPED:
        plan = plan_layout(shipped_layout(name), H200, weight_bytes=40 * GiB, tp=2,
                           reserve_bytes=3 * GiB, context_len=16384)
        assert math.isclose(sum(plan.breakdown().values()), plan.gpu_memory_bytes)
        assert 0 <= plan.leftover_bytes < plan.block_bytes
        assert plan.max_requests == plan.num_blocks // plan.blocks_per_request()
    huge = plan_layout(shipped_layout("deepseek-v3"), H100, weight_bytes=700e9)
    assert not huge.fits and huge.num_blocks == 0 and huge.max_requests == 0


def _peak_blocks_held(window: int, block: int, tokens: int) -> int:
    """Token by token, as vLLM's SlidingWindowManager does it: before token n is computed the
    blocks wholly before the window of token n are freed, then the block for n is allocated."""
    peak = 0
    for n in range(tokens):
        freed = max(0, n - window + 1) // block          # get_num_skipped_tokens // block
        peak = max(peak, -(-(n + 1) // block) - freed)
    return peak


def test_sliding_blocks_bound_the_blocks_a_request_really_holds():
    rng = random.Random(7)
    for _ in range(300):
        window, block = rng.randint(1, 300), rng.choice([1, 2, 4, 16, 32])
        tokens = rng.randint(1, 3 * window + 100)
        bound = KVGroup("sliding", (0,), 1, block, 1.0, window).blocks_per_request(tokens)
        peak = _peak_blocks_held(window, block, tokens)
        assert peak <= bound <= peak + 1
    for window in (128, 1024, 4096):      # the real windows: the bound is reached
        assert (KVGroup("sliding", (0,), 1, 16, 1.0, window).blocks_per_request(3 * window)
                == _peak_blocks_held(window, 16, 3 * window))


def test_hybrid_block_size_is_the_one_vllm_logs():
    # Qwen3.5-4B (vLLM issue 40696 logs 528): 4 KV heads x 256, bf16 -> 4 KiB per token;
    # state: conv (2 x 16 x 128 + 32 x 128) x 3 in bf16 + ssm 32 x 128 x 128 in fp32
    state = 8192 * 3 * 2 + 32 * 128 * 128 * 4
    assert hybrid_block_size(4 * 256 * 2 * 2, state) == 528
    # Qwen3-Next-80B: 2 KV heads x 256 -> 2 KiB per token, a 1,097,728-byte state
    assert hybrid_block_size(2 * 256 * 2 * 2, 1_097_728) == 544
    assert hybrid_block_size(2048, 1000) == 16            # a small state changes nothing
    assert hybrid_block_size(2048, 1000, block_size=64) == 64
    with pytest.raises(ValueError):
        hybrid_block_size(0, 1000)


def test_qwen3_next_plan_pads_states_to_the_attention_page():
    plan = plan_layout(shipped_layout("qwen3-next-80b-a3b-instruct"), H200,
                       weight_bytes=80e9, tp=2, context_len=32768, reserve_bytes=4 * GiB)
    assert plan.block_size == 544
    page = 544 * 1 * 512 * 2                      # one KV head per rank at TP=2
    assert {g.page_bytes for g in plan.groups} == {page}
    assert [(g.kind, len(g.layers)) for g in plan.groups] == [("state", 12)] * 3 + [("full", 12)]
    assert plan.group_blocks() == (1, 1, 1, -(-32768 // 544))
    cached = plan_layout(shipped_layout("qwen3-next-80b-a3b-instruct"), H200,
                         weight_bytes=80e9, tp=2, context_len=32768, reserve_bytes=4 * GiB,
                         prefix_caching=True)
    assert cached.group_blocks() == (2, 2, 2, 61)     # align mode keeps a checkpoint too


def test_tp_splits_heads_not_the_latent_and_dp_multiplies_pools():
    deepseek = shipped_layout("deepseek-v3")
    tp8 = plan_layout(deepseek, H200, weight_bytes=90e9, tp=8, context_len=32768)
    dp8 = plan_layout(deepseek, H200, weight_bytes=90e9, dp=8, context_len=32768)
    assert tp8.block_bytes == dp8.block_bytes == 61 * 16 * 576 * 2
    assert tp8.max_requests == dp8.max_requests
    assert dp8.deployment_requests == 8 * tp8.deployment_requests
    gqa = shipped_layout("qwen3-8b")
    assert (plan_layout(gqa, H100, weight_bytes=0, tp=8).block_bytes
            == plan_layout(gqa, H100, weight_bytes=0).block_bytes // 8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(weight_bytes=-1), "weight_bytes"), (dict(weight_bytes=1, tp=0), "tp"),
    (dict(weight_bytes=1, dp=1.5), "dp"), (dict(weight_bytes=1, kv_dtype="fp6"), "fp6"),
    (dict(weight_bytes=1, gpu_memory_utilization=1.2), "utilization"),
    (dict(weight_bytes=1, total_memory="label"), "total_memory"),
    (dict(weight_bytes=1, in_flight_tokens=0), "in_flight"),
])
def test_plan_layout_names_bad_inputs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_layout(shipped_layout("gpt-oss-120b"), H100, **kwargs)
    with pytest.raises(ValueError, match="ModelLayout"):
        plan_layout(ModelShape("x", 1, 64, 1, 1, 64, 64, 8, 9, 16), H100, weight_bytes=0)


# --- parity with vLLM ---------------------------------------------------------------------------

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _layer_json(layer: LayerKV) -> dict:
    if layer.kind == "state":
        conv, ssm = layer.state
        hv, dv, dk = ssm.shape
        hk = (conv.shape[0] - hv * dv) // (2 * dk)
        return {"kind": "state", "gdn": {"hk": hk, "hv": hv, "dk": dk, "dv": dv,
                                         "kernel": conv.shape[1] + 1, "conv": conv.dtype,
                                         "ssm": ssm.dtype}}
    return {"kind": layer.kind, "kv_heads": layer.kv_heads, "head_dim": layer.head_dim,
            "window": layer.window}


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's environment (.venv-vllm) absent")
def test_pages_groups_and_window_blocks_match_vllm():
    cases, plans = [], []
    for name, tp in (("gemma-3-27b-it", 1), ("gpt-oss-120b", 1), ("gpt-oss-120b", 4),
                     ("deepseek-v3", 8), ("qwen3-next-80b-a3b-instruct", 2),
                     ("mistral-7b-v0.1", 1)):
        plan = plan_layout(shipped_layout(name), H200, weight_bytes=0, tp=tp)
        padded = plan.groups[0].page_bytes if any(g.kind == "state" for g in plan.groups) \
            else None
        cases.append({"block": plan.block_size, "dtype": "bf16", "tp": tp, "padded": padded,
                      "layers": [_layer_json(x) for x in shipped_layout(name).layers],
                      "admissions": [[1, 32768], [8192, 131072],
                                     [max_in_flight_tokens(), 32768]]})
        plans.append(plan)
    # (max_num_batched_tokens, async scheduling, pipeline stages, model runner V2)
    settings = [[8192, True, 1, False], [8192, True, 1, True], [2048, False, 1, False],
                [8192, True, 2, True]]
    result = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_layout_parity.py")],
                            input=json.dumps({"layouts": cases, "in_flight": settings}),
                            capture_output=True, text=True,
                            timeout=900, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
    assert result.returncode == 0, result.stderr[-2000:]
    vllm = json.loads(result.stdout.strip().splitlines()[-1])
    # vLLM's bound on tokens in flight, for the settings max_in_flight_tokens takes
    assert vllm["in_flight"][:3] == [[2, 16384], [2, 16384], [1, 2048]]
    assert [max_in_flight_tokens(b, c) for (b, *_), (c, _) in
            zip(settings, vllm["in_flight"], strict=True)] == [n for _, n in vllm["in_flight"]]
    for case, plan, theirs in zip(cases, plans, vllm["layouts"], strict=True):
        ours = [(sorted(g.layers), g.block_size, g.page_bytes) for g in plan.groups]
        assert ours == [(layers, block, page) for layers, _, block, page in theirs["groups"]]
        for group in plan.groups:
            if group.kind == "sliding":
                assert theirs["admission"][str(group.window)] == [
                    KVGroup("sliding", (0,), 1, group.block_size, 1.0, group.window)
                    .blocks_per_request(tokens, in_flight) for in_flight, tokens in
                    case["admissions"]]


def test_committed_benchmark_results_are_what_the_planner_plans(monkeypatch):
    import importlib.util
    import sys

    benchmarks = ROOT / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))        # the script imports _results
    spec = importlib.util.spec_from_file_location("bench_kv_layouts",
                                                  benchmarks / "bench_kv_layouts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sys.modules.pop("_results", None)
    stored = json.loads((benchmarks / "results" / "kv_layouts.json").read_text())
    assert stored["requests_per_gpu"] == bench.requests_rows()
    assert stored["mla_vs_gqa"] == bench.mla_rows()
    assert stored["mla_vs_gqa"]["deepseek_v3_mla_bytes_per_token"] == 61 * 576 * 2
    assert round(bench.gpt_oss_weight_bytes() / GiB, 2) == 60.77


# --- the exercises' checks ----------------------------------------------------------------------

def test_exercise_checks_grade_every_part_together_and_name_no_part_or_direction():
    """Exercises 1-3 of chapter 14: the right answers (worked here by hand, independently of the
    planner) pass; a wrong answer in any one part gets the same message, which names concepts,
    never the part or the direction, so no part can be found alone by trying values."""
    from kvlab.exercises import _common, ch14

    def forget_predictions() -> None:     # a new reader (tests/conftest.py owns the file)
        _common._PREDICTIONS.clear()
        _common._PREDICTION_FILE.unlink(missing_ok=True)

    # 1: Qwen3-Next at TP 4, 10,000 tokens: 12 full layers keep one of 2 KV heads of 256 + 256
    # in bf16; 36 gated-DeltaNet states, a quarter each: conv (2·16·128 + 32·128)/4 × 3 × 2 B
    # and SSM 32/4 × 128 × 128 × 2 B
    state_share = (2 * 16 * 128 + 32 * 128) // 4 * 3 * 2 + 32 // 4 * 128 * 128 * 2
    rank = 12 * (256 + 256) * 2 * 10_000 + 36 * state_share
    assert "Correct" in ch14.check_rank_request_bytes(rank)
    wrong = set()
    for off in (rank + 1, rank - 36 * state_share, 12 * 1024 * 10_000 + 36 * 4 * state_share):
        with pytest.raises(AssertionError) as err:
            ch14.check_rank_request_bytes(off)
        wrong.add(str(err.value))
    assert len(wrong) == 1
    # 2: gpt-oss-120b: 18-layer groups of 16 tokens × 8 heads × (64 + 64) × 2 B; 65,536 / 16
    # full blocks + (127 + 1) / 16 + 1 windowed ones; 0.9 × CUDA's total less weights and reserve
    block = 18 * 16 * 8 * 128 * 2
    blocks = 65536 // 16 + 128 // 16 + 1
    case = ch14.GPT_OSS_CASE
    budget = 0.9 * H100.cuda_total_bytes - case["weight_bytes"] - case["reserve_bytes"]
    pool = [block, blocks, int(budget // block) // blocks]
    forget_predictions()
    assert "Correct" in ch14.check_gpt_oss_pool(*pool)           # a right one locks nothing
    messages = set()
    for i in range(3):
        forget_predictions()
        off = list(pool)
        off[i] += 1
        with pytest.raises(AssertionError) as err:
            ch14.check_gpt_oss_pool(*off)
        messages.add(str(err.value))
        # graded once: after a wrong prediction, even the right answer is not graded
        assert "graded once" in ch14.check_gpt_oss_pool(*pool)
        with pytest.raises(AssertionError):
            ch14.check_gpt_oss_pool(*off)                         # the prediction, again
    assert len(messages) == 1
    forget_predictions()
    # 3: Qwen3.5-4B in fp8: conv (2·16·128 + 32·128) × 3 in bf16, SSM 32 × 128 × 128 in fp32;
    # 4 KV heads × (256 + 256) × 1 B per token; the state in whole 16-token kernel blocks
    state = (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4
    per_token = 4 * 512
    hybrid = [state, per_token, 16 * math.ceil(state / (16 * per_token))]
    assert hybrid == [2_146_304, 2048, 1056]
    assert "Correct" in ch14.check_hybrid_block_size(*hybrid)
    messages = set()
    for i, step in enumerate((1, 2048, 16)):
        off = list(hybrid)
        off[i] += step
        with pytest.raises(AssertionError) as err:
            ch14.check_hybrid_block_size(*off)
        messages.add(str(err.value))
    assert len(messages) == 1
    for text in wrong | messages:
        assert not any(w in text.lower() for w in ("too high", "too low", "larger", "smaller",
                                                    "fewer", "more than"))
