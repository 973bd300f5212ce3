"""Paged attention over mixed flat batches equals the dense causal reference."""

from __future__ import annotations

import pytest
import torch
from dense_attention import dense_causal_attention

from kvlab.engine.attention_cpu import CpuAttention
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.attention_torch import TorchAttention
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.labs.parity.triton import scattered_tables

HEADS, KV_HEADS, DIM = 4, 2, 8


def _run_schedule(block_size: int, lengths: list[int], seed: int, max_chunk: int = 6,
                  backend=None) -> tuple[float, set[str]]:
    """Feed sequences through random chunk schedules; return max |paged - dense| and the
    kinds of chunk that ran (decode, short or long behind a prefix, fresh)."""
    backend = backend or TorchAttention()
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for t in lengths:
        q = torch.randn(t, HEADS, DIM, generator=gen)
        k = torch.randn(t, KV_HEADS, DIM, generator=gen)
        v = torch.randn(t, KV_HEADS, DIM, generator=gen)
        seqs.append((q, k, v, dense_causal_attention(q, k, v, DIM ** -0.5)))
    tables, num_blocks = scattered_tables(lengths, block_size, 3, gen)
    cache = PagedKVCache(1, num_blocks, block_size, KV_HEADS, DIM)
    done = [0] * len(lengths)
    worst, kinds = 0.0, set()
    while any(d < t for d, t in zip(done, lengths, strict=True)):
        chunks, order = [], []
        for i, t in enumerate(lengths):
            if done[i] >= t:
                continue
            # single tokens (decode-like) and multi-token chunks, randomly mixed
            size = int(torch.randint(1, max_chunk + 1, (), generator=gen))
            size = min(size, t - done[i])
            chunks.append(ChunkSpec(list(range(size)), done[i], tables[i]))
            order.append((i, done[i], size))
            kinds.add("decode" if size == 1 else "fresh" if done[i] == 0 else
                      "short" if size <= CpuAttention.paged_max_tokens else "long")
        meta = build_metadata(chunks, block_size, paged_max_tokens=backend.paged_max_tokens)
        # flat q/k/v in the metadata's row order (chunk after chunk)
        rows_q, rows_k, rows_v = [None] * meta.num_tokens, [None] * meta.num_tokens, [None] * (
            meta.num_tokens)
        for c_idx, (i, start, size) in enumerate(order):
            last = meta.last_row[c_idx]
            for j in range(size):
                r = last - (size - 1) + j
                rows_q[r] = seqs[i][0][start + j]
                rows_k[r] = seqs[i][1][start + j]
                rows_v[r] = seqs[i][2][start + j]
        q, k, v = torch.stack(rows_q), torch.stack(rows_k), torch.stack(rows_v)
        out = backend.forward(q, k, v, cache.layers[0], meta, DIM ** -0.5)
        for c_idx, (i, start, size) in enumerate(order):
            last = meta.last_row[c_idx]
            got = out[last - size + 1:last + 1]
            want = seqs[i][3][start:start + size]
            worst = max(worst, (got - want).abs().max().item())
            done[i] += size
    return worst, kinds


@pytest.mark.parametrize("kind", ["torch", "cpu"])
@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_paged_equals_dense_mixed_batches(block_size, kind):
    """Both branches (paged rows, dense chunks) and both backends, on schedules that mix
    decodes, fresh prompts, and short and long chunks behind a cached prefix."""
    backend = TorchAttention()
    if kind == "cpu":
        backend = CpuAttention.create(torch.float32)
        if backend is None:
            pytest.skip("the CPU kernel is not built here")
    seen = set()
    for max_chunk, lengths in ((6, [5, 17, 1, 33, 8, 16]), (40, [70, 3, 45, 90])):
        worst, kinds = _run_schedule(block_size, lengths, block_size, max_chunk, backend)
        assert worst < 1e-5
        seen |= kinds
    assert seen == {"decode", "fresh", "short", "long"}


