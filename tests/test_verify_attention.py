"""Speculative verification's shape (many short chunks behind a cached prefix, mixed with
decodes and fresh prompts) through both branches of paged attention: with a kernel the short
chunks become paged rows, without one they stay SDPA chunks, and both agree with the dense
reference."""

from __future__ import annotations

import random

import pytest
import torch
from dense_attention import dense_causal_attention

from kvlab.engine.attention_cpu import CpuAttention
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.attention_torch import TorchAttention
from kvlab.engine.kv_cache import PagedKVCache, write_kv
from kvlab.kernels import cpu as cpu_kernels

PAGED_MAX_TOKENS = CpuAttention.paged_max_tokens
TORCH = TorchAttention()


def _step(seed: int, heads: int, kv_heads: int, block_size: int, dtype=torch.float32,
          paged_max_tokens: int = 0):
    """A cache holding random contexts, and one step mixing decodes, fresh prompts and
    verification-like chunks (cached prefix, a few lengths shared by several requests)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dim = 8
    n_req = rng.randint(6, 20)
    lengths = [rng.choice([1, 3, 3, 4, 4, 4, 5]) for _ in range(n_req)]
    starts = [0 if rng.random() < 0.15 else rng.randint(1, 60) for _ in range(n_req)]
    need = [-(-(s + q) // block_size) for s, q in zip(starts, lengths, strict=True)]
    num_blocks = sum(need) + 2
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, dim, dtype=dtype)
    kc, vc = cache.layers[0]
    full = []   # per request: k, v of positions 0..end-1 (the prefix is already cached)
    for s, q, table in zip(starts, lengths, tables, strict=True):
        k = torch.randn(s + q, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(s + q, kv_heads, dim, generator=gen).to(dtype)
        if s:
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                                  for p in range(s)])
            write_kv(kc, vc, k[:s], v[:s], slots)
        full.append((k, v))
    chunks = [ChunkSpec(list(range(q)), s, t)
              for s, q, t in zip(starts, lengths, tables, strict=True)]
    meta = build_metadata(chunks, block_size, paged_max_tokens=paged_max_tokens)
    n = meta.num_tokens
    qs = torch.randn(n, heads, dim, generator=gen).to(dtype)
    k_new = torch.empty(n, kv_heads, dim, dtype=dtype)
    v_new = torch.empty(n, kv_heads, dim, dtype=dtype)
    for i, (s, q) in enumerate(zip(starts, lengths, strict=True)):
        rows = slice(meta.last_row[i] - q + 1, meta.last_row[i] + 1)
        k_new[rows], v_new[rows] = full[i][0][s:], full[i][1][s:]
    write_kv(kc, vc, k_new, v_new, meta.slot_mapping)
    return meta, qs, k_new, v_new, kc, vc, (starts, lengths, full), dim


def _cpu(dtype) -> CpuAttention:
    backend = CpuAttention.create(dtype)
    if backend is None:
        pytest.skip(f"no CPU kernel here: {cpu_kernels.build_error()}")
    return backend


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_verification_rows_equal_the_dense_reference_on_both_ops(seed, heads, kv_heads):
    block_size = [1, 4, 16][seed % 3]
    meta, q, k, v, kc, vc, (starts, lengths, full), dim = _step(seed, heads, kv_heads,
                                                                 block_size)
    cpu = _cpu(torch.float32)
    fast = _step(seed, heads, kv_heads, block_size, paged_max_tokens=cpu.paged_max_tokens)[0]
    multi = tuple(i for i, n in enumerate(lengths) if n > 1)
    assert meta.dense == multi and meta.paged_rows.numel() == len(lengths) - len(multi)
    # with the kernel every chunk behind a prefix (all short here) is paged rows
    assert fast.dense == tuple(i for i in multi if starts[i] == 0)
    assert fast.paged_rows.numel() == sum(n for s, n in zip(starts, lengths, strict=True)
                                          if s > 0 or n == 1)
    torch_out = TORCH.attend(q, k, v, kc, vc, meta, dim ** -0.5)
    kernel_out = cpu.attend(q, k, v, kc, vc, fast, dim ** -0.5)
    torch.testing.assert_close(kernel_out, torch_out, rtol=1e-5, atol=1e-5)
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        kk, vv = full[i]
        rows = slice(meta.last_row[i] - n + 1, meta.last_row[i] + 1)
        qq = torch.zeros(s + n, heads, dim)
        qq[s:] = q[rows]
        dense = dense_causal_attention(qq, kk, vv, dim ** -0.5)[s:]
        torch.testing.assert_close(torch_out[rows], dense, rtol=1e-4, atol=1e-5)


def test_a_chunk_longer_than_the_bound_stays_dense():
    """With the compiled backend, one token over its ``paged_max_tokens`` behind a prefix is a
    dense chunk; at the bound it is paged rows (each reading the context through the table)."""
    n = PAGED_MAX_TOKENS
    chunks = [ChunkSpec([0] * n, 5, list(range(8))), ChunkSpec([0] * (n + 1), 5, list(range(8)))]
    assert build_metadata(chunks, 4).dense == (0, 1)   # the torch path: both SDPA chunks
    meta = build_metadata(chunks, 4, paged_max_tokens=n)   # the layout the CPU backend gets
    assert meta.dense == (1,) and meta.paged_rows.tolist() == list(range(n))
    assert meta.paged_lens.tolist() == list(range(6, 6 + n))
    assert meta.paged_tables.shape == (n, -(-(5 + n) // 4))


def test_bfloat16_kernel_rows_match_the_torch_path():
    meta, q, k, v, kc, vc, _, dim = _step(3, 4, 2, 4, dtype=torch.bfloat16)
    ref = TORCH.attend(q, k, v, kc, vc, meta, dim ** -0.5)
    cpu = _cpu(torch.bfloat16)
    fast_meta = _step(3, 4, 2, 4, dtype=torch.bfloat16, paged_max_tokens=cpu.paged_max_tokens)[0]
    fast = cpu.attend(q, k, v, kc, vc, fast_meta, dim ** -0.5)
    torch.testing.assert_close(fast, ref, rtol=2e-2, atol=2e-2)


def test_speculative_engine_gives_the_same_tokens_with_and_without_the_kernel(monkeypatch):
    """End to end with a draft model: verification rows through the CPU op or the torch path
    give the same greedy tokens, and logprobs up to float rounding."""
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    _cpu(torch.float32)
    prompts = ["The town of", "Once upon a time, the river", "Question: where does",
               "The town of Harrow is", "In the Vale, the people", "A storm came to"]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    runs = {}
    for on in (False, True):
        monkeypatch.setenv("KVLAB_CPU_ATTENTION", "1" if on else "0")
        llm = LLM("kvlab-tiny", num_blocks=512, max_num_seqs=8, speculative_config={
            "method": "draft_model", "model": "kvlab-tiny-draft", "num_speculative_tokens": 3})
        attention = llm.engine.executor.kernels.attention
        assert isinstance(attention, CpuAttention if on else TorchAttention)
        runs[on] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.logprobs, b.logprobs, strict=True):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)
