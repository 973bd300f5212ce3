"""One step's attention metadata: the flat batch of token rows laid out as fixed-shape tensors.

A step lays its chunks end to end in the order given; chunk ``s`` of ``q`` tokens at ``start``
attends causally to positions ``0 .. start+q-1`` through its block table. Rows of one token
(decodes), and chunks behind a cached prefix no longer than the backend's
``paged_max_tokens``, are *paged* rows: each attends through its own table; the other chunks
are *dense*, attended whole. Everything here is data (tensors and tuples), built with tensor
operations, as CUDA-graph capture needs. Chapter 7.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain

import numpy as np
import torch

__all__ = ["AttentionMetadata", "ChunkSpec", "build_metadata", "flat_metadata"]


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's flat batch of ``N`` token rows and ``B`` chunks, on the model's device.
    Chunk ``s`` owns rows ``query_start[s] .. query_start[s+1]-1``, starts at position
    ``start_pos[s]`` and reads table ``block_tables[s]`` (padded with block 0). Paged rows
    attend through ``paged_tables``/``paged_lens``; the ``dense`` chunks are attended whole."""

    input_ids: torch.Tensor       # [N] long
    positions: torch.Tensor       # [N] long
    slot_mapping: torch.Tensor    # [N] long, the flat slot each new K/V is written to
    block_tables: torch.Tensor    # [B, W] long
    query_start: tuple[int, ...]  # B + 1 row offsets
    start_pos: tuple[int, ...]    # B
    paged_rows: torch.Tensor      # [R] long
    paged_tables: torch.Tensor    # [R, W'] long, the table of each paged row's chunk
    paged_lens: torch.Tensor      # [R] long, positions + 1
    dense: tuple[int, ...]        # the chunks attended whole

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @cached_property
    def last_row(self) -> tuple[int, ...]:
        """The row of each chunk's last token."""
        return tuple(r - 1 for r in self.query_start[1:])

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata decoder layer ``layer`` reads: this one, every layer reads one table
        (a model with several KV cache groups reads its group's,
        :class:`kvlab.engine.hybrid_input_batch.HybridMetadata`)."""
        return self

    @property
    def max_position(self) -> int:
        return max(p + self.query_start[s + 1] - self.query_start[s] - 1
                   for s, p in enumerate(self.start_pos))


def flat_metadata(token_ids: Sequence[Sequence[int]], start_pos: Sequence[int],
                  block_tables: torch.Tensor, block_size: int,
                  device: torch.device | str = "cpu", paged_max_tokens: int = 0
                  ) -> AttentionMetadata:
    """The metadata of chunks ``token_ids[s]`` at ``start_pos[s]`` with tables
    ``block_tables [B, >= W]`` (CPU, long) that cover them (the callers check that).
    ``paged_max_tokens``: the attention backend's, see the module docstring."""
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
    paged = (lens == 1) | ((starts > 0) & (lens <= paged_max_tokens))
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
        paged_lens=dev(paged_lens), dense=tuple(np.flatnonzero(~paged).tolist()))


@dataclass(frozen=True)
class ChunkSpec:
    """One request's tokens in a step: ``token_ids`` at positions ``start_pos ...``."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


def build_metadata(chunks: Sequence[ChunkSpec], block_size: int,
                   device: torch.device | str = "cpu", paged_max_tokens: int = 0
                   ) -> AttentionMetadata:
    """:func:`flat_metadata` of chunks that carry their own tables: the checked entry point for
    callers without a runner's input batch (speculative decoding's draft model, the
    perplexity lab, kernel parity checks, tests, chapter 7). ValueError when a chunk is empty
    or its table does not cover it."""
    if not chunks:
        raise ValueError("build_metadata: no chunks to run")
    for i, c in enumerate(chunks):
        if len(c.token_ids) == 0:
            raise ValueError(f"build_metadata: chunk {i} has no tokens")
        end = c.start_pos + len(c.token_ids)
        if c.start_pos < 0 or len(c.block_table) * block_size < end:
            raise ValueError(
                f"build_metadata: chunk {i} block table ({len(c.block_table)} blocks of "
                f"{block_size}) does not cover positions {c.start_pos}..{end - 1}")
    width = max(len(c.block_table) for c in chunks)
    tables = torch.tensor([list(c.block_table) + [0] * (width - len(c.block_table))
                           for c in chunks], dtype=torch.long)
    return flat_metadata([c.token_ids for c in chunks], [c.start_pos for c in chunks], tables,
                         block_size, device, paged_max_tokens)
