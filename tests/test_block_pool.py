"""BlockPool: owner-tracked refcounts, copy-on-write, fences, all-or-nothing errors."""

from __future__ import annotations

import pytest

from kvlab.core.block_pool import CACHE_OWNER, BlockPool, OutOfBlocks
from kvlab.labs.invariants.structural import check_pool


def unchanged(pool: BlockPool, fn, exc):
    before = pool.state_tuple()
    with pytest.raises(exc):
        fn()
    assert pool.state_tuple() == before
    check_pool(pool)


def test_allocate_lowest_first_and_states():
    pool = BlockPool(4)
    assert pool.allocate(2, "a") == [0, 1]
    assert [pool.state(b) for b in range(4)] == ["exclusive", "exclusive", "free", "free"]
    pool.share([0], "b")
    assert pool.state(0) == "shared" and pool.refcount(0) == 2
    assert pool.owners(0) == {"a", "b"}
    check_pool(pool)


def test_allocate_all_or_nothing():
    pool = BlockPool(3)
    pool.allocate(2, "a")
    unchanged(pool, lambda: pool.allocate(2, "b"), OutOfBlocks)
    unchanged(pool, lambda: pool.allocate(-1, "b"), ValueError)
    assert pool.allocate(0, "b") == []


def test_release_is_idempotent_per_owner():
    pool = BlockPool(3)
    blocks = pool.allocate(2, "a")
    pool.share(blocks, "b")
    assert pool.release(blocks, "a") == []
    # a second release by the same owner must not take b's reference
    assert pool.release(blocks, "a") == []
    assert [pool.refcount(b) for b in blocks] == [1, 1]
    assert sorted(pool.release(blocks, "b")) == blocks
    assert pool.num_free() == 3
    check_pool(pool)


def test_share_errors_leave_pool_unchanged():
    pool = BlockPool(3)
    live = pool.allocate(1, "a")[0]
    unchanged(pool, lambda: pool.share([live, 2], "b"), ValueError)  # 2 is free
    unchanged(pool, lambda: pool.share([live], "a"), ValueError)  # already holds it
    unchanged(pool, lambda: pool.share([live, live], "b"), ValueError)
    unchanged(pool, lambda: pool.share([7], "b"), IndexError)
    unchanged(pool, lambda: pool.release([live, 9], "a"), IndexError)
    unchanged(pool, lambda: pool.share([live], ["unhashable"]), TypeError)


def test_fork_shares_everything():
    pool = BlockPool(4)
    table = pool.allocate(2, "p")
    for child in ("c1", "c2"):
        pool.fork(table, "p", child)
    assert [pool.refcount(b) for b in table] == [3, 3]
    unchanged(pool, lambda: pool.fork(table, "p", "c1"), ValueError)  # c1 holds them already
    unchanged(pool, lambda: pool.fork(table, "x", "c3"), ValueError)  # x is not the parent
    unchanged(pool, lambda: pool.fork(table, "p", "p"), ValueError)


def test_cow_moves_writer_and_fences_both_blocks():
    pool = BlockPool(4)
    parent = pool.allocate(2, "p")
    pool.fork(parent, "p", "c")
    copies = pool.cow([parent[1]], "c")
    assert copies == [(parent[1], 2)]
    assert pool.owners(parent[1]) == {"p"} and pool.owners(2) == {"c"}
    assert pool.state(parent[1]) == "pending_copy" and pool.state(2) == "pending_copy"
    assert pool.pending_copies() == [(1, 2)]
    check_pool(pool)
    # exclusive blocks are not copied
    assert pool.cow([parent[0]], "p") == [(0, 3)]  # still shared with c
    assert pool.cow([3], "p") == []
    pool.complete_copies([(1, 2), (0, 3)])
    assert pool.pending_copies() == [] and pool.state(2) == "exclusive"
    check_pool(pool)


