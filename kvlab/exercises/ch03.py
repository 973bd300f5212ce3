"""Chapter 3 exercises: write ``cow``, count the blocks parallel sampling needs, release twice.

Each check computes the truth with :mod:`kvlab.core` (the reference ``BlockAllocator`` or a real
``KVCacheManager``) and raises ``AssertionError`` with a hint when the answer differs.
"""

from __future__ import annotations

import random

from kvlab.core.kv_manager import KVCacheManager
from kvlab.reference import BlockAllocator

from ._common import require_answer

#: Parallel sampling of :func:`check_sampling_blocks`.
SAMPLING = {"n": 4, "prompt_tokens": 1000, "output_tokens": 200, "block_size": 16}


def _state(alloc: BlockAllocator) -> tuple:
    return (tuple(alloc.refcount), tuple(sorted(alloc.free)))


def _run(fn, alloc: BlockAllocator, table, logical):
    try:
        return ("ok", fn(alloc, list(table), logical))
    except (MemoryError, ValueError, IndexError) as exc:
        return ("raises", type(exc).__name__)


def check_cow(fn) -> str:
    """Compare the reader's ``fn(allocator, table, logical_block)`` with ``BlockAllocator.cow``.

    Random scenarios on twin allocators: the same result (``(table, None)`` or
    ``(new_table, (old, new))``), the same exception type for bad input or exhausted memory, and
    the same refcounts and free set afterwards (so a failed call must change nothing).
    """
    require_answer(fn, "your cow function")
    if not callable(fn):
        raise AssertionError("pass a function taking (allocator, table, logical_block)")
    rng = random.Random(3)
    cases = 0
    for trial in range(200):
        size = rng.randint(1, 6)
        ours, theirs = BlockAllocator(size), BlockAllocator(size)
        ours.free, theirs.free = set(range(size)), set(range(size))
        tables = []
        for _ in range(rng.randint(1, size)):
            if ours.free and rng.random() < 0.7:
                block = min(ours.free)
                ours.free.discard(block)
                theirs.free.discard(block)
                ours.refcount[block] = theirs.refcount[block] = 1
                tables.append([block])
            elif tables:
                t = rng.choice(tables)
                ours.share(t)
                theirs.share(t)
                tables.append(list(t))
        if not tables:
            continue
        table = rng.choice(tables)
        logical = rng.choice([0, 0, 0, 1, -1])
        want = _run(BlockAllocator.cow, theirs, table, logical)
        try:
            got = _run(fn, ours, table, logical)
        except Exception as exc:  # any other failure is reported to the reader
            got = ("raises", type(exc).__name__)
        cases += 1
        if got[0] == "ok" and want[0] == "ok":
            g_table, g_copy = got[1]
            w_table, w_copy = want[1]
            if (list(g_table), g_copy) != (list(w_table), w_copy):
                raise AssertionError(
                    f"trial {trial}: cow({table}, {logical}) returned {got[1]!r}, expected "
                    f"{want[1]!r}. Exclusive blocks are returned as they are; a shared block "
                    "gets a new block and the pair (old, new).")
        elif got[:1] != want[:1] or got != want:
            raise AssertionError(f"trial {trial}: cow({table}, {logical}): expected "
                                 f"{want[1]!r}, got {got[1]!r}")
        if _state(ours) != _state(theirs):
            raise AssertionError(
                f"trial {trial}: after cow({table}, {logical}) refcounts/free set differ: "
                f"{_state(ours)} vs {_state(theirs)}. Validate and allocate before you "
                "decrement the old block's refcount.")
    return f"Correct on {cases} random scenarios, exhausted memory and bad indices included."


def sampling_blocks(n: int, prompt_tokens: int, output_tokens: int, block_size: int) -> tuple:
    """Blocks held at the end of generation with forked sharing, and without sharing.

    Runs a real KVCacheManager: admit the prompt, fork ``n - 1`` children, decode every sequence
    token by token (copy-on-write on the shared partial block), and count distinct blocks held.
    """
    total = prompt_tokens + output_tokens
    kv = KVCacheManager(n * (-(-total // block_size)) + 8, block_size,
                        enable_prefix_caching=False)
    kv.admit("s0", (), list(range(prompt_tokens)), prompt_tokens)
    seqs = ["s0"] + [f"s{i}" for i in range(1, n)]
    for child in seqs[1:]:
        kv.fork("s0", child)
    for length in range(prompt_tokens, total):
        copies = []
        for rid in seqs:
            copies += kv.grow(rid, length + 1, length)
        kv.complete_copies(copies)
    shared = len({b for rid in seqs for b in kv.block_table(rid)})
    return shared, n * (-(-total // block_size))


def check_sampling_blocks(with_sharing, without_sharing) -> str:
    """Blocks needed by :data:`SAMPLING` (n sequences from one prompt) with and without forks."""
    require_answer(with_sharing, "blocks with sharing")
    require_answer(without_sharing, "blocks without sharing")
    truth = sampling_blocks(**SAMPLING)
    if (with_sharing, without_sharing) != truth:
        raise AssertionError(
            f"({with_sharing}, {without_sharing}) is not right. Without sharing every sequence "
            "holds ceil((prompt + output) / q) blocks. With sharing the full prompt blocks are "
            "held once; the partial last prompt block is copied by every sequence that writes "
            "into it except the last owner.")
    return (f"Correct: {truth[0]} blocks instead of {truth[1]} "
            f"({100 * (1 - truth[0] / truth[1]):.0f}% less KV memory).")


def check_double_release(answer) -> str:
    """What a second ``BlockPool.release(table, owner)`` by the same owner does.

    Answer with a letter: (a) raises ValueError, (b) decrements the refcounts again,
    (c) is a no-op and returns ``[]``, (d) frees the blocks.
    """
    require_answer(answer, "your letter")
    from kvlab.core.block_pool import BlockPool

    pool = BlockPool(2)
    table = pool.allocate(1, "a")
    pool.share(table, "b")
    pool.release(table, "a")
    before = pool.state_tuple()
    second = pool.release(table, "a")
    truth = "c" if second == [] and pool.state_tuple() == before else "?"
    if str(answer).strip().lower() != truth:
        raise AssertionError(
            f"{answer!r} is not right. The pool tracks owners, not only counts: owner 'a' no "
            "longer holds the block, so there is nothing of a's to drop, and b's reference "
            "must survive.")
    return ("Correct: releasing is idempotent per owner. A plain counter cannot tell a second "
            "release from another owner's, which is how double frees corrupt shared blocks.")
