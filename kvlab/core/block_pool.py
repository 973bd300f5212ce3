"""The block pool: refcounted KV blocks with named owners, copy-on-write and copy fences (the
reference ``BlockAllocator`` of spec rule 3 grown for an engine). Each block records who holds
it (request ids, or :data:`CACHE_OWNER`), so ``refcount == len(owners)`` and a second release is a
no-op. Every method is all-or-nothing; running short raises :class:`OutOfBlocks`, never
``MemoryError``. Chapter 3 explains the design.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol


class OutOfBlocks(Exception):
    """Too few allocatable KV blocks: ``needed``, ``available`` now. Nothing was changed; a
    scheduler catches it to preempt or wait."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class _CacheOwner:
    """The prefix cache as a block owner. A singleton that no request id can be equal to."""

    _instance: _CacheOwner | None = None

    def __new__(cls) -> _CacheOwner:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<prefix-cache>"

    def __reduce__(self):
        return (_CacheOwner, ())


CACHE_OWNER = _CacheOwner()
"""The owner id under which a prefix cache holds its reference on a cached block."""


class Evictor(Protocol):
    """What the pool needs from a cache to reclaim cached blocks (RadixCache): the exact
    count ``evict`` could release now, membership, and ``evict`` (1..num_blocks, LRU; the pool
    then drops :data:`CACHE_OWNER` from each returned block)."""

    def evictable_blocks(self) -> int: ...
    def is_evictable(self, block: int) -> bool: ...
    def evict(self, num_blocks: int) -> list[int]: ...


