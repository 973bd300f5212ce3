"""The engine's input boundary: sampling parameters, checkpoint files and model names.

Every value :class:`SamplingParams` accepts must sample without error (a bad row would fail
the whole batch), and every value a checkpoint's JSON files hold is checked on load, with an
error naming the file and the field.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from kvlab.core.checks import is_int
from kvlab.core.sampling_params import MAX_SEED, MIN_TEMPERATURE, SamplingParams, is_real
from kvlab.engine.checkpoint import load_checkpoint, resolve_model_path
from kvlab.engine.config import ConfigError, ModelConfig
from kvlab.engine.llm import LLM
from kvlab.engine.sampler import SamplerState, filter_logits, sample
from kvlab.engine.tokenizer import Tokenizer, load_tokenizer
from kvlab.models import shipped_model_path

VOCAB = 64


# ----------------------------------------------------------------------------- shared checks
def test_is_int_and_is_real():
    assert is_int(3) and is_int(-1) and is_int(2**100)
    assert not any(is_int(v) for v in (True, False, 3.0, "3", None))
    assert is_real(0) and is_real(1.5) and is_real(-2)
    assert not any(is_real(v) for v in (True, math.nan, math.inf, -math.inf, 10**400, "1", None))


# ----------------------------------------------------------------------------- sampling
def _states(params: list[SamplingParams]) -> list[SamplerState]:
    return [SamplerState.create(p, p.seed if p.seed is not None else 100 + i)
            for i, p in enumerate(params)]


NORMAL = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.2, top_k=5, seed=2),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(temperature=1.5, top_k=8, top_p=0.7, seed=4),
    SamplingParams(temperature=MIN_TEMPERATURE, seed=5),  # the smallest sampled temperature
    SamplingParams(temperature=1.0, top_k=2**70, seed=6),  # k beyond any vocabulary: keep all
]
TINY = [  # each must give the argmax
    SamplingParams(temperature=1e-39, seed=7),
    SamplingParams(temperature=1e-300, seed=8),
    SamplingParams(temperature=MIN_TEMPERATURE / 2, seed=9),
    SamplingParams(temperature=5e-324),
    SamplingParams(temperature=1.0, top_p=1e-46, seed=10),
    SamplingParams(temperature=1.0, top_p=1e-300, top_k=3, seed=11),
    SamplingParams(temperature=1e-39, top_p=1e-46, logprobs=2, seed=12),
]


def test_tiny_temperature_and_top_p_rows_take_the_argmax_without_disturbing_the_batch():
    gen = torch.Generator().manual_seed(0)
    batch_params = [p for pair in zip(NORMAL, TINY, strict=False) for p in pair]
    batch_params += TINY[len(NORMAL):]
    batch_states = _states(batch_params)
    alone_states = _states(batch_params)  # same seeds, used one row at a time
    for _ in range(20):  # several steps: the private generators advance identically
        logits = torch.randn(len(batch_params), VOCAB, generator=gen) * 4
        got = sample(logits, batch_states)
        for i, p in enumerate(batch_params):
            alone = sample(logits[i:i + 1], alone_states[i:i + 1])
            assert got.token_ids[i] == alone.token_ids[0], p
            assert got.logprobs[i] == alone.logprobs[0]
            if p in TINY:
                assert got.token_ids[i] == int(logits[i].argmax())
        assert got.top_logprobs[batch_params.index(TINY[-1])] is not None


def test_filter_leaves_rows_without_filters_untouched_by_other_rows():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.7), SamplingParams(top_p=0.5),
              SamplingParams(top_k=3)]
    together = filter_logits(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(together[i], filter_logits(logits[i:i + 1], [p])[0])


def test_top_p_keeps_the_most_likely_token_however_small():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    for top_p in (1e-46, 1e-300, 1e-9, 0.01):
        kept = filter_logits(logits, [SamplingParams(top_p=top_p)])[0]
        assert kept.isfinite().tolist() == [False, True, False, False]
    kept = filter_logits(logits, [SamplingParams(top_p=0.9)])[0]  # 0.64 + 0.24 < 0.9: three kept
    assert kept.isfinite().tolist() == [False, True, True, True]


def test_greedy_below_min_temperature():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=MIN_TEMPERATURE * 0.999).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    assert SamplerState.create(SamplingParams(temperature=1e-39), 0).generator is None


# ----------------------------------------------------------------------------- SamplingParams
BAD_PARAMS = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf),
     ("temperature", 10**400), ("temperature", True), ("temperature", "0.5"),
     ("temperature", -1e-39),
     ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0), ("top_p", -1e-46),
     ("top_p", 1.0000001), ("top_p", True), ("top_p", "0.5"),
     ("top_k", math.nan), ("top_k", math.inf), ("top_k", 5.0), ("top_k", True), ("top_k", -2),
     ("max_tokens", math.inf), ("max_tokens", True), ("max_tokens", 8.0), ("max_tokens", 0),
     ("n", math.nan), ("n", True), ("n", 2.0),
     ("logprobs", math.inf), ("logprobs", True), ("logprobs", 1.5),
     ("seed", 2**64), ("seed", -1), ("seed", True), ("seed", 1.5), ("seed", math.nan),
     ("stop_token_ids", 5), ("stop_token_ids", "ab"), ("stop_token_ids", b"ab"),
     ("stop_token_ids", {1: 2}), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]),
     ("stop_token_ids", iter(["a"])), ("stop_token_ids", [math.nan]),
     ("ignore_eos", 1), ("ignore_eos", "false")]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS,
                         ids=[f"{f}={v!r}"[:40] if isinstance(v, (int, float, str, bytes))
                              else f"{f}={type(v).__name__}" for f, v in BAD_PARAMS])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_sampling_params_edges_that_are_accepted():
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(seed=MAX_SEED).seed == 2**64 - 1
    p = SamplingParams(temperature=2, top_p=1)
    assert p.temperature == 2.0 and isinstance(p.temperature, float)
    assert isinstance(p.top_p, float) and not p.uses_top_p
    assert SamplingParams(top_p=1e-46).uses_top_p
    assert SamplingParams(temperature=1e300).temperature == 1e300


@pytest.mark.parametrize(
    ("stops", "expected"),
    [(iter([5]), (5,)), ((t for t in (1, 2)), (1, 2)), (range(3), (0, 1, 2)),
     ({7}, (7,)), ([3, 4], (3, 4)), ((), ())],
)
def test_stop_token_ids_iterables_are_materialised(stops, expected):
    assert SamplingParams(stop_token_ids=stops).stop_token_ids == expected


def test_huge_temperature_samples():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1e300, seed=0)
    assert 0 <= sample(logits, _states([p])).token_ids[0] < VOCAB


# ----------------------------------------------------------------------------- seeds
def test_sampler_seed_is_reduced_modulo_2_64():
    p = SamplingParams(temperature=1.0)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    for seed, same in ((2**64 + 5, 5), (2**64 - 1 + 3, 2), (-1, 2**64 - 1), (2**200, 0)):
        a, b = SamplerState.create(p, seed), SamplerState.create(p, same)
        assert [sample(logits, [a]).token_ids for _ in range(8)] == \
               [sample(logits, [b]).token_ids for _ in range(8)]
    with pytest.raises(ValueError, match="seed"):    # validated where it enters: the params
        SamplingParams(temperature=1.0, seed=1.5)


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("kvlab-tiny", block_size=4, num_blocks=64, max_num_seqs=8)


def test_largest_seed_with_n_samples(tiny_llm):
    """Sample i of a request seeded s uses seed (s + i) mod 2**64, even past the top."""
    prompt = [0, 5, 6, 7]
    base = MAX_SEED - 1
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=base, n=4, ignore_eos=True)
    (out,) = tiny_llm.generate([prompt], params)
    assert len(out.outputs) == 4
    for c in out.outputs:
        alone = SamplingParams(max_tokens=6, temperature=1.0, seed=(base + c.index) % 2**64,
                               ignore_eos=True)
        assert c.token_ids == tiny_llm.generate([prompt], alone)[0].outputs[0].token_ids


# ----------------------------------------------------------------------------- model names
def test_blank_model_name_is_refused_not_read_as_cwd(tmp_path, monkeypatch):
    shipped = shipped_model_path("kvlab-tiny")
    monkeypatch.chdir(shipped)  # a valid model here: "" must still not mean "this directory"
    for blank in ("", "   ", "\t\n"):
        with pytest.raises(ValueError, match="model"):
            LLM(blank)
        with pytest.raises(ValueError, match="model"):
            load_checkpoint(blank)
        with pytest.raises(ValueError, match="path"):
            Tokenizer(blank)
        with pytest.raises(ValueError, match="model_dir"):
            load_tokenizer(blank)
    with pytest.raises(TypeError, match="model"):
        resolve_model_path(None)
    with pytest.raises(TypeError, match="model"):
        resolve_model_path(5)
    assert resolve_model_path(".") == Path(".")  # the current directory, when asked for


# ----------------------------------------------------------------------------- checkpoint files
@pytest.fixture(scope="module")
def shipped() -> Path:
    return shipped_model_path("kvlab-tiny")


def _corrupt(shipped: Path, tmp_path: Path, file: str, changes: dict) -> Path:
    """A copy of ``shipped`` (weights linked, JSON copied) with ``changes`` applied to the
    top-level object of ``file``; a value of ``...`` deletes the key."""
    dst = tmp_path / "model"
    dst.mkdir()
    for f in shipped.iterdir():
        if f.suffix == ".json":
            (dst / f.name).write_text(f.read_text())
        else:
            (dst / f.name).symlink_to(f)
    data = json.loads((dst / file).read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    (dst / file).write_text(json.dumps(data))  # NaN / Infinity written as Python's json does
    return dst


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512}

BAD_CONFIG = [  # (changes to config.json, the field the error must name)
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings"),
    ({"attention_bias": "false"}, "attention_bias"),
    ({"mlp_bias": 1}, "mlp_bias"),
    ({"use_sliding_window": "false"}, "use_sliding_window"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
    ({"rope_theta": math.nan}, "rope_theta"),
    ({"rope_theta": math.inf}, "rope_theta"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_theta": True}, "rope_theta"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"vocab_size": 1024.0}, "vocab_size"),
    ({"vocab_size": "1024"}, "vocab_size"),
    ({"hidden_size": True}, "hidden_size"),
    ({"hidden_size": -192}, "hidden_size"),
    ({"intermediate_size": 512.5}, "intermediate_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_hidden_layers": ...}, "num_hidden_layers"),
    ({"max_position_embeddings": math.inf}, "max_position_embeddings"),
    ({"num_attention_heads": 6.0}, "num_attention_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"num_key_value_heads": True}, "num_key_value_heads"),
    ({"head_dim": 0}, "head_dim"),
    ({"head_dim": 31}, "head_dim"),
    ({"head_dim": 32.0}, "head_dim"),
    ({"head_dim": ..., "num_attention_heads": 5, "num_key_value_heads": 1}, "hidden_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"pretraining_tp": True}, "pretraining_tp"),
    ({"architectures": 5}, "architectures"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"architectures": ..., "model_type": "gpt2"}, "model_type"),
    ({"eos_token_id": "abc"}, "eos_token_id"),
    ({"eos_token_id": [1, -7]}, "eos_token_id"),
    ({"eos_token_id": 1.5}, "eos_token_id"),
    ({"eos_token_id": 1024}, "eos_token_id"),
    ({"eos_token_id": True}, "eos_token_id"),
    ({"bos_token_id": -1}, "bos_token_id"),
    ({"bos_token_id": [0]}, "bos_token_id"),
    ({"pad_token_id": 5000}, "pad_token_id"),
    ({"pad_token_id": "0"}, "pad_token_id"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": math.nan}}, "rope_scaling.factor"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 0.5}}, "rope_scaling.high_freq_factor"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": math.inf}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": True}},
     "rope_scaling.original_max_position_embeddings"),
    ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
     "rope_scaling.low_freq_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}},
     "rope_parameters.rope_theta"),
    ({"rope_parameters": [10000.0]}, "rope_parameters"),
]


@pytest.mark.parametrize(("changes", "field"), BAD_CONFIG,
                         ids=[f"{f}={next(iter(c.values()))!r}" for c, f in BAD_CONFIG])
def test_bad_config_json_names_file_and_field(shipped, tmp_path, changes, field):
    path = _corrupt(shipped, tmp_path, "config.json", changes)
    with pytest.raises(ConfigError) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert str(path / "config.json") in message
    assert f"'{field}'" in message, message


@pytest.mark.parametrize("eos", ["abc", [1, -7], 1.5, [1, 1024], True, {"id": 1}, [[1]]])
def test_bad_generation_config_eos_names_file_and_field(shipped, tmp_path, eos):
    path = _corrupt(shipped, tmp_path, "generation_config.json", {"eos_token_id": eos})
    with pytest.raises(ConfigError) as err:
        load_checkpoint(path)
    assert re.search(rf"{re.escape(str(path / 'generation_config.json'))}: field "
                     r"'eos_token_id'", str(err.value)), str(err.value)


def test_generation_config_must_be_an_object(shipped, tmp_path):
    path = _corrupt(shipped, tmp_path, "generation_config.json", {})
    (path / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"generation_config\.json must hold a JSON object"):
        load_checkpoint(path)


def test_good_token_ids_and_flags_load(shipped, tmp_path):
    path = _corrupt(shipped, tmp_path, "config.json",
                    {"eos_token_id": [1, 1023], "pad_token_id": None, "rope_scaling": None,
                     "tie_word_embeddings": True})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    ckpt = load_checkpoint(path)
    assert ckpt.config.eos_token_ids == (1, 1023)
    assert ckpt.generation_eos == (1, 2)


MINIMAL = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "num_attention_heads": 2, "intermediate_size": 8, "num_hidden_layers": 1,
           "max_position_embeddings": 8}


def test_from_dict_defaults_and_default_source():
    cfg = ModelConfig.from_dict({**MINIMAL, "num_key_value_heads": None, "head_dim": None})
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps) == (2, 4, 1e-6)
    assert cfg.rope.theta == 10000.0 and not cfg.tie_word_embeddings
    with pytest.raises(ConfigError, match=r"^config\.json: field 'rms_norm_eps'"):
        ModelConfig.from_dict({**MINIMAL, "rms_norm_eps": math.inf})


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}),
     ("llama", {"rope_scaling": dict(LLAMA3, original_max_position_embeddings=64),
                "tie_word_embeddings": True}),
     ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
     ("qwen2", {"bos_token_id": 3, "eos_token_id": [4, 5]})],
    ids=["llama", "llama3-rope-tied", "dynamic-rope", "qwen2-token-ids"],
)
def test_valid_random_hf_checkpoints_still_load(tmp_path, arch, overrides):
    pytest.importorskip("transformers")
    from kvlab.labs.parity.hf import save_random_hf_model

    path = save_random_hf_model(tmp_path / arch, arch, seed=1, **overrides)
    cfg = load_checkpoint(path).config
    assert cfg.model_type == arch
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    if arch == "qwen2":
        assert cfg.bos_token_id == 3 and cfg.eos_token_ids == (4, 5)
