"""KVCacheManager: per-request block tables over a refcounted pool and a radix prefix cache.

The object the scheduler allocates from: :class:`~kvlab.core.block_pool.BlockPool` says who holds
which physical block, :class:`~kvlab.core.radix.RadixCache` which blocks hold which cached
prefix (chapters 3 and 4 explain the design). The rules:

* The prefix cache is an owner like any other (:data:`~kvlab.core.block_pool.CACHE_OWNER`):
  ``refcount == live owners`` counts it, copy-on-write protects cached KV with no special case,
  and a cached block no request uses stays alive until the tree evicts it.
* A request locks its whole cached path from admission until :meth:`KVCacheManager.free`; only
  unlocked leaves are evicted, least recently used first.
* Position ``t`` lives at slot ``block_size * table[t // block_size] + t % block_size`` (spec
  rule 2). Full blocks are cached by :meth:`KVCacheManager.commit`; when another request cached
  the same tokens first, its blocks stay canonical and the duplicate stays private.
* Every mutation validates its input and checks capacity before changing anything: on
  :class:`~kvlab.core.block_pool.OutOfBlocks`, ValueError or KeyError nothing changed. What an
  admission or a growth needs is computed once (:func:`~kvlab.core.kv_plan.plan_admission`,
  ``_plan_grow``), for
  :meth:`KVCacheManager.blocks_needed` and for the mutation alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .block_pool import CACHE_OWNER, BlockPool, OutOfBlocks
from .checks import is_int
from .kv_plan import plan_admission
from .kv_snapshot import KVSnapshot
from .paging import token_slots
from .radix import RadixCache, _Node
from .scope import CacheScope, scope_key


class KVCacheManager:
    """Block tables for requests over a refcounted pool and a radix prefix cache.

    The decode path is O(1) per request: :meth:`grow` returns at once when the table has room
    and the block to write is exclusive, :meth:`needs_commit` says when no block became full,
    and :meth:`commit` inserts only the new blocks below the request's locked node.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if not is_int(num_blocks) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not is_int(block_size) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache: RadixCache | None = (
            RadixCache(block_size) if enable_prefix_caching else None
        )
        self.pool.set_evictor(self.prefix_cache)
        self._tables: dict[str, list[int]] = {}
        self._scopes: dict[str, tuple] = {}
        self._locks: dict[str, _Node | None] = {}  # deepest locked node of each request's path
        self._committed: dict[str, int] = {}  # full blocks already offered to the cache
        self._sent: dict[str, int] = {}       # leading entries unchanged since table_delta
        self.hit_tokens = 0
        self.query_tokens = 0
        self.hit_requests = 0
        self.miss_requests = 0

    # ================================================================== queries
    def num_allocatable_blocks(self) -> int:
        """Free blocks plus cached blocks that can be evicted now."""
        return self.pool.num_allocatable()

    def blocks_for(self, num_tokens: int) -> int:
        """``ceil(num_tokens / block_size)``."""
        if not is_int(num_tokens) or num_tokens < 0:
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
        """Allocatable blocks that :meth:`admit` (``request_id=None``) or :meth:`grow` would use.

        For a new request: fresh blocks beyond the cached prefix of ``token_ids`` in ``scope``,
        plus the matched cached blocks that are evictable now (admission locks them). For a
        running request: the missing blocks, plus one per shared block that :meth:`grow` would
        copy-on-write for positions ``[write_from, num_tokens)``. The same computation decides
        whether the mutation succeeds: ``blocks_needed(...) <= num_allocatable_blocks()``.
        """
        if request_id is None:
            return plan_admission(self.pool, self.prefix_cache, self.blocks_for(num_tokens),
                                  scope_key(scope), token_ids).needed
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

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Physical slots of positions ``[start, end)``; ValueError outside the table."""
        table = self._table(request_id)
        if not (is_int(start) and is_int(end) and
                0 <= start <= end <= len(table) * self.block_size):
            raise ValueError(
                f"positions [{start}, {end}) outside the table of {request_id!r} "
                f"({len(table) * self.block_size} slots)"
            )
        return token_slots(table, self.block_size, start, end)

    def table_delta(self, request_id: str) -> tuple[int, tuple[int, ...]]:
        """``(kept, new_block_ids)``: the table is its first ``kept`` entries as of the last
        call, then ``new_block_ids``. The executor's copy follows from these deltas alone."""
        table = self._table(request_id)
        kept = self._sent[request_id]
        self._sent[request_id] = len(table)
        return kept, tuple(table[kept:])

    def scope_of(self, request_id: str) -> tuple:
        self._table(request_id)
        return self._scopes[request_id]

    # ================================================================== mutations
    def admit(self, request_id: str, scope: CacheScope | tuple, token_ids: Sequence[int],
              num_tokens: int) -> int:
        """Create the table: reuse and lock the cached prefix, then allocate fresh blocks.

        Returns the number of cached tokens reused (== :meth:`lookup`). The table then holds
        ``num_tokens`` slots; ``num_tokens`` must exceed the cached count (ValueError). Duplicate
        id -> ValueError; not enough blocks -> :class:`OutOfBlocks`. Unchanged on any error.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} is already admitted")
        key = scope_key(scope)
        if not is_int(num_tokens) or num_tokens < 1:
            raise ValueError(f"a request needs at least one token slot, got {num_tokens!r}")
        plan = plan_admission(self.pool, self.prefix_cache, self.blocks_for(num_tokens), key,
                              token_ids)
        if num_tokens <= plan.cached:
            raise ValueError(f"num_tokens={num_tokens} must exceed the {plan.cached} cached tokens")
        available = self.pool.num_allocatable()
        if plan.needed > available:
            raise OutOfBlocks(f"cannot admit {request_id!r}: needs {plan.needed} blocks, "
                              f"{available} allocatable", plan.needed, available)
        match, cached, hit_blocks = plan.match, plan.cached, list(plan.hit_blocks)
        fresh = plan.fresh
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
        """Make the table hold ``num_tokens`` slots; copy-on-write shared blocks to be written.

        Positions ``[write_from, num_tokens)`` are about to be written: every shared block
        covering them (another request's, or the prefix cache's) is replaced by a fresh copy.
        Returns the ``(src, dst)`` copies, fenced until :meth:`complete_copies`. The table never
        shrinks. KeyError unknown id, ValueError bad positions, :class:`OutOfBlocks` short of
        blocks.
        """
        table = self._table(request_id)
        if not (is_int(write_from) and is_int(num_tokens)
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
        """Shrink the table to the blocks ``num_tokens`` slots need and release the tail (the
        rollback of rejected speculative tokens). The tail must hold no committed block
        (ValueError, unchanged). Returns the blocks released (in table order)."""
        table = self._table(request_id)
        keep = self.blocks_for(num_tokens) if is_int(num_tokens) and num_tokens >= 0 else -1
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
        """Cache the request's full blocks whose KV is written (``token_ids`` = those tokens).

        ``token_ids`` is a prefix of prompt + outputs whose KV is in the table. Each full block not
        offered before is inserted under the request's scope, and the request's lock moves to the
        deepest cached node. Caching stops at the first block that is fenced by a pending copy
        or that another request also holds (shared by :meth:`fork`): the cache indexes a block
        only once its committer holds it alone, so every cached block a request uses lies on
        that request's own locked path. A later commit picks the rest up. No-op when caching is
        off. KeyError unknown id; ValueError if ``token_ids`` is longer than the table.
        """
        table = self._table(request_id)
        if len(token_ids) > len(table) * self.block_size:
            raise ValueError(
                f"{len(token_ids)} committed tokens exceed the {len(table) * self.block_size} "
                f"slots of {request_id!r}"
            )
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
        """Whether :meth:`commit` of the request's first ``num_tokens`` tokens may cache anything.

        False when caching is off, or when no block became full since the request's last commit:
        :meth:`commit` would then return without changing anything, so the caller can skip it
        and the building of its token list. KeyError for an unknown id.
        """
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
        """Release the request's blocks and unlock its cached path. False if it holds nothing.

        Cached full blocks stay in the cache (evictable, most recently used); other blocks
        become free (or stay fenced until their pending copy completes).
        """
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

    # ================================================================== checks and views
    def requests(self) -> list[str]:
        return list(self._tables)

    def locked_node(self, request_id: str) -> _Node | None:
        self._table(request_id)
        return self._locks[request_id]

    def check_invariants(self) -> None:
        """AssertionError naming the first broken invariant (see kvlab.core.invariants)."""
        from .invariants import check_kv_manager

        check_kv_manager(self)

    def snapshot(self) -> KVSnapshot:
        pool = self.pool
        cache = self.prefix_cache
        return KVSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            block_states=tuple(pool.state(b) for b in range(self.num_blocks)),
            refcounts=tuple(pool.refcount(b) for b in range(self.num_blocks)),
            block_owners=tuple(tuple(sorted(str(o) for o in pool.owners(b)))
                               for b in range(self.num_blocks)),
            tables={rid: tuple(t) for rid, t in sorted(self._tables.items())},
            pending_copies=tuple(pool.pending_copies()),
            cached_blocks=cache.num_cached_blocks() if cache else 0,
            cached_tokens=cache.cached_tokens() if cache else 0,
            evictable_blocks=pool.num_evictable(),
            protected_blocks=cache.protected_blocks() if cache else 0,
            free_blocks=pool.num_free(),
            hit_tokens=self.hit_tokens,
            query_tokens=self.query_tokens,
            hit_requests=self.hit_requests,
            miss_requests=self.miss_requests,
        )

    def state_tuple(self) -> tuple:
        """Everything observable (pool, tree, tables, counters) for before/after comparisons."""
        return (
            self.pool.state_tuple(),
            self.prefix_cache.state_tuple() if self.prefix_cache else None,
            tuple(sorted((rid, tuple(t)) for rid, t in self._tables.items())),
            tuple(sorted((rid, repr(s)) for rid, s in self._scopes.items())),
            tuple(sorted((rid, n.node_id if n else None) for rid, n in self._locks.items())),
            tuple(sorted(self._committed.items())),
            (self.hit_tokens, self.query_tokens, self.hit_requests, self.miss_requests),
        )

    # ================================================================== internals
    def _table(self, request_id: str) -> list[int]:
        try:
            return self._tables[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _grow_is_noop(self, table: list[int], num_tokens: int, write_from: int) -> bool:
        """O(1) test for the common decode step: :meth:`grow` would allocate and copy nothing.

        True when the table already holds ``num_tokens`` slots and the positions to write lie
        in one block that the request holds alone (or there is nothing to write). False means
        "maybe not": the general path decides.
        """
        bs = self.block_size
        if num_tokens > len(table) * bs:
            return False
        if write_from == num_tokens:
            return True
        first = write_from // bs
        return first == (num_tokens - 1) // bs and self.pool.refcount(table[first]) == 1

    def _insert(self, request_id: str, token_ids: Sequence[int], table: list[int], done: int,
                full: int) -> Any:
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
