"""KVCacheManager: per-request block tables over a refcounted pool and a radix prefix cache, the
object the scheduler allocates from. The prefix cache is an owner like any other, so
copy-on-write protects cached KV with no special case. Every mutation is all-or-nothing (on
OutOfBlocks, ValueError or KeyError nothing changed). Chapters 3 and 4.

One request's table (block size 4), as :meth:`~KVCacheManager.admit` builds it and
:meth:`~KVCacheManager.grow` extends it::

    admit: prompt p0..p9 with a prefix-cache hit of two full blocks (8 tokens)

      slots   | p0 p1 p2 p3 | p4 p5 p6 p7 | p8 p9 -- -- |
      table   |     17      |      3      |     42      |
              |<-- hit: shared with the ->|<-- fresh -->|
                   tree, locked while held     its own
      num_computed_tokens = 8: the step computes p8 and p9 only

    grow: one slot per decode step; o2 takes a new block

      slots   | p0 p1 p2 p3 | p4 p5 p6 p7 | p8 p9 o0 o1 | o2 -- -- -- |
      table   |     17      |      3      |     42      |      8      |
      committed to the cache once full and written: 17, 3, then 42

The hit is reused, not recomputed (the scheduler starts the request at the first token past
it); fresh blocks come from the free list, or from evicting unlocked cached blocks. A request
only ever writes into blocks it holds alone: a shared block in the range it writes is copied
first (:meth:`~KVCacheManager.grow` returns the copies, fenced until the executor made them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.core.block_pool import CACHE_OWNER, BlockPool, OutOfBlocks
from kvlab.core.cache_scope import CacheScope
from kvlab.core.radix_cache import InsertResult, PrefixMatch, RadixCache, RadixNode, scope_key


@dataclass(frozen=True)
class PrefixHit:
    """One prefix-cache lookup for an admission (:meth:`KVCacheManager.find_prefix`): reuse
    ``hit_blocks`` (``cached`` tokens), locking the ``lock_cost`` of them that are evictable
    now. Valid until the next change of the manager."""

    match: PrefixMatch | None
    cached: int
    hit_blocks: tuple[int, ...]
    lock_cost: int

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Allocatable blocks an admission of ``num_tokens`` slots with this hit consumes: the
        fresh ones plus the evictable cached ones it locks."""
        return max(0, -(-num_tokens // block_size) - len(self.hit_blocks)) + self.lock_cost


class KVCacheManager:
    """Block tables over a refcounted pool and a radix prefix cache. A decode is O(1) per
    request: :meth:`grow` returns at once when the block to write is the request's alone."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = RadixCache(block_size) if enable_prefix_caching else None
        self.pool.set_evictor(self.prefix_cache)
        self._tables: dict[str, list[int]] = {}
        self._scopes: dict[str, tuple] = {}
        self._locks: dict[str, RadixNode | None] = {}  # deepest locked node of each request's path
        self._committed: dict[str, int] = {}  # full blocks already offered to the cache
        self._sent: dict[str, int] = {}       # leading entries unchanged since table_delta
        self.hit_tokens = 0
        self.query_tokens = 0
        self.hit_requests = 0
        self.miss_requests = 0

    def num_allocatable_blocks(self) -> int:
        """Free blocks plus cached blocks that can be evicted now."""
        return self.pool.num_allocatable()

    def blocks_for(self, num_tokens: int) -> int:
        """``ceil(num_tokens / block_size)``."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return -(-num_tokens // self.block_size)

    def lookup(self, scope: CacheScope | tuple, token_ids: Sequence[int]) -> int:
        """Cached leading tokens of ``token_ids`` in ``scope``: whole blocks, ``<= len - 1``."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.match(scope, token_ids).num_tokens

    def blocks_needed(self, request_id: str | None, num_tokens: int,
                      scope: CacheScope | tuple = (), token_ids: Sequence[int] = (),
                      *, write_from: int | None = None) -> int:
        """Allocatable blocks that :meth:`admit` (``request_id=None``) or :meth:`grow` would use:
        the mutation succeeds iff ``blocks_needed(...) <= num_allocatable_blocks()``."""
        if request_id is None:
            return self.find_prefix(scope, token_ids).blocks_needed(num_tokens, self.block_size)
        table = self._table(request_id)
        frm = num_tokens if write_from is None else write_from
        extra, targets = self._plan_grow(table, num_tokens, frm)
        return extra + len(targets)

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table. KeyError if unknown."""
        return list(self._table(request_id))

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's table holds (``len(table) * block_size``)."""
        return len(self._table(request_id)) * self.block_size

    def table_delta(self, request_id: str) -> tuple[int, tuple[int, ...]]:
        """``(kept, new_block_ids)``: the table is its first ``kept`` entries as of the last
        call, then ``new_block_ids``. The executor's copy follows from these deltas alone."""
        table = self._table(request_id)
        kept = self._sent[request_id]
        self._sent[request_id] = len(table)
        return kept, tuple(table[kept:])

    def group_deltas(self, request_id: str) -> tuple[()]:
        """The deltas of the other KV cache groups' tables: none, all layers read this one (a
        model with sliding-window layers has a manager with several,
        :mod:`kvlab.core.hybrid_kv_cache_manager`)."""
        return ()

    def scope_of(self, request_id: str) -> tuple:
        self._table(request_id)
        return self._scopes[request_id]

    def find_prefix(self, scope: CacheScope | tuple, token_ids: Sequence[int]) -> PrefixHit:
        """The cached prefix of ``token_ids`` in ``scope`` an admission would reuse (one tree
        match; whole blocks, at most ``len - 1`` tokens), to pass to :meth:`admit`."""
        cache, pool = self.prefix_cache, self.pool
        if cache is None:
            return PrefixHit(None, 0, (), 0)
        match = cache.match(scope_key(scope), token_ids)
        hit = tuple(match.blocks)
        lock_cost = sum(1 for b in hit if cache.is_evictable(b) and not pool.is_fenced(b))
        return PrefixHit(match, match.num_tokens, hit, lock_cost)

    def admit(self, request_id: str, scope: CacheScope | tuple, token_ids: Sequence[int],
              num_tokens: int, hit: PrefixHit | None = None) -> int:
        """Create a table of ``num_tokens`` slots: reuse and lock the cached prefix (``hit``, from
        :meth:`find_prefix` with no change since; looked up here when None), allocate the rest;
        returns the cached tokens reused (< ``num_tokens``). ValueError / :class:`OutOfBlocks`,
        unchanged, on a bad call or too few blocks."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} is already admitted")
        key = scope_key(scope)
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError(f"a request needs at least one token slot, got {num_tokens!r}")
        if hit is None:
            hit = self.find_prefix(key, token_ids)
        if num_tokens <= hit.cached:
            raise ValueError(f"num_tokens={num_tokens} must exceed the {hit.cached} cached tokens")
        needed = hit.blocks_needed(num_tokens, self.block_size)
        available = self.pool.num_allocatable()
        if needed > available:
            raise OutOfBlocks(f"cannot admit {request_id!r}: needs {needed} blocks, "
                              f"{available} allocatable", needed, available)
        match, cached, hit_blocks = hit.match, hit.cached, list(hit.hit_blocks)
        fresh = max(0, self.blocks_for(num_tokens) - len(hit_blocks))
        # capacity is guaranteed: mutate
        if match is not None and match.node is not None:
            self.prefix_cache.lock(match.node)  # type: ignore[union-attr]
            self.pool.share(hit_blocks, request_id)
        new = self.pool.allocate(fresh, request_id)
        self._tables[request_id] = hit_blocks + new
        self._scopes[request_id] = key
        self._locks[request_id] = match.node if match else None
        self._committed[request_id] = len(hit_blocks)
        self._sent[request_id] = 0
        if self.prefix_cache is not None:
            self.query_tokens += len(token_ids)
            self.hit_tokens += cached
            if cached:
                self.hit_requests += 1
            else:
                self.miss_requests += 1
        return cached

    def grow(self, request_id: str, num_tokens: int, write_from: int) -> list[tuple[int, int]]:
        """Make the table hold ``num_tokens`` slots, copying on write every shared block in
        ``[write_from, num_tokens)``; returns the ``(src, dst)`` copies, fenced until
        :meth:`complete_copies`. KeyError / ValueError / :class:`OutOfBlocks`: unchanged."""
        table = self._table(request_id)
        if not (type(write_from) is int and type(num_tokens) is int
                and 0 <= write_from <= num_tokens):
            raise ValueError(f"need 0 <= write_from <= num_tokens, got {write_from}, {num_tokens}")
        if self._grow_is_noop(table, num_tokens, write_from):   # most decode steps
            return []
        extra, targets = self._plan_grow(table, num_tokens, write_from)
        available = self.pool.num_allocatable()
        if extra + len(targets) > available:
            raise OutOfBlocks(f"cannot grow {request_id!r}: needs {extra + len(targets)} blocks, "
                              f"{available} allocatable", extra + len(targets), available)
        copies = self.pool.cow([table[i] for i in targets], request_id)
        for i, (_, new) in zip(targets, copies, strict=True):
            table[i] = new
        if targets:
            self._sent[request_id] = min(self._sent[request_id], targets[0])
        table.extend(self.pool.allocate(extra, request_id))
        return copies

    def truncate(self, request_id: str, num_tokens: int) -> list[int]:
        """Shrink the table to ``num_tokens`` slots (a speculative rollback) and return the
        released tail, which may hold no committed block (ValueError, unchanged)."""
        table = self._table(request_id)
        keep = self.blocks_for(num_tokens) if type(num_tokens) is int and num_tokens >= 0 else -1
        if keep < self._committed[request_id]:
            raise ValueError(f"truncate({request_id!r}, {num_tokens!r}) would drop cached blocks")
        tail = table[keep:]
        del table[keep:]
        self._sent[request_id] = min(self._sent[request_id], keep)
        self.pool.release(reversed(tail), request_id)
        return tail

    def pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write copies handed out and not yet completed, sorted."""
        return self.pool.pending_copies()

    def complete_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        """The executor finished these payload copies: lift their fences."""
        self.pool.complete_copies(copies)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Cache the request's full blocks whose KV is written (``token_ids``: those tokens) and
        move its lock to the deepest cached node; stops at the first block that is fenced or
        shared (a block is indexed once its committer holds it alone)."""
        table = self._table(request_id)
        if len(token_ids) > len(table) * self.block_size:
            raise ValueError(f"{len(token_ids)} committed tokens exceed the "
                             f"{len(table) * self.block_size} slots of {request_id!r}")
        cache = self.prefix_cache
        if cache is None:
            return
        full = len(token_ids) // self.block_size
        done = self._committed[request_id]
        if full <= done:
            return
        full = next((i for i in range(done, full) if not self._cacheable(table[i])), full)
        if full <= done:
            return
        result = self._insert(request_id, token_ids, table, done, full)
        # give the cache its reference on every newly indexed block, then move the lock down
        self.pool.share(list(result.new_blocks), CACHE_OWNER)
        cache.lock(result.node)
        old = self._locks[request_id]
        if old is not None:
            cache.unlock(old)
        self._locks[request_id] = result.node
        self._committed[request_id] = full

    def needs_commit(self, request_id: str, num_tokens: int) -> bool:
        """Whether :meth:`commit` of the first ``num_tokens`` tokens may cache anything (False:
        caching is off or no block became full since the last commit; skip building the list)."""
        if self.prefix_cache is None:
            return False
        self._table(request_id)
        return num_tokens // self.block_size > self._committed[request_id]

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's table shares every block of the parent's (refcount +1 each)."""
        table = self._table(parent_id)
        if not isinstance(child_id, str):
            raise TypeError(f"request_id must be a str, got {child_id!r}")
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already exists")
        self.pool.fork(table, parent_id, child_id)
        node = self._locks[parent_id]
        if node is not None:
            self.prefix_cache.lock(node)  # type: ignore[union-attr]
        self._tables[child_id] = list(table)
        self._scopes[child_id] = self._scopes[parent_id]
        self._locks[child_id] = node
        self._committed[child_id] = self._committed[parent_id]
        self._sent[child_id] = 0

    def free(self, request_id: str) -> bool:
        """Release the request's blocks and unlock its cached path (cached blocks stay,
        evictable; others become free once unfenced). False if it holds nothing."""
        if request_id not in self._tables:
            return False
        table = self._tables.pop(request_id)
        self.pool.release(reversed(table), request_id)
        node = self._locks.pop(request_id)
        if node is not None:
            self.prefix_cache.unlock(node)  # type: ignore[union-attr]
        del self._scopes[request_id]
        del self._committed[request_id]
        del self._sent[request_id]
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's ``reset_prefix_cache``: False (nothing changed)
        while any request holds blocks, else True with the cached blocks free again."""
        if self.prefix_cache is None:
            return True
        if self._tables:
            return False
        self.pool.release(self.prefix_cache.clear(), CACHE_OWNER)
        return True

    def requests(self) -> list[str]:
        return list(self._tables)

    def locked_node(self, request_id: str) -> RadixNode | None:
        self._table(request_id)
        return self._locks[request_id]

    def state_tuple(self) -> tuple:
        """Everything observable (pool, tree, tables, counters) for before/after comparisons."""
        return (self.pool.state_tuple(),
                self.prefix_cache.state_tuple() if self.prefix_cache else None,
                tuple(sorted((rid, tuple(t)) for rid, t in self._tables.items())),
                tuple(sorted((rid, repr(s)) for rid, s in self._scopes.items())),
                tuple(sorted((rid, n.node_id if n else None) for rid, n in self._locks.items())),
                tuple(sorted(self._committed.items())),
                (self.hit_tokens, self.query_tokens, self.hit_requests, self.miss_requests))

    def _table(self, request_id: str) -> list[int]:
        try:
            return self._tables[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _grow_is_noop(self, table: list[int], num_tokens: int, write_from: int) -> bool:
        """O(1): :meth:`grow` would do nothing (room in the table, and the positions to write
        lie in one block the request holds alone). False means "maybe not"."""
        bs = self.block_size
        if num_tokens > len(table) * bs:
            return False
        if write_from == num_tokens:
            return True
        first = write_from // bs
        return first == (num_tokens - 1) // bs and self.pool.refcount(table[first]) == 1

    def _insert(self, request_id: str, token_ids: Sequence[int], table: list[int], done: int,
                full: int) -> InsertResult:
        """Index blocks ``done..full-1`` of ``table`` in the tree. The request's locked node
        spells its first ``done`` blocks (admit, commit and fork keep it so), so only the new
        blocks are inserted below it; without a lock the whole path is inserted from the root."""
        cache = self.prefix_cache
        assert cache is not None
        start = self._locks[request_id]
        scope = self._scopes[request_id]
        if start is not None and start.depth == done:
            bs = self.block_size
            return cache.insert(scope, token_ids[done * bs:full * bs], table[done:full],
                                below=start)
        return cache.insert(scope, token_ids, table[:full])

    def _cacheable(self, block: int) -> bool:
        """Whether :meth:`commit` may index ``block`` now: no pending copy touches it and its
        committer is its only holder."""
        return not self.pool.is_fenced(block) and self.pool.refcount(block) == 1

    def _plan_grow(self, table: list[int], num_tokens: int,
                   write_from: int) -> tuple[int, list[int]]:
        """(blocks to append, logical blocks to copy-on-write) for :meth:`grow`: the shared
        blocks of ``table`` covering positions ``[write_from, num_tokens)``."""
        extra = max(0, self.blocks_for(num_tokens) - len(table))
        if write_from >= num_tokens:
            return extra, []
        first = write_from // self.block_size
        last = min(len(table), self.blocks_for(num_tokens))
        return extra, [i for i in range(first, last) if self.pool.refcount(table[i]) > 1]
