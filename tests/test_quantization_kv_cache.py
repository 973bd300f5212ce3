"""The quantized paged KV cache: attention over remapped blocks equals dense attention over the
dequantized K/V; copy-on-write carries scales; bad copies change nothing."""

from __future__ import annotations

import pytest
import torch
from dense_attention import dense_causal_attention

from kvlab.core.kv_dtype import kv_dtype_spec
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.attention_torch import TorchAttention
from kvlab.engine.ops import select_kernels
from kvlab.engine.quantization import QuantizedPagedKVCache, dequantize_kv, quantize_kv


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype_kernels", ["torch", "selected"])
def test_paged_attention_over_quantized_blocks_matches_dense(name, dtype_kernels):
    torch.manual_seed(0)
    spec = kv_dtype_spec(name)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    cache = QuantizedPagedKVCache(1, 32, bs, kv_heads, dim, spec)
    layer = cache.layers[0]
    assert layer.exact is False
    attention = (select_kernels("cpu", torch.float32).attention if dtype_kernels == "selected"
                 else TorchAttention())
    table = [17, 3, 29, 8, 11, 0, 21]            # scattered blocks: exercises the remap
    t = 22
    q = torch.randn(t, heads, dim)
    k = torch.randn(t, kv_heads, dim)
    v = torch.randn(t, kv_heads, dim)
    outs = []
    for start, end in ((0, 9), (9, 15), *((i, i + 1) for i in range(15, t))):
        meta = build_metadata([ChunkSpec(list(range(start, end)), start, table)], bs,
                              paged_max_tokens=attention.paged_max_tokens)
        outs.append(attention.forward(q[start:end], k[start:end], v[start:end], layer, meta,
                                      dim ** -0.5))
    out = torch.cat(outs)
    kq = dequantize_kv(*quantize_kv(k, spec), spec, torch.float32)
    vq = dequantize_kv(*quantize_kv(v, spec), spec, torch.float32)
    dense = dense_causal_attention(q, kq, vq, dim ** -0.5)
    # the first chunk (start 0) attends to its fresh, unquantized K/V; every later token reads
    # the quantized cache
    assert torch.allclose(out[9:], dense[9:], atol=1e-5)
    assert torch.allclose(out[:9], dense_causal_attention(q[:9], k[:9], v[:9], dim ** -0.5),
                          atol=1e-5)
    assert not torch.allclose(out[9:], dense_causal_attention(q, k, v, dim ** -0.5)[9:],
                              atol=1e-6)   # quantization did change something


def test_copy_blocks_copies_scales_and_refuses_bad_input():
    spec = kv_dtype_spec("int8")
    cache = QuantizedPagedKVCache(2, 6, 4, 2, 8, spec)
    layer = cache.layers[1]
    layer.write(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.arange(4, 8))  # block 1
    cache.copy_blocks([(1, 4)])
    assert torch.equal(cache.data[:, :, 4], cache.data[:, :, 1])
    assert torch.equal(cache.scales[:, :, 4], cache.scales[:, :, 1])
    assert bool((cache.scales[1, :, 4] > 0).all())
    snapshot = (cache.data.clone(), cache.scales.clone())
    for bad in ([(1, 6)], [(1, 2), (3, 2)]):
        with pytest.raises(AssertionError):
            cache.copy_blocks(bad)
        assert torch.equal(cache.data, snapshot[0]) and torch.equal(cache.scales, snapshot[1])
    # bytes: payload + fp16 scale per (token, head), exactly
    assert cache.block_bytes == 2 * 2 * 4 * 2 * (8 + 2)
    with pytest.raises(ValueError, match="quantized KV dtype"):
        QuantizedPagedKVCache(1, 2, 4, 2, 8, kv_dtype_spec("auto"))
