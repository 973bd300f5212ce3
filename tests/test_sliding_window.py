"""Sliding-window attention: the layer types read from a checkpoint's config as transformers
reads them, and every attention path (torch, compiled CPU) against a dense windowed reference
(query ``i`` sees keys ``i - W + 1 .. i``) in every shape a step takes: a fresh prompt, a short
chunk behind a cached prefix (paged rows), a long one (the chunk op), decode rows. Parity of
whole windowed models with transformers is in ``test_hf_parity.py``."""

from __future__ import annotations

import pytest
import torch
from dense_attention import dense_causal_attention

from kvlab.engine.attention_cpu import CpuAttention
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.attention_torch import TorchAttention
from kvlab.engine.config import FULL, SLIDING, ConfigError, ModelConfig
from kvlab.kernels import cpu as cpu_kernels

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def _config(arch: str, **fields) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [arch], **BASE, **fields})


# ----------------------------------------------------------------------------- which layers slide
def test_mistral_slides_every_layer_and_ignores_layer_types():
    cfg = _config("MistralForCausalLM", sliding_window=8, layer_types=[FULL] * 4)
    assert cfg.layer_windows == (8, 8, 8, 8)
    assert _config("MistralForCausalLM", sliding_window=None).layer_windows == (0, 0, 0, 0)
    assert _config("MistralForCausalLM").sliding_window == 4096   # MistralConfig's default


def test_ministral_slides_the_layers_its_layer_types_name():
    types = [FULL, SLIDING, SLIDING, FULL]
    cfg = _config("MinistralForCausalLM", sliding_window=8, layer_types=types)
    assert cfg.layer_windows == (0, 8, 8, 0)
    assert _config("MinistralForCausalLM", sliding_window=8).layer_windows == (8,) * 4
    assert _config("MinistralForCausalLM", sliding_window=None).layer_windows == (0,) * 4
    with pytest.raises(ConfigError, match="layer_types"):
        _config("MinistralForCausalLM", sliding_window=None, layer_types=types)


def test_qwen_window_needs_use_sliding_window_and_starts_at_max_window_layers():
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert _config(arch, sliding_window=8).layer_windows == (0, 0, 0, 0)
        cfg = _config(arch, use_sliding_window=True, sliding_window=8, max_window_layers=1)
        assert cfg.layer_windows == (0, 8, 8, 8)
        assert cfg.layer_types == (FULL, SLIDING, SLIDING, SLIDING)
        # an explicit layer_types wins over max_window_layers
        types = [SLIDING, FULL, SLIDING, FULL]
        cfg = _config(arch, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                      layer_types=types)
        assert cfg.layer_windows == (8, 0, 8, 0)
        # no layer slides: the config is the plain one
        plain = _config(arch, use_sliding_window=True, sliding_window=8, max_window_layers=4)
        assert plain == _config(arch)


@pytest.mark.parametrize(("arch", "fields", "field"), [
    ("Qwen2ForCausalLM", {"layer_types": [SLIDING, FULL, FULL, FULL]}, "layer_types"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": None,
                          "layer_types": [SLIDING] * 4}, "layer_types"),
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "layer_types": [SLIDING] * 3},
     "layer_types"),
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "layer_types": ["chunked"] * 4},
     "layer_types"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
    ("MistralForCausalLM", {"sliding_window": 8.0}, "sliding_window"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": -1},
     "max_window_layers"),
    ("LlamaForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
])
def test_bad_window_fields_are_refused_naming_the_field(arch, fields, field):
    with pytest.raises(ConfigError, match=field):
        _config(arch, **fields)


