"""Quantization in the engine: accuracy vs fp32, bytes, the report, checkpoints, KV capacity
and prefix-cache scopes.

Accuracy bounds (kvlab-tiny, float32 activations, teacher-forced over 3 held-out documents,
557 predicted tokens; measured values in brackets, on torch 2.13 CPU):

=====================  ==================  ===================  =====================
format                 max |Δ logprob|     mean |Δ logprob|     greedy agreement
=====================  ==================  ===================  =====================
int8 g=64 weights      <= 0.1   [0.030]    <= 0.003  [0.0009]   all 8 x 32 tokens
int4 g=64 weights      <= 1.5   [0.72]     <= 0.05   [0.022]    >= 40% [55%]
int8 KV                <= 0.2   [0.068]    <= 0.003  [0.0006]   all 8 x 32 tokens
fp8 e4m3 KV            <= 1.0   [0.34]     <= 0.01   [0.0032]   all 8 x 32 tokens
=====================  ==================  ===================  =====================

Greedy agreement counts, per prompt, the generated tokens before the first difference.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.engine.checkpoint import load_checkpoint
from kvlab.engine.quantization import QuantConfig, QuantizedLinear, save_quantized
from kvlab.engine.quantization.linear import DEQUANT_KERNEL, INT4_KERNEL
from kvlab.labs.invariants import check_kv_manager
from kvlab.labs.perplexity import heldout_token_ids, token_logprobs
from kvlab.models.corpus import sample_prompts
from kvlab.reference import effective_bits

MODEL = "kvlab-tiny"
GREEDY = SamplingParams(max_tokens=32, temperature=0)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(MODEL, num_blocks=256)
    seqs = heldout_token_ids(llm.tokenizer, 3, 256)
    logps = [token_logprobs(llm.engine, s) for s in seqs]
    prompts = sample_prompts(1, 8)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return seqs, logps, prompts, greedy


def _agreement(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize(("kwargs", "max_bound", "mean_bound", "min_agree"), [
    ({"quantization": "int8"}, 0.1, 0.003, 1.0),
    ({"quantization": "int4"}, 1.5, 0.05, 0.4),
    ({"kv_cache_dtype": "int8"}, 0.2, 0.003, 1.0),
    ({"kv_cache_dtype": "fp8_e4m3"}, 1.0, 0.01, 1.0),
])
def test_accuracy_vs_fp32(reference, kwargs, max_bound, mean_bound, min_agree):
    seqs, ref_logps, prompts, ref_greedy = reference
    llm = LLM(MODEL, num_blocks=256, **kwargs)
    diff = torch.cat([(token_logprobs(llm.engine, s) - r).abs()
                      for s, r in zip(seqs, ref_logps, strict=True)])
    assert diff.max() <= max_bound and diff.mean() <= mean_bound, (diff.max(), diff.mean())
    assert diff.max() > 0  # it did quantize something
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    agree = sum(_agreement(o.outputs[0].token_ids, g) for o, g in zip(out, ref_greedy,
                                                                          strict=True))
    assert agree / (32 * len(prompts)) >= min_agree


def test_report_states_five_facts_read_from_what_ran():
    llm = LLM(MODEL, num_blocks=64, quantization=QuantConfig(4, 64, kernel="packed"))
    before = llm.quantization_report()
    assert before.kernels_executed == {}
    assert "nothing yet" in str(before)
    llm.generate(["The river"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    rep = llm.quantization_report()
    assert rep.checkpoint_bits.startswith("32 (float32 on disk")
    assert "int4 symmetric" in rep.runtime_weight_format
    assert rep.activation_dtype == "float32" and rep.accumulator_dtype == "float32"
    assert list(rep.kernels_executed) == [f"{INT4_KERNEL} [float32]"]
    # 16 decoder linears x 3 steps (one prefill, two decodes)
    assert rep.kernels_executed[f"{INT4_KERNEL} [float32]"] == 16 * 3
    # bytes: effective_bits x params / 8, exactly
    assert rep.linear_weight_bytes == effective_bits(4, 64) * rep.linear_params / 8
    assert rep.measured_bits == rep.effective_bits == 4.25
    forced = LLM(MODEL, num_blocks=64, quantization="int4")  # auto: dequant for float32
    forced.generate(["The river"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert list(forced.quantization_report().kernels_executed) == [f"{DEQUANT_KERNEL} [float32]"]
    half = LLM(MODEL, num_blocks=64, quantization="int4", dtype="bfloat16")  # auto: packed
    half.generate(["The river"], SamplingParams(max_tokens=1), use_tqdm=False)
    hrep = half.quantization_report()
    assert list(hrep.kernels_executed) == [f"{INT4_KERNEL} [bfloat16]"]
    assert hrep.activation_dtype == "bfloat16" and hrep.runtime_extra_bytes > 0
    plain = LLM(MODEL, num_blocks=64)
    plain.generate(["The river"], SamplingParams(max_tokens=1), use_tqdm=False)
    prep = plain.quantization_report()
    assert prep.runtime_weight_format.startswith("float32 dense")
    assert list(prep.kernels_executed) == ["aten.linear [float32]"]
    assert prep.linear_weight_bytes == 4 * prep.linear_params


def test_int8_weights_quarter_of_fp32():
    q = LLM(MODEL, num_blocks=16, quantization="int8", quantization_group_size=32)
    f = LLM(MODEL, num_blocks=16)
    rq, rf = q.quantization_report(), f.quantization_report()
    assert rq.linear_params == rf.linear_params
    assert rq.linear_weight_bytes * 32 == rf.linear_weight_bytes * (8 + 16 / 32)
    assert rq.other_weight_bytes == rf.other_weight_bytes  # embeddings and norms untouched


def test_save_and_load_pre_quantized_bit_identical(tmp_path):
    llm = LLM(MODEL, num_blocks=64, quantization="int4", quantization_group_size=32)
    out = save_quantized(llm.engine.checkpoint, tmp_path / "tiny-int4")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "kvlab-group" and cfg["bits"] == 4 and cfg["group_size"] == 32
    again = LLM(str(out), num_blocks=64)
    a, b = llm.engine.model.state_dict(), again.engine.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    rep = again.quantization_report()
    assert rep.weight_source == "pre-quantized checkpoint"
    assert rep.checkpoint_bits.startswith("4 (int4, pre-quantized)")
    prompts = sample_prompts(2, 3)
    sp = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    x = llm.generate(prompts, sp, use_tqdm=False)
    y = again.generate(prompts, sp, use_tqdm=False)
    for o, p in zip(x, y, strict=True):
        assert o.outputs[0].token_ids == p.outputs[0].token_ids
        assert [d[t] for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                     strict=True)] == \
               [d[t] for d, t in zip(p.outputs[0].logprobs, p.outputs[0].token_ids, strict=True)]
    # a different format requested for a quantized checkpoint is refused
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(out), num_blocks=64, quantization="int8")
    # a damaged checkpoint names the tensor
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(out / "model.safetensors"))
    tensors.pop("layers.0.qkv.scales")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "kvlab-group-v1"})
    with pytest.raises(ValueError, match=r"layers\.0\.qkv\.scales"):
        LLM(str(out), num_blocks=64)


def test_zero_point_variant_runs_and_counts_zero_bits():
    llm = LLM(MODEL, num_blocks=32, quantization=QuantConfig(4, 64, symmetric=False))
    rep = llm.quantization_report()
    assert rep.effective_bits == effective_bits(4, 64, zero_bits=8) == rep.measured_bits
    out = llm.generate(["The river"], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"quantization": "int3"}, "quantization must be None, 'int8', 'int4'"),
    ({"quantization": "int4", "quantization_group_size": 0}, "positive int"),
    ({"quantization": "int4", "quantization_group_size": 48}, "does not divide"),
    ({"quantization": "int4", "quantization_group_size": 128}, "does not divide"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype must be one of"),
    ({"quantization": "int4", "kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of"),
])
def test_bad_configs_refused_with_model_untouched(kwargs, match):
    ckpt = load_checkpoint(MODEL)
    before = {k: v.clone() for k, v in ckpt.model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        LLM(ckpt, num_blocks=16, **kwargs)
    assert not any(isinstance(m, QuantizedLinear) for m in ckpt.model.modules())
    after = ckpt.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_block_count_grows_with_kv_dtype_at_fixed_memory():
    budget = 4 * 2**20
    counts = {}
    for kv in ("auto", "int8", "fp8_e4m3"):
        llm = LLM(MODEL, kv_cache_memory=budget, max_num_seqs=512, kv_cache_dtype=kv)
        counts[kv] = llm.engine.num_blocks
        assert llm.engine.cache.nbytes == counts[kv] * llm.engine.cache.block_bytes <= budget
        assert llm.quantization_report().kv_cache_bytes == llm.engine.cache.nbytes
    # block = 16 tokens x 2048 B (fp32) vs 16 x 544 B (int8 + fp16 scale per token-head)
    assert counts["auto"] == budget // (16 * 2048) == 128
    assert counts["int8"] == counts["fp8_e4m3"] == budget // (16 * 544) == 481
    assert counts["int8"] > 3 * counts["auto"]


def test_prefix_cache_never_hits_across_kv_dtypes():
    scopes = {kv: LLM(MODEL, num_blocks=8, kv_cache_dtype=kv).engine.cache_scope()
              for kv in ("auto", "int8", "fp8_e4m3")}
    assert len(set(scopes.values())) == 3
    w4 = LLM(MODEL, num_blocks=8, quantization="int4").engine.cache_scope()
    assert w4 != scopes["auto"]  # weights quantization changes the KV too
    prompt = list(range(2, 40))
    kv = KVCacheManager(16, 16)
    kv.admit("a", scopes["int8"], prompt, len(prompt))
    kv.commit("a", prompt)
    assert kv.lookup(scopes["int8"], prompt) == 32    # two full blocks hit in the same scope
    assert kv.lookup(scopes["auto"], prompt) == 0
    assert kv.lookup(scopes["fp8_e4m3"], prompt) == 0
    check_kv_manager(kv)


def test_quantized_kv_prefix_hits_stay_within_tolerance():
    """A prompt served from an int8 prefix cache reads its prefix from quantized KV; computed
    afresh, its prefill attends to unquantized K/V. Both stay within the KV tolerance."""
    from kvlab.models.corpus import shared_prefix_prompts

    prompts = shared_prefix_prompts(0, 2)
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=0)

    def run(prefix_caching):
        llm = LLM(MODEL, num_blocks=128, kv_cache_dtype="int8",
                  enable_prefix_caching=prefix_caching)
        outs = llm.generate(prompts[:1], sp, use_tqdm=False)
        outs += llm.generate(prompts[1:], sp, use_tqdm=False)
        return outs

    cached, fresh = run(True), run(False)
    assert cached[1].num_cached_tokens >= 32 and fresh[1].num_cached_tokens == 0
    for a, b in zip(cached, fresh, strict=True):
        la = [d[t] for d, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids, strict=True)]
        lb = [d[t] for d, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids, strict=True)]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert la == pytest.approx(lb, abs=0.2)


def test_cli_prints_the_report(capsys):
    from kvlab.__main__ import main

    assert main(["--quantization", "int8", "--group-size", "32", "--requests", "2",
                 "--max-tokens", "2", "--show", "0"]) == 0
    out = capsys.readouterr().out
    for fact in ("checkpoint bit width", "runtime weight format", "activation dtype",
                 "accumulator dtype", "kernel executed"):
        assert fact in out
    assert "dequantize-per-group + aten.linear [float32] x" in out
    assert "effective 8.5 bits/weight" in out


def test_half_precision_engine_quantizes_the_checkpoint_values():
    """Scales come from the float32 checkpoint, not from a bf16-rounded copy: the stored
    format is identical whatever the activation dtype."""
    f32 = LLM(MODEL, num_blocks=16, quantization="int4")
    bf16 = LLM(MODEL, num_blocks=16, quantization="int4", dtype="bfloat16")
    a, b = f32.engine.model.state_dict(), bf16.engine.model.state_dict()
    for k in a:
        if k.endswith((".qweight", ".scales")):
            assert torch.equal(a[k], b[k]), k
        else:
            assert b[k].dtype == torch.bfloat16, k
    assert bf16.engine.model.inv_freq.dtype == torch.float32


def test_shared_loaded_checkpoint_keeps_its_format():
    ckpt = load_checkpoint(MODEL)
    first = LLM(ckpt, num_blocks=16, quantization="int8", quantization_group_size=32)
    before = {k: v.clone() for k, v in ckpt.model.state_dict().items()}
    with pytest.raises(ValueError, match="already quantized"):
        LLM(ckpt, num_blocks=16, quantization="int4")
    assert all(torch.equal(before[k], v) for k, v in ckpt.model.state_dict().items())
    second = LLM(ckpt, num_blocks=16)          # quantization=None: use it as it is
    rep = second.quantization_report()
    assert rep.weight_source == "quantized earlier (in memory)"
    assert rep.effective_bits == 8.5 == first.quantization_report().effective_bits


def test_plain_kernel_log_follows_the_latest_engine_without_double_counting():
    ckpt = load_checkpoint(MODEL)
    first = LLM(ckpt, num_blocks=16)
    second = LLM(ckpt, num_blocks=16)
    second.generate(["The river"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert second.quantization_report().kernels_executed == {"aten.linear [float32]": 16}
    assert first.quantization_report().kernels_executed == {}


def test_kv_transfer_refuses_a_quantized_kv_cache(tmp_path):
    with pytest.raises(ValueError, match="moves unquantized KV only"):
        LLM(MODEL, num_blocks=16, kv_cache_dtype="int8",
            kv_transfer_config={"kv_connector": "shared_storage", "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path":
                                                              str(tmp_path)}})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "model": "kvlab-tiny-draft", "num_speculative_tokens": 3},
    {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
     "num_speculative_tokens": 3}])
def test_speculative_decoding_over_quantized_weights_and_kv(spec):
    """Speculation stays exact over a quantized target: greedy tokens equal the same quantized
    engine without speculation (the verifier reads the same quantized KV and weights)."""
    prompts = sample_prompts(4, 4)
    sp = SamplingParams(max_tokens=16, temperature=0)
    kw = {"num_blocks": 128, "quantization": "int8", "kv_cache_dtype": "int8"}
    plain = LLM(MODEL, **kw).generate(prompts, sp, use_tqdm=False)
    fast = LLM(MODEL, speculative_config=spec, **kw).generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]


def test_heldout_split_is_the_one_training_left_out():
    from kvlab.labs.perplexity import HELDOUT_START
    from kvlab.models import shipped_model_path

    info = json.loads((shipped_model_path(MODEL) / "training_info.json").read_text())
    assert info["heldout"]["start"] == HELDOUT_START
    assert info["corpus"]["num_docs"] <= HELDOUT_START
