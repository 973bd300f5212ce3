"""Paged attention over one step's flat batch, and the index tensors it reads. A step lays its
chunks end to end in the order given; chunk ``s`` of ``q`` tokens at ``start`` attends causally
to positions ``0 .. start+q-1`` through its block table. KV per layer:
``[num_blocks, block_size, kv_heads, head_dim]``. Chapter 7.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain

import numpy as np
import torch

from kvlab.kernels import triton
from kvlab.kernels.cpu import CHUNK_OPS

from .torch_attention import attend_chunks, attend_rows

__all__ = ["PAGED_MAX_TOKENS", "AttentionMetadata", "RowKernel", "attend_rows", "flat_metadata",
           "paged_attention", "write_kv"]

#: with a kernel, a chunk behind a cached prefix with at most this many tokens is attended row
#: by row through its table, as decodes are (each row re-reads the context, so long chunks stay
#: with SDPA; the torch path's gather would copy the context once per row, so there they all do)
PAGED_MAX_TOKENS = 16

#: ``op(out, q, k_cache, v_cache, tables, lens, scale)``: row ``r`` of ``q [R, H, D]`` attends
#: the first ``lens[r]`` positions of table ``tables[r]``, written into ``out`` (contiguous)
RowKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      torch.Tensor, float], None]


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's flat batch of ``N`` token rows and ``B`` chunks, as fixed-shape tensors on
    the model's device. Chunk ``s`` owns rows ``query_start[s] .. query_start[s+1]-1``, starts
    at position ``start_pos[s]`` and reads table ``block_tables[s]`` (padded with block 0).
    *Paged* rows (single-token chunks; with a kernel, short chunks behind a prefix too) attend
    through ``paged_tables``/``paged_lens``; the ``dense`` chunks are attended whole (the
    compiled chunk op, all in one call, or one causal SDPA each on the torch path)."""

    input_ids: torch.Tensor       # [N] long
    positions: torch.Tensor       # [N] long
    slot_mapping: torch.Tensor    # [N] long, the flat slot each new K/V is written to
    block_tables: torch.Tensor    # [B, W] long
    query_start: tuple[int, ...]  # B + 1 row offsets
    start_pos: tuple[int, ...]    # B
    paged_rows: torch.Tensor      # [R] long
    paged_tables: torch.Tensor    # [R, W'] long, the table of each paged row's chunk
    paged_lens: torch.Tensor      # [R] long, positions + 1
    dense: tuple[int, ...]        # the chunks attended whole (chunk op or SDPA)
    kernel: RowKernel | None = None   # the op for the paged rows (None: torch, attend_rows)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @cached_property
    def last_row(self) -> tuple[int, ...]:
        """The row of each chunk's last token."""
        return tuple(r - 1 for r in self.query_start[1:])

    @property
    def max_position(self) -> int:
        return max(p + self.query_start[s + 1] - self.query_start[s] - 1
                   for s, p in enumerate(self.start_pos))


def flat_metadata(token_ids: Sequence[Sequence[int]], start_pos: Sequence[int],
                  block_tables: torch.Tensor, block_size: int,
                  device: torch.device | str = "cpu", kernel: RowKernel | None = None
                  ) -> AttentionMetadata:
    """The metadata of chunks ``token_ids[s]`` at ``start_pos[s]`` with tables
    ``block_tables [B, >= W]`` (CPU, long) that cover them (checked by the callers)."""
    # numpy, not torch: torch's CPU repeat_interleave runs a parallel region even for a few
    # rows, which cost milliseconds per step with many threads on a GPU host
    lens = np.array([len(t) for t in token_ids], dtype=np.int64)
    starts = np.array(start_pos, dtype=np.int64)
    query_start = tuple(accumulate(lens.tolist(), initial=0))
    end = int((starts + lens).max())
    tables = block_tables[:, :-(-end // block_size)]
    seq = np.repeat(np.arange(len(lens)), lens)                              # row -> chunk
    positions = np.arange(query_start[-1]) - np.array(query_start[:-1])[seq] + starts[seq]
    slots = tables.numpy()[seq, positions // block_size] * block_size + positions % block_size
    paged = (lens == 1) | ((kernel is not None) & (starts > 0) & (lens <= PAGED_MAX_TOKENS))
    rows = np.flatnonzero(paged[seq])
    paged_lens = positions[rows] + 1
    width = -(-int(paged_lens.max()) // block_size) if rows.size else 0

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return AttentionMetadata(
        input_ids=torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long,
                               device=device),
        positions=dev(positions), slot_mapping=dev(slots), block_tables=tables.to(device),
        query_start=query_start, start_pos=tuple(start_pos), paged_rows=dev(rows),
        paged_tables=tables[:, :width][torch.from_numpy(seq[rows])].to(device),
        paged_lens=dev(paged_lens), dense=tuple(np.flatnonzero(~paged).tolist()),
        kernel=kernel)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new ``k, v: [N, kv_heads, D]`` at flat slots ``slot_mapping: [N]`` (in place)."""
    if k_cache.is_cuda and triton.available():
        triton.store_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    kv_heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
                    ) -> torch.Tensor:
    """Attention of the flat batch; ``q: [N, H, D]``, new ``k, v: [N, KV, D]`` -> ``[N, H, D]``.
    :func:`write_kv` must have run first. Two branches: the paged rows (``meta.kernel`` or
    :func:`attend_rows`), then the dense chunks: one call of the compiled chunk op that came
    with ``meta.kernel`` (:data:`kvlab.kernels.cpu.CHUNK_OPS`), else one SDPA each
    (:func:`~kvlab.engine.torch_attention.attend_chunks`)."""
    num, _, dim = q.shape
    out = torch.empty_like(q)
    every = meta.paged_rows.numel() == num
    if meta.paged_rows.numel():
        qr = q.contiguous() if every else q.index_select(0, meta.paged_rows)
        if meta.kernel is not None:
            assert q.dtype == k_cache.dtype == v_cache.dtype, "one dtype"
            o = out if every else torch.empty_like(qr)
            meta.kernel(o, qr, k_cache, v_cache, meta.paged_tables, meta.paged_lens,
                        float(scale))
        else:
            o = attend_rows(qr, k_cache, v_cache, meta.paged_tables, meta.paged_lens, scale)
        if every:
            out = o
        else:
            out.index_copy_(0, meta.paged_rows, o)
    chunk_op = CHUNK_OPS.get(meta.kernel) if meta.dense and dim % 4 == 0 else None
    if chunk_op is not None:   # every dense chunk in one call, read through the tables
        chunk_op(out, q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.start_pos,
                 meta.dense, float(scale))
    elif meta.dense:
        attend_chunks(out, q, k, v, k_cache, v_cache, meta, scale)
    return out