# ----------------------------------------------------------------------------- attention paths
def _one_sequence(seed: int, length: int, block_size: int, heads: int, kv_heads: int, dim: int):
    """A paged cache holding one sequence's K/V at scattered blocks, its table and queries."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-length // block_size)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].tolist()
    k_cache = torch.randn(blocks + 3, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks + 3, block_size, kv_heads, dim, generator=gen)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                          for p in range(length)])
    k = k_cache.view(-1, kv_heads, dim)[slots]
    v = v_cache.view(-1, kv_heads, dim)[slots]
    q = torch.randn(length, heads, dim, generator=gen)
    return q, k, v, k_cache, v_cache, table


def _backends() -> list:
    backends = [TorchAttention()]
    compiled = CpuAttention.create(torch.float32)
    if compiled is not None:
        backends.append(compiled)
    return backends


@pytest.mark.parametrize("window", [1, 3, 8, 16, 21, 64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_every_path_attends_exactly_the_window(window, block_size):
    """One 60-token sequence cut into a step's chunk shapes: each backend's rows equal the
    dense windowed reference (and differ from the unwindowed one where the window bites)."""
    heads, kv_heads, dim, length, scale = 4, 2, 32, 60, 32 ** -0.5
    q, k, v, k_cache, v_cache, table = _one_sequence(window * 31 + block_size, length,
                                                     block_size, heads, kv_heads, dim)
    want = dense_causal_attention(q, k, v, scale, window)
    full = dense_causal_attention(q, k, v, scale)
    # a fresh prompt of 20, a short chunk behind it (paged rows), a long one (dense), decodes
    pieces = [(0, 20), (20, 5), (25, 33), (58, 1), (59, 1)]
    for backend in _backends():
        for start, n in pieces:
            chunks = [ChunkSpec(list(range(n)), start, table)]
            meta = build_metadata(chunks, block_size, paged_max_tokens=backend.paged_max_tokens)
            got = backend.attend(q[start:start + n].contiguous(), k[start:start + n],
                                 v[start:start + n], k_cache, v_cache, meta, scale,
                                 window=window)
            assert torch.allclose(got, want[start:start + n], atol=2e-5), \
                (backend.name, start, n, (got - want[start:start + n]).abs().max())
    assert (window >= length) or not torch.allclose(want, full, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ops_window_in_one_batch_of_many_rows(dtype):
    """Decode rows of different lengths and chunks of different starts in one call each, with
    a window smaller than a key tile and wider than a block: the compiled ops against torch."""
    if not cpu_kernels.available():
        pytest.skip(f"no compiled CPU op here: {cpu_kernels.build_error()}")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, bs, window = 8, 2, 64, 16, 37
    k_cache = torch.randn(64, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(64, bs, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(64, generator=gen).tolist()
    chunks = [ChunkSpec(list(range(n)), s, perm[i * 12:(i + 1) * 12])
              for i, (s, n) in enumerate([(0, 150), (40, 90), (150, 1), (7, 1), (100, 30)])]
    meta = build_metadata(chunks, bs, paged_max_tokens=CpuAttention.paged_max_tokens)
    q = torch.randn(meta.num_tokens, heads, dim, generator=gen).to(dtype)
    # the step's own K/V (a fresh prompt's torch path reads them) are what the cache holds
    slots = meta.slot_mapping
    k, v = (c.view(-1, kv_heads, dim)[slots] for c in (k_cache, v_cache))
    got = CpuAttention.create(dtype).attend(q, k, v, k_cache, v_cache, meta, 0.125,
                                            window=window)
    ref = TorchAttention().attend(q.float(), k.float(), v.float(), k_cache.float(),
                                  v_cache.float(), meta, 0.125, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), ref, atol=tol, rtol=tol)


def test_checked_ops_refuse_a_bad_window():
    if not cpu_kernels.available():
        pytest.skip(f"no compiled CPU op here: {cpu_kernels.build_error()}")
    q, _, _, k_cache, v_cache, table = _one_sequence(0, 8, 4, 4, 2, 32)
    tables, lens = torch.tensor([table]), torch.tensor([8])
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="window"):
            cpu_kernels.decode_attention(q[:1], k_cache, v_cache, tables, lens, 0.1,
                                         window=bad)
        with pytest.raises(ValueError, match="window"):
            cpu_kernels.chunk_attention(q, k_cache, v_cache, tables, [0, 8], [0], 0.1,
                                        window=bad)