def test_cow_errors_and_out_of_memory_unchanged():
    pool = BlockPool(2)
    table = pool.allocate(2, "p")
    pool.fork(table, "p", "c")
    unchanged(pool, lambda: pool.cow(table, "c"), OutOfBlocks)
    unchanged(pool, lambda: pool.cow(table, "stranger"), ValueError)
    unchanged(pool, lambda: pool.complete_copies([(0, 1)]), ValueError)


def test_fenced_block_is_parked_not_freed():
    pool = BlockPool(3)
    table = pool.allocate(1, "p")
    pool.fork(table, "p", "c")
    [(old, new)] = pool.cow(table, "c")
    # both owners go away while the copy is in flight
    assert pool.release([old], "p") == []
    assert pool.release([new], "c") == []
    assert not pool.is_free(old) and not pool.is_free(new)
    assert pool.num_free() == 1
    # the parked blocks cannot be handed out
    assert pool.allocate(1, "x") == [2]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1, "y")
    check_pool(pool)
    pool.complete_copies([(old, new)])
    assert pool.is_free(old) and pool.is_free(new)
    check_pool(pool)


def test_complete_copies_counts_multiplicity():
    pool = BlockPool(4)
    table = pool.allocate(1, "p")
    pool.fork(table, "p", "c1")
    pool.fork(table, "p", "c2")
    a = pool.cow(table, "c1")
    b = pool.cow(table, "c2")
    assert pool.pending_copies() == sorted(a + b)
    unchanged(pool, lambda: pool.complete_copies(a + a), ValueError)
    pool.complete_copies(a)
    assert pool.is_fenced(table[0])  # still the source of c2's copy
    pool.complete_copies(b)
    assert not pool.is_fenced(table[0])
    check_pool(pool)


class ListEvictor:
    """A tiny LRU evictor over blocks the cache owns, for testing the pool on its own."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.lru: list[int] = []

    def add(self, block: int) -> None:
        self.pool.share([block], CACHE_OWNER)
        self.lru.append(block)

    def _candidates(self):
        return [b for b in self.lru if self.pool.owners(b) == {CACHE_OWNER}]

    def evictable_blocks(self) -> int:
        return len(self._candidates())

    def is_evictable(self, block: int) -> bool:
        return block in self._candidates()

    def evict(self, n: int) -> list[int]:
        victims = self._candidates()[:n]
        self.lru = [b for b in self.lru if b not in victims]
        return victims


def test_allocation_prefers_free_then_evicts_lru_cached():
    pool = BlockPool(4)
    ev = ListEvictor(pool)
    pool.set_evictor(ev)
    a = pool.allocate(3, "a")
    for b in a:
        ev.add(b)
    pool.release(a, "a")
    assert [pool.state(b) for b in range(4)] == ["cached", "cached", "cached", "free"]
    assert pool.num_allocatable() == 4
    assert pool.allocate(1, "b") == [3]  # the truly free block first
    assert pool.allocate(2, "c") == [0, 1]  # then the least recently cached ones
    assert pool.state(2) == "cached"
    unchanged(pool, lambda: pool.allocate(2, "d"), OutOfBlocks)
    check_pool(pool)


def test_state_tuple_sees_every_change():
    pool = BlockPool(2)
    s0 = pool.state_tuple()
    pool.allocate(1, "a")
    assert pool.state_tuple() != s0


def test_bad_construction():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(TypeError):
        BlockPool(2).refcount("0")


@pytest.mark.parametrize("num_blocks", [0, -1, True, False, 2.0, "4"])
def test_num_blocks_must_be_a_positive_int_not_a_bool(num_blocks):
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        BlockPool(num_blocks)


@pytest.mark.parametrize("n", [True, False, -1, 1.0])
def test_allocate_rejects_bools_and_non_ints_unchanged(n):
    pool = BlockPool(4)
    pool.allocate(1, "a")
    unchanged(pool, lambda: pool.allocate(n, "b"), ValueError)