class BlockPool:
    """``num_blocks`` physical KV blocks (ids ``0 .. num_blocks - 1``) with owner-tracked
    refcounts; owners are hashable ids, each holding a block at most once."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._owners: list[set[Hashable]] = [set() for _ in range(num_blocks)]
        self._refcount: list[int] = [0] * num_blocks
        self._free_heap: list[int] = list(range(num_blocks))  # a heap; lowest id is taken first
        self._free: set[int] = set(range(num_blocks))
        self._fence: Counter[int] = Counter()  # block -> number of pending copies touching it
        self._pending: Counter[tuple[int, int]] = Counter()  # (src, dst) -> multiplicity
        self._evictor: Evictor | None = None

    def set_evictor(self, evictor: Evictor | None) -> None:
        """Attach the cache that can release cached blocks when free ones run out."""
        self._evictor = evictor

    def refcount(self, block: int) -> int:
        """Number of live owners of ``block``."""
        self._check_block(block)
        return self._refcount[block]

    def owners(self, block: int) -> frozenset:
        """The live owners of ``block``."""
        self._check_block(block)
        return frozenset(self._owners[block])

    def is_free(self, block: int) -> bool:
        self._check_block(block)
        return block in self._free

    def is_fenced(self, block: int) -> bool:
        """True while ``block`` is the source or destination of a pending copy."""
        self._check_block(block)
        return self._fence[block] > 0

    def state(self, block: int) -> str:
        """One of ``free, exclusive, shared, cached, pending_copy`` (kvlab.viz.style names)."""
        self._check_block(block)
        if self._fence[block] > 0:
            return "pending_copy"
        owners = self._owners[block]
        if not owners:
            return "free"
        if owners == {CACHE_OWNER}:
            return "cached"
        return "exclusive" if len(owners) == 1 else "shared"

    def fence_count(self, block: int) -> int:
        """How many pending copies touch ``block`` (0: not fenced)."""
        self._check_block(block)
        return self._fence[block]

    def free_blocks(self) -> frozenset[int]:
        """The blocks :meth:`allocate` hands out first (ownerless and unfenced)."""
        return frozenset(self._free)

    def check_free_index(self) -> None:
        """AssertionError unless the allocation heap and the free set hold the same blocks."""
        assert set(self._free_heap) == self._free and len(self._free_heap) == len(self._free), \
            "free heap and free set disagree"

    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out without evicting anything."""
        return len(self._free)

    def num_evictable(self) -> int:
        """Cached blocks the evictor can release *and* that would then become free (not fenced)."""
        if self._evictor is None:
            return 0
        fenced_evictable = sum(1 for b in self._fence if self._evictor.is_evictable(b))
        return self._evictor.evictable_blocks() - fenced_evictable

    def num_allocatable(self) -> int:
        """Free blocks plus evictable cached blocks: the most :meth:`allocate` can return now."""
        return self.num_free() + self.num_evictable()

    def pending_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` copies not yet completed, sorted (with multiplicity)."""
        return sorted(self._pending.elements())

    def blocks_of(self, owner: Hashable) -> list[int]:
        """Every block ``owner`` holds, ascending (O(num_blocks); for checks and tests)."""
        return [b for b in range(self.num_blocks) if owner in self._owners[b]]

    def allocate(self, n: int, owner: Hashable) -> list[int]:
        """Take ``n`` blocks for ``owner``, all or nothing: free ones lowest id first, then
        cached ones the evictor releases (LRU); :class:`OutOfBlocks` when too few."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"number of blocks to allocate must be a non-negative int, got {n!r}")
        self._check_owner(owner)
        if n == 0:
            return []
        if len(self._free) < n:
            available = self.num_allocatable()
            if available < n:
                raise OutOfBlocks(f"KV blocks exhausted: need {n}, free {len(self._free)}, "
                                  f"evictable {self.num_evictable()}", n, available)
            while len(self._free) < n:
                victims = self._evictor.evict(n - len(self._free))  # type: ignore[union-attr]
                if not victims:  # pragma: no cover - guarded by num_allocatable
                    raise RuntimeError("evictor reported evictable blocks but released none")
                for block in victims:
                    if self._owners[block] != {CACHE_OWNER}:  # pragma: no cover - a cache bug
                        raise RuntimeError(f"evictor released block {block}, which is in use "
                                           f"by {sorted(map(repr, self._owners[block]))}")
                    self._drop(block, CACHE_OWNER)
        taken = [heapq.heappop(self._free_heap) for _ in range(n)]
        for block in taken:
            self._free.discard(block)
            self._owners[block].add(owner)
            self._refcount[block] = 1
        return taken

    def share(self, blocks: Sequence[int], owner: Hashable) -> None:
        """Add ``owner`` to every block in ``blocks``; ValueError (unchanged) when one is free,
        already ``owner``'s, or repeated."""
        blocks = self._check_table(blocks)
        self._check_owner(owner)
        for block in blocks:
            if not self._owners[block]:
                raise ValueError(f"cannot share free block {block}")
            if owner in self._owners[block]:
                raise ValueError(f"{owner!r} already holds block {block}")
        for block in blocks:
            self._owners[block].add(owner)
            self._refcount[block] += 1

    def fork(self, blocks: Sequence[int], parent: Hashable, child: Hashable) -> None:
        """Give ``child`` a reference on every block of ``parent``'s table (chapter 3's fork: it
        copies a block only when it writes into it); ValueError unless ``parent`` holds all."""
        blocks = self._check_table(blocks)
        if parent == child:
            raise ValueError("a sequence cannot fork into itself")
        for block in blocks:
            if parent not in self._owners[block]:
                raise ValueError(f"parent {parent!r} does not hold block {block}")
        self.share(blocks, child)

    def release(self, blocks: Iterable[int], owner: Hashable) -> list[int]:
        """Drop ``owner`` from each block it holds (others are skipped: a second release is a
        no-op); returns the blocks that became free (fenced ones stay parked until the copy)."""
        blocks = self._check_table(blocks)
        freed = []
        for block in blocks:
            if owner in self._owners[block] and self._drop(block, owner):
                freed.append(block)
        return freed

    def cow(self, blocks: Sequence[int], owner: Hashable) -> list[tuple[int, int]]:
        """Make each of ``blocks`` exclusive to ``owner`` before it writes, all or nothing: from
        every shared one it moves to a fresh block, and ``(old, new)`` is returned for the
        executor to copy; both stay fenced until :meth:`complete_copies`."""
        blocks = self._check_table(blocks)
        for block in blocks:
            if owner not in self._owners[block]:
                raise ValueError(f"{owner!r} does not hold block {block}; cannot copy-on-write it")
        shared = [b for b in blocks if self._refcount[b] > 1]
        fresh = self.allocate(len(shared), owner)
        copies = []
        for old, new in zip(shared, fresh, strict=True):
            self._owners[old].discard(owner)
            self._refcount[old] -= 1
            self._fence[old] += 1
            self._fence[new] += 1
            self._pending[(old, new)] += 1
            copies.append((old, new))
        return copies

    def complete_copies(self, copies: Iterable[tuple[int, int]]) -> None:
        """Mark payload copies done: lift their fences (parked ownerless blocks become free);
        ValueError (unchanged) if a pair is not pending."""
        copies = [tuple(c) for c in copies]
        wanted = Counter(copies)
        for pair, count in wanted.items():
            if self._pending[pair] < count:
                raise ValueError(f"copy {pair} is not pending")
        for pair in copies:
            self._pending[pair] -= 1
            if self._pending[pair] == 0:
                del self._pending[pair]
            for block in pair:
                self._fence[block] -= 1
                if self._fence[block] == 0:
                    del self._fence[block]
                    if not self._owners[block]:
                        self._make_free(block)

    def _drop(self, block: int, owner: Hashable) -> bool:
        """Remove ``owner`` from ``block``; True if the block became free."""
        self._owners[block].discard(owner)
        self._refcount[block] -= 1
        if self._owners[block] or self._fence[block] > 0:
            return False
        self._make_free(block)
        return True

    def _make_free(self, block: int) -> None:
        self._free.add(block)
        heapq.heappush(self._free_heap, block)

    def _check_block(self, block: int) -> None:
        if not isinstance(block, int) or isinstance(block, bool):
            raise TypeError(f"block id must be an int, got {block!r}")
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is out of range [0, {self.num_blocks})")

    def _check_table(self, blocks: Iterable[int]) -> list[int]:
        blocks = list(blocks)
        for block in blocks:
            self._check_block(block)
        if len(set(blocks)) != len(blocks):
            raise ValueError("one block table cannot contain duplicate blocks")
        return blocks

    @staticmethod
    def _check_owner(owner: Hashable) -> None:
        try:
            hash(owner)
        except TypeError:
            raise TypeError(f"block owner must be hashable, got {owner!r}") from None

    def state_tuple(self) -> tuple:
        """Everything observable about the pool, as comparable plain data (tests, snapshots)."""
        return (tuple(tuple(sorted(map(repr, o))) for o in self._owners), tuple(self._refcount),
                tuple(sorted(self._free)), tuple(sorted(self._fence.items())),
                tuple(self.pending_copies()))
