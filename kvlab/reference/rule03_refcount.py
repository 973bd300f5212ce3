"""Spec rule 3 — refcounts and copy-on-write: the reference ``BlockAllocator``.

A physical block is free (refcount 0), exclusive (1) or shared (>1). A shared block is copied
before any partial write; the ``(old, new)`` pair that :meth:`BlockAllocator.cow` returns is the
payload copy the executor must perform. Every method validates its whole input before it
mutates anything, so a call that raises leaves the allocator unchanged.
The production block pool is :mod:`kvlab.core.block_pool`.
"""

from __future__ import annotations

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """Reference allocator of ``blocks`` physical KV blocks (spec listing, same behaviour)."""

    def __init__(self, blocks: int):
        if blocks <= 0:
            raise ValueError("allocator needs physical blocks")
        self.refcount = [0] * blocks
        self.free = set(range(blocks))

    def allocate(self) -> int:
        """Take one free block; it becomes exclusive (refcount 1). MemoryError when none."""
        if not self.free:
            raise MemoryError("KV blocks exhausted")
        block = self.free.pop()
        self.refcount[block] = 1
        return block

    def share(self, table):
        """Add one owner to every block of ``table``; returns the table as a new list."""
        table = list(table)
        if len(set(table)) != len(table):
            raise ValueError("one block table cannot contain duplicate blocks")
        if any(block < 0 or block >= len(self.refcount) for block in table):
            raise IndexError("physical block is out of range")
        if any(self.refcount[block] <= 0 for block in table):
            raise ValueError("cannot share a free block")
        for block in table:
            self.refcount[block] += 1
        return table

    def cow(self, table, logical_block):
        """Make ``table[logical_block]`` exclusive before a write.

        Returns ``(table, None)`` when it already is, else ``(new_table, (old, new))``: the
        caller must copy the payload of ``old`` into ``new`` before writing.
        """
        table = list(table)
        if not 0 <= logical_block < len(table):
            raise IndexError("logical block is out of range")
        old = table[logical_block]
        if not 0 <= old < len(self.refcount) or self.refcount[old] <= 0:
            raise ValueError("cannot copy an invalid block")
        if self.refcount[old] == 1:
            return table, None
        new = self.allocate()
        self.refcount[old] -= 1
        table[logical_block] = new
        return table, (old, new)

    def release(self, table) -> None:
        """Drop one owner from every block of ``table``; blocks reaching 0 become free."""
        table = list(table)
        if len(set(table)) != len(table):
            raise ValueError("one block table cannot contain duplicate blocks")
        if any(block < 0 or block >= len(self.refcount) for block in table):
            raise IndexError("physical block is out of range")
        if any(self.refcount[block] <= 0 for block in table):
            raise ValueError("cannot release a free block")
        for block in table:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free.add(block)
