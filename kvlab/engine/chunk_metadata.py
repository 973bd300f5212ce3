"""Attention metadata for chunks that carry their own block tables (:class:`ChunkSpec`): the
checked entry point of :func:`~kvlab.engine.attention.flat_metadata` for callers without a
runner's :class:`~kvlab.engine.model_runner.InputBatch` (speculative decoding's verifier and
draft model, the quantization evaluator, kernels' parity checks, tests and chapter 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata, RowKernel, flat_metadata

__all__ = ["ChunkSpec", "build_metadata"]


@dataclass(frozen=True)
class ChunkSpec:
    """One request's tokens in a step: ``token_ids`` at positions ``start_pos ...``."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


def build_metadata(chunks: Sequence[ChunkSpec], block_size: int,
                   device: torch.device | str = "cpu", kernel: RowKernel | None = None
                   ) -> AttentionMetadata:
    """:func:`flat_metadata` of ``chunks`` with their own tables; ValueError when a chunk is
    empty or its table does not cover it."""
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
                         block_size, device, kernel)