def test_whole_prefill_matches_reference_without_cache_reads():
    # one chunk from position 0 takes the fresh-K/V path; compare with the reference directly
    assert _run_schedule(4, [1], seed=3)[0] < 1e-6
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(11, HEADS, DIM, generator=gen)
    k = torch.randn(11, KV_HEADS, DIM, generator=gen)
    v = torch.randn(11, KV_HEADS, DIM, generator=gen)
    cache = PagedKVCache(1, 4, 4, KV_HEADS, DIM)
    meta = build_metadata([ChunkSpec(list(range(11)), 0, [2, 0, 3])], 4)
    out = TorchAttention().forward(q, k, v, cache.layers[0], meta, DIM ** -0.5)
    assert torch.allclose(out, dense_causal_attention(q, k, v, DIM ** -0.5), atol=1e-5)
    # the K written at position p sits at slot table[p // 4] * 4 + p % 4
    assert torch.equal(cache.layers[0][0][3, 2], k[10])


def test_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match="does not cover positions"):
        build_metadata([ChunkSpec([1, 2, 3], 14, [0, 1])], 8)
    with pytest.raises(ValueError, match="no tokens"):
        build_metadata([ChunkSpec([], 0, [0])], 8)


def test_copy_blocks_copies_all_layers_and_asserts_the_pools_guarantees():
    cache = PagedKVCache(2, 4, 2, 1, 2)
    cache.data.normal_()
    before = cache.data.clone()
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.data[:, :, 3], before[:, :, 1])
    assert torch.equal(cache.data[:, :, :3], before[:, :, :3])
    snapshot = cache.data.clone()
    # the block pool never hands out an id past the cache or one destination twice
    with pytest.raises(AssertionError, match="outside"):
        cache.copy_blocks([(0, 1), (2, 9)])
    with pytest.raises(AssertionError, match="repeats"):
        cache.copy_blocks([(0, 1), (2, 1)])
    assert torch.equal(cache.data, snapshot)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 1), (8, 2), (6, 3)])
def test_grouped_decode_equals_dense_for_every_grouping(heads, kv_heads):
    """MHA (group 1), MQA (one KV head) and GQA: each decode row (the torch path) equals the
    dense causal reference's last row over its own context."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    bs, dim, lengths = 4, 8, [1, 3, 4, 9, 17, 12, 5, 8, 2]
    cache = PagedKVCache(1, 64, bs, kv_heads, dim)
    kc, vc = cache.layers[0]
    perm = torch.randperm(64, generator=gen).tolist()
    chunks, seqs, at = [], [], 0
    for t in lengths:
        q = torch.randn(t, heads, dim, generator=gen)
        k = torch.randn(t, kv_heads, dim, generator=gen)
        v = torch.randn(t, kv_heads, dim, generator=gen)
        table = perm[at:at + -(-t // bs)]
        at += len(table)
        slots = [table[p // bs] * bs + p % bs for p in range(t)]
        kc.view(-1, kv_heads, dim)[slots] = k
        vc.view(-1, kv_heads, dim)[slots] = v
        chunks.append(ChunkSpec([0], t - 1, table))
        seqs.append((q, k, v))
    meta = build_metadata(chunks, bs)
    assert meta.paged_rows.tolist() == list(range(len(lengths))) and meta.dense == ()
    q_rows = torch.empty(len(lengths), heads, dim)
    for i, (q, _, _) in enumerate(seqs):
        q_rows[meta.last_row[i]] = q[-1]
    k_new = torch.empty(len(lengths), kv_heads, dim)
    out = TorchAttention().attend(q_rows, k_new, k_new, kc, vc, meta, dim ** -0.5)
    for i, (q, k, v) in enumerate(seqs):
        want = dense_causal_attention(q, k, v, dim ** -0.5)[-1]
        torch.testing.assert_close(out[meta.last_row[i]], want, rtol=0, atol=2e-6)
