"""Batched attention of equal-length multi-token chunks (speculative verification) equals
attending every chunk alone, and the dense causal reference."""

from __future__ import annotations

import random

import pytest
import torch
from dense_attention import dense_causal_attention

from kvlab.engine.attention import (
    ChunkSpec,
    build_metadata,
    paged_attention,
    split_buckets,
    write_kv,
)
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.prefill_groups import group_prefills


def _step(seed: int, heads: int, kv_heads: int, block_size: int, dtype=torch.float32):
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
    meta = build_metadata(chunks, block_size)
    n = meta.num_tokens
    qs = torch.randn(n, heads, dim, generator=gen).to(dtype)
    k_new = torch.empty(n, kv_heads, dim, dtype=dtype)
    v_new = torch.empty(n, kv_heads, dim, dtype=dtype)
    for i, (s, q) in enumerate(zip(starts, lengths, strict=True)):
        rows = slice(meta.last_row[i] - q + 1, meta.last_row[i] + 1)
        k_new[rows], v_new[rows] = full[i][0][s:], full[i][1][s:]
    write_kv(kc, vc, k_new, v_new, meta.slot_mapping)
    return meta, qs, k_new, v_new, kc, vc, (starts, lengths, full), dim


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_grouped_prefills_equal_attending_each_chunk_alone(seed, heads, kv_heads):
    block_size = [1, 4, 16][seed % 3]
    meta, q, k, v, kc, vc, (starts, lengths, full), dim = _step(seed, heads, kv_heads,
                                                                 block_size)
    groups, alone = group_prefills(meta, split_buckets)
    grouped = sum(g.size for g in groups)
    assert grouped + len(alone) == len(meta.prefills)        # every chunk exactly once
    assert all(g.size >= 2 for g in groups)
    assert all(c.start_pos == 0 or sum(1 for d in meta.prefills if d.num_tokens == c.num_tokens
                                       and d.start_pos > 0) >= 1 for c in alone)
    fast = paged_attention(q, k, v, kc, vc, meta, dim ** -0.5)
    ref = paged_attention(q, k, v, kc, vc, meta, dim ** -0.5, batch_prefills=False)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # and the dense causal reference, request by request
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        kk, vv = full[i]
        rows = slice(meta.last_row[i] - n + 1, meta.last_row[i] + 1)
        qq = torch.zeros(s + n, heads, dim)
        qq[s:] = q[rows]
        dense = dense_causal_attention(qq, kk, vv, dim ** -0.5)[s:]
        torch.testing.assert_close(fast[rows], dense, rtol=1e-4, atol=1e-5)


def test_groups_are_formed_when_lengths_repeat():
    """The verification shape (many requests x the same k+1 tokens) is grouped, and the plan is
    computed once per step (cached on the metadata)."""
    chunks = [ChunkSpec([1, 2, 3, 4], 10 + i, list(range(6 * i, 6 * i + 6))) for i in range(8)]
    meta = build_metadata(chunks, 4)
    groups, alone = group_prefills(meta, split_buckets)
    assert not alone and sum(g.size for g in groups) == 8
    g = groups[0]
    assert g.mask.shape == (g.size, 1, 4, g.span) and g.rows.numel() == g.size * 4
    assert group_prefills(meta, split_buckets) is meta.prefill_plan


def test_bfloat16_grouped_prefills_match_the_per_chunk_path():
    meta, q, k, v, kc, vc, _, dim = _step(3, 4, 2, 4, dtype=torch.bfloat16)
    fast = paged_attention(q, k, v, kc, vc, meta, dim ** -0.5)
    ref = paged_attention(q, k, v, kc, vc, meta, dim ** -0.5, batch_prefills=False)
    torch.testing.assert_close(fast, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("path", ["groups", "kernel"])
def test_speculative_engine_verification_paths_match_the_per_chunk_path(monkeypatch, path):
    """End to end with a draft model: verification chunks attended in SDPA groups (CPU kernel
    off), or as rows of the CPU kernel, give the same greedy tokens (and logprobs up to float
    rounding) as every chunk attended alone by SDPA; the path under test really ran."""
    import kvlab.engine.attention as attention
    import kvlab.engine.prefill_groups as prefill_groups
    from kvlab.engine.llm import LLM
    from kvlab.engine.sampler import SamplingParams
    from kvlab.kernels import cpu as cpu_kernels

    if path == "kernel" and not cpu_kernels.available():
        pytest.skip(f"no CPU kernel here: {cpu_kernels.build_error()}")
    used = []
    if path == "groups":
        real_groups = prefill_groups.attend_groups
        monkeypatch.setattr(prefill_groups, "attend_groups",
                            lambda *a: (used.append(len(a[3])), real_groups(*a))[1])
    else:
        real_rows = prefill_groups.kernel_rows
        monkeypatch.setattr(prefill_groups, "kernel_rows",
                            lambda m: (used.append(int(real_rows(m).rows.numel())),
                                       real_rows(m))[1])
    prompts = ["The town of", "Once upon a time, the river", "Question: where does",
               "The town of Harrow is", "In the Vale, the people", "A storm came to"]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    runs = {}
    for tested in (False, True):   # the reference: CPU kernel off, every chunk alone
        monkeypatch.setattr(attention, "BATCH_PREFILLS", tested)
        # runners take the compiled kernel when built, as the environment allows
        monkeypatch.setenv("KVLAB_CPU_ATTENTION", "1" if tested and path == "kernel" else "0")
        used.clear()
        llm = LLM("kvlab-tiny", num_blocks=512, max_num_seqs=8, speculative_config={
            "method": "draft_model", "model": "kvlab-tiny-draft", "num_speculative_tokens": 3})
        runs[tested] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert (sum(used) > 0) == tested       # the path ran only when switched on
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.logprobs, b.logprobs, strict=True):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)
