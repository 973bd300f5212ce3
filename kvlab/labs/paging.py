"""Page tables (production side of spec rule 2): growing per-request tables, vectorised slots.

Position ``t`` lives in logical block ``t // q`` at physical slot ``q · table[t // q] + t % q``,
as the reference :func:`~kvlab.reference.rule02_paging.physical_slot` states one position at a
time. A page table keeps a sequence logically contiguous while its blocks are scattered; by
itself it provides neither prefix sharing nor eviction.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np

from kvlab.core.block_pool import OutOfBlocks

# ---------------------------------------------------------------------------------------------
# Production page tables: a growing per-request table and vectorised slot mappings.
# ---------------------------------------------------------------------------------------------


def token_slots(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Physical slots of positions ``[start, end)``: :func:`physical_slot` without its checks.

    The one place the engine computes slots (the KV manager, the attention metadata, snapshots);
    callers guarantee that the table covers ``end`` positions.
    """
    return [block_table[t // block_size] * block_size + t % block_size
            for t in range(start, end)]


class Allocator(Protocol):
    """What a :class:`BlockTable` needs from a block pool (the reference ``BlockAllocator``):
    its ``free`` blocks, ``allocate()`` and ``release(table)``."""

    free: Collection[int]

    def allocate(self) -> int: ...

    def release(self, table: Sequence[int]) -> None: ...


def _as_positions(positions) -> np.ndarray:
    pos = np.asarray(positions)
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(f"token positions must be integers, got dtype {pos.dtype}")
    return pos.astype(np.int64, copy=False).reshape(-1)


def slots_for(block_table: Sequence[int], block_size: int, positions) -> np.ndarray:
    """Vectorised :func:`physical_slot`: one physical slot per position, same rules.

    ``positions`` is any integer array-like (flattened); returns an ``int64`` array of the same
    length with ``slot[i] == physical_slot(block_table, block_size, positions[i])``. Raises the
    exception the reference raises for the first offending position kind: ValueError for a
    non-positive block size or a negative position, IndexError for a position past the
    allocated blocks, ValueError for a negative physical block it touches.
    """
    if not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError("invalid block size or token position")
    pos = _as_positions(positions)
    if pos.size == 0:
        return np.zeros(0, dtype=np.int64)
    if pos.min() < 0:
        raise ValueError("invalid block size or token position")
    table = np.asarray(block_table, dtype=np.int64).reshape(-1)
    logical, offset = np.divmod(pos, block_size)
    if logical.max() >= table.size:
        raise IndexError("logical block is not allocated")
    physical = table[logical]
    if physical.min() < 0:
        raise ValueError("physical block id must be non-negative")
    return physical * block_size + offset


def block_table_array(block_tables: Sequence[Sequence[int]], pad: int = -1) -> np.ndarray:
    """Pack per-request block tables into one ``[requests, max_blocks]`` int64 array.

    Shorter tables are right-padded with ``pad`` (-1: never a valid block). This is the
    layout an attention kernel reads: row ``r`` is request ``r``'s page table.
    """
    width = max((len(t) for t in block_tables), default=0)
    out = np.full((len(block_tables), width), pad, dtype=np.int64)
    for row, table in enumerate(block_tables):
        out[row, : len(table)] = np.asarray(table, dtype=np.int64).reshape(-1)
    return out


def slot_mapping(block_tables: Sequence[Sequence[int]], block_size: int,
                 positions: Sequence) -> np.ndarray:
    """Slots for a whole batch: the flattened ``slot_mapping`` a paged-attention step writes.

    ``positions[r]`` holds the token positions of request ``r`` scheduled this step (a whole
    prompt chunk for a prefill, one position for a decode). Returns one ``int64`` array: the
    slots of request 0's positions, then request 1's, ... so entry ``i`` tells the kernel where
    to store the K/V of the ``i``-th token of the flattened batch. Agrees element-wise with
    :func:`physical_slot`; computed with one gather over :func:`block_table_array`.

    Raises ValueError when the two lists differ in length (or on invalid block size /
    negative positions / negative blocks), IndexError for a position past its table.
    """
    if len(block_tables) != len(positions):
        raise ValueError(f"{len(block_tables)} block tables but {len(positions)} position lists")
    if not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError("invalid block size or token position")
    per_request = [_as_positions(p) for p in positions]
    counts = np.array([p.size for p in per_request], dtype=np.int64)
    if counts.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    flat = np.concatenate(per_request)
    if flat.min() < 0:
        raise ValueError("invalid block size or token position")
    rows = np.repeat(np.arange(len(per_request)), counts)
    lengths = np.array([len(t) for t in block_tables], dtype=np.int64)
    logical, offset = np.divmod(flat, block_size)
    if np.any(logical >= lengths[rows]):
        raise IndexError("logical block is not allocated")
    physical = block_table_array(block_tables)[rows, logical]
    if physical.min() < 0:
        raise ValueError("physical block id must be non-negative")
    return physical * block_size + offset


class BlockTable:
    """The page table of one request: grows a block at a time as tokens are appended.

    Invariant: ``len(blocks) == ceil(num_tokens / block_size)``: a block is taken from the
    allocator exactly when a token crosses a block boundary, so at most ``block_size - 1``
    slots (the tail of the last block) are allocated but unwritten. Blocks are physical ids
    owned by this table until :meth:`release`.

    ``allocator`` is anything with a ``free`` collection, ``allocate() -> int`` and
    ``release(table)``, e.g. :class:`kvlab.reference.BlockAllocator`.
    """

    def __init__(self, block_size: int, allocator: Allocator):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.allocator = allocator
        self.blocks: list[int] = []
        self.num_tokens = 0

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"BlockTable(block_size={self.block_size}, tokens={self.num_tokens}, "
                f"blocks={self.blocks})")

    @property
    def capacity(self) -> int:
        """Token slots the allocated blocks provide: ``len(blocks) · block_size``."""
        return len(self.blocks) * self.block_size

    @property
    def tail_slots(self) -> int:
        """Allocated but unwritten slots in the last block (internal fragmentation)."""
        return self.capacity - self.num_tokens

    def blocks_needed(self, new_tokens: int) -> int:
        """Blocks :meth:`append_tokens` would take from the allocator for ``new_tokens``."""
        if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 0:
            raise ValueError(f"new_tokens must be a non-negative int, got {new_tokens!r}")
        total = -(-(self.num_tokens + new_tokens) // self.block_size)
        return max(0, total - len(self.blocks))

    def append_tokens(self, new_tokens: int) -> np.ndarray:
        """Append ``new_tokens`` tokens; return the ``int64`` slots where their K/V go.

        Allocates the blocks the new tokens need. All or nothing: when the allocator has too few
        free blocks, :class:`~kvlab.core.block_pool.OutOfBlocks` is raised before anything is
        taken, and the table and the allocator are left exactly as they were.
        """
        start = self.num_tokens
        self.grow(new_tokens)
        return self.slots(np.arange(start, self.num_tokens))

    def grow(self, new_tokens: int) -> None:
        """:meth:`append_tokens` without computing slots (for bookkeeping-only callers)."""
        needed = self.blocks_needed(new_tokens)
        available = len(self.allocator.free)
        if needed > available:
            raise OutOfBlocks(f"KV blocks exhausted: {new_tokens} more tokens need {needed} "
                              f"blocks, {available} free", needed, available)
        self.blocks.extend(self.allocator.allocate() for _ in range(needed))
        self.num_tokens += new_tokens

    def slots(self, positions) -> np.ndarray:
        """Physical slots of already-appended positions (vectorised :func:`physical_slot`).

        IndexError for a position ``>= num_tokens``: its K/V has no owner yet.
        """
        pos = _as_positions(positions)
        if pos.size and pos.max() >= self.num_tokens:
            raise IndexError(f"position {int(pos.max())} not appended (table holds "
                             f"{self.num_tokens} tokens)")
        return slots_for(self.blocks, self.block_size, pos)

    def release(self) -> list[int]:
        """Give every block back to the allocator; the table becomes empty. Returns the blocks."""
        blocks = list(self.blocks)
        if blocks:
            self.allocator.release(blocks)
        self.blocks = []
        self.num_tokens = 0
        return blocks
