"""Spec rule 2 — page tables: logical token positions mapped to scattered physical slots.

Position ``t`` lives in logical block ``t // q`` at physical slot ``q · table[t // q] + t % q``.
A page table keeps a sequence logically contiguous while its blocks are scattered; by itself
it provides neither prefix sharing nor eviction. The production page tables (a growing
per-request table, vectorised slot mappings) are in :mod:`kvlab.labs.paging`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["physical_slot"]


def physical_slot(block_table: Sequence[int], block_size: int, token_pos: int) -> int:
    """block_table:[logical blocks] -> one physical token slot (reference listing)."""
    if block_size <= 0 or token_pos < 0:
        raise ValueError("invalid block size or token position")
    logical, offset = divmod(token_pos, block_size)
    if logical >= len(block_table):
        raise IndexError("logical block is not allocated")
    physical = block_table[logical]
    if physical < 0:
        raise ValueError("physical block id must be non-negative")
    return physical * block_size + offset
