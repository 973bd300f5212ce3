"""kvlab's engine against Hugging Face transformers on the same (random) weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvlab.labs.parity.hf import compare_with_hf, save_random_hf_model

TOL = 1e-4


def _prompts(n: int, vocab: int = 128, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 16, 17, 33, 40, 7, 64][:n]
    return [torch.randint(0, vocab, (t,), generator=gen).tolist() for t in lengths]


@pytest.mark.parametrize(
    ("arch", "overrides", "engine_kwargs"),
    [
        ("llama", {}, {"block_size": 16}),
        ("llama", {}, {"block_size": 1, "max_prefill_chunk": 7, "max_num_batched_tokens": 24}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64},
                   "tie_word_embeddings": True}, {"block_size": 2}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {"block_size": 4}),
        ("qwen2", {}, {"block_size": 16, "max_prefill_chunk": 16}),
        ("qwen3", {}, {"block_size": 8}),
        ("mistral", {"head_dim": 32}, {"block_size": 16}),
    ],
    ids=["llama-gqa", "llama-bs1-chunked", "llama3-rope-tied", "linear-rope", "qwen2-bias",
         "qwen3-qk-norm", "mistral-head-dim"],
)
def test_logprobs_and_greedy_tokens_match_hf(tmp_path, arch, overrides, engine_kwargs):
    path = save_random_hf_model(tmp_path / arch, arch, seed=1, **overrides)
    report = compare_with_hf(path, _prompts(8), max_tokens=12, logprobs=5, tol=TOL,
                             **engine_kwargs)
    assert report.num_tokens == 8 * 12
    assert report.max_logprob_diff < TOL, report
    assert report.unexplained_mismatches == 0, report.details


def _windowed_prompts() -> list[list[int]]:
    """Prompts longer than the windows below, some sharing a 40-token prefix: run two at a time,
    the later ones start behind a cached prefix (paged rows and, past 16 tokens, a dense chunk)."""
    _, _, b, c, d, e = _prompts(6, seed=3)   # lengths 1, 5, 16, 17, 33, 40
    return [e, c, e + b, e + d[:24], b, d]


WINDOWED = [   # small windows, so that prompts and 30 generated tokens cross them many times
    ("mistral", {"sliding_window": 8}, {"block_size": 4}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
               "num_hidden_layers": 3},
     {"block_size": 4, "max_prefill_chunk": 8}),          # layer 0 full, layers 1, 2 slide
    ("qwen3", {"use_sliding_window": True, "sliding_window": 7,
               "layer_types": ["sliding_attention", "full_attention"]}, {"block_size": 16}),
    ("ministral", {"sliding_window": 5, "num_hidden_layers": 3,
                   "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     {"block_size": 2, "max_prefill_chunk": 16}),
]


@pytest.mark.parametrize(("cpu_attention", "tables"),
                         [("1", "per-group"), ("0", "per-group"), ("1", "one-full-table")],
                         ids=["compiled", "torch", "compiled-one-table"])
@pytest.mark.parametrize(("arch", "overrides", "engine_kwargs"), WINDOWED,
                         ids=["mistral-all-sliding", "qwen2-max-window-layers",
                              "qwen3-layer-types", "ministral-layer-types"])
def test_sliding_window_models_match_hf(tmp_path, monkeypatch, arch, overrides, engine_kwargs,
                                        cpu_attention, tables):
    """Windowed checkpoints (query i sees keys i-W+1..i in its sliding layers) token for token
    as transformers runs them, on the compiled CPU path and the torch path, with a table per KV
    cache group (windows release what falls out of them) or one full table for all layers."""
    monkeypatch.setenv("KVLAB_CPU_ATTENTION", cpu_attention)
    path = save_random_hf_model(tmp_path / arch, arch, seed=1, **overrides)
    prompts = _windowed_prompts()
    report = compare_with_hf(path, prompts, max_tokens=30, logprobs=5, tol=TOL,
                             max_num_seqs=2, **engine_kwargs,
                             disable_hybrid_kv_cache_manager=tables == "one-full-table")
    assert report.num_tokens == len(prompts) * 30
    assert report.max_logprob_diff < TOL, report
    assert report.unexplained_mismatches == 0, report.details


def test_a_window_off_by_one_is_caught(tmp_path, monkeypatch):
    """The windowed comparison is not vacuous: a window one key wider breaks it."""
    from kvlab.engine import model

    path = save_random_hf_model(tmp_path / "m", "mistral", seed=1, sliding_window=8)
    init = model.DecoderLayer.__init__
    monkeypatch.setattr(model.DecoderLayer, "__init__",
                        lambda self, cfg, window=0: init(self, cfg, window + 1))
    report = compare_with_hf(path, _windowed_prompts()[:2], max_tokens=8, block_size=4)
    assert report.max_logprob_diff > 100 * TOL


def test_parity_check_detects_wrong_weights(tmp_path, monkeypatch):
    """The comparison is not vacuous: perturbing one kvlab weight breaks it."""
    from kvlab.engine.llm import LLM

    path = save_random_hf_model(tmp_path / "m", "llama", seed=2)
    original = LLM.__init__

    def perturbed(self, model, **kw):
        original(self, model, **kw)
        with torch.no_grad():
            self.engine.model.layers[0].o.weight.add_(0.01)
        model = self.engine.model   # a weight changed in place is processed again (repacked)
        model.use_linear_method(model.layers[0].o.method)

    monkeypatch.setattr(LLM, "__init__", perturbed)
    report = compare_with_hf(path, _prompts(3), max_tokens=4)
    assert report.max_logprob_diff > TOL


def test_shipped_model_matches_hf():
    """The trained kvlab-tiny (tied embeddings, real tokenizer) through kvlab vs transformers."""
    from kvlab.engine.tokenizer import load_tokenizer
    from kvlab.models import shipped_model_path
    from kvlab.models.corpus import sample_prompts, shared_prefix_prompts

    try:
        path = shipped_model_path("kvlab-tiny")
    except FileNotFoundError:
        pytest.skip("shipped weights not built")
    tok = load_tokenizer(path)
    prompts = [tok.encode(t) for t in sample_prompts(5, 2) + shared_prefix_prompts(5, 2)]
    report = compare_with_hf(path, prompts, max_tokens=16, logprobs=5, block_size=16)
    assert report.max_logprob_diff < TOL, report
    assert report.unexplained_mismatches == 0, report.details


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    from transformers import AutoModelForCausalLM

    from kvlab.engine.checkpoint import load_checkpoint

    single = save_random_hf_model(tmp_path / "single", "qwen2", seed=6)
    hf = AutoModelForCausalLM.from_pretrained(str(single))
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a, b = load_checkpoint(single), load_checkpoint(tmp_path / "sharded")
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(),
                                 strict=True):
        assert torch.equal(x, y), name
    report = compare_with_hf(tmp_path / "sharded", _prompts(2), max_tokens=4)
    assert report.max_logprob_diff < TOL
