"""HybridKVCacheManager: one block table **per KV cache group** over one pool of blocks of one
size, the manager of a model with sliding-window layers (vLLM v1's hybrid KV cache manager:
``vllm/v1/core/kv_cache_coordinator.py`` and ``single_type_kv_cache_manager.py`` in v0.32.0).
The scheduler calls it exactly as it calls :class:`~.kv_cache_manager.KVCacheManager`; a
full-attention model never uses it.

A group (:mod:`.kv_cache_groups`) is a set of layers that read one table. Its table maps
logical block ``i`` (tokens ``i*bs .. i*bs+bs-1``) to a pool block, as the single layout's
does; a pool block belongs to one group at a time. What a group does with its table:

* **full attention** (window 0): keeps every block until the request ends, as the single
  layout does;
* **sliding window W**: a query at position ``p`` sees ``p - W + 1 .. p``, so once ``n`` tokens
  are computed the first ``n - W + 1`` are never read again, and :meth:`~HybridKVCacheManager.
  grow` releases the blocks wholly before them (``(n - W + 1) // bs`` blocks; vLLM's
  ``SlidingWindowManager.get_num_skipped_tokens`` and ``remove_skipped_blocks``). Their entries
  become None (vLLM's ``null_block``); a block that was cached stays cached, evictable, for a
  later prefix hit. What a request holds there is bounded by its window
  (:func:`~.kv_cache_groups.window_blocks`), however long it runs.

Prefix hits (:meth:`~HybridKVCacheManager.find_prefix`) follow each group's rule, as vLLM's
coordinator combines them (``HybridKVCacheCoordinator.find_longest_cache_hit``): a full group
needs every block of the prefix; a window group only the ``ceil((W-1)/bs)`` blocks before the
first token to compute (its window), the earlier entries stay None; the hit is the longest
prefix every group accepts. Copy-on-write, refcounts, scope and idempotent release hold per
group exactly as in the single layout; every mutation is all-or-nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.core.block_pool import CACHE_OWNER, BlockPool, OutOfBlocks
from kvlab.core.cache_scope import CacheScope
from kvlab.core.hybrid_prefix_cache import HybridNode, HybridPrefixCache
from kvlab.core.kv_cache_groups import window_blocks
from kvlab.core.radix_cache import scope_key

__all__ = ["HybridKVCacheManager", "HybridPrefixHit"]

Table = list[int | None]


@dataclass(frozen=True)
class HybridPrefixHit:
    """A prefix-cache lookup of :meth:`HybridKVCacheManager.find_prefix`: ``cached`` tokens
    reused, each group's first table entries (``group_blocks[g]``, None where its window needs
    no block), locking the ``lock_cost`` of them that are evictable now; ``node``: the path's
    last node. Valid until the next change of the manager."""

    cached: int
    group_blocks: tuple[tuple[int | None, ...], ...]
    lock_cost: int
    node: HybridNode | None = None

    @property
    def hit_blocks(self) -> tuple[int, ...]:
        """The blocks the hit reuses, all groups."""
        return tuple(b for blocks in self.group_blocks for b in blocks if b is not None)

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Allocatable blocks an admission of ``num_tokens`` slots with this hit consumes:
        every group's fresh blocks plus the evictable cached ones it locks."""
        fresh = max(0, -(-num_tokens // block_size) - self.cached // block_size)
        return len(self.group_blocks) * fresh + self.lock_cost


class HybridKVCacheManager:
    """Per-group block tables over one refcounted pool and a per-group prefix cache (contract:
    the module docstring). ``windows[g]``: group ``g``'s sliding window (0: full attention);
    group 0's table is the one :meth:`table_delta` sends. ``chunk_tokens``: the most tokens a
    request computes in one step (the scheduler's prefill chunk), which bounds what a window
    group holds (:meth:`blocks_for`); None: no bound is assumed."""

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int], *,
                 enable_prefix_caching: bool = True, chunk_tokens: int | None = None):
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        windows = tuple(windows)
        if not windows or any(type(w) is not int or w < 0 for w in windows):
            raise ValueError(f"windows must be ints >= 0, one per group, got {windows!r}")
        if chunk_tokens is not None and (type(chunk_tokens) is not int or chunk_tokens <= 0):
            raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = windows
        self.chunk_tokens = chunk_tokens
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = (HybridPrefixCache(block_size, windows, self.pool)
                             if enable_prefix_caching else None)
        self.pool.set_evictor(self.prefix_cache)
        self._tables: dict[str, list[Table]] = {}
        self._dropped: dict[str, list[int]] = {}   # per group: leading entries that are None
        self._scopes: dict[str, tuple] = {}
        self._committed: dict[str, int] = {}        # chunks already offered to the cache
        self._node: dict[str, HybridNode | None] = {}   # the node of the last commit
        self._owned: dict[str, bool] = {}     # every full-group block on its path is its own
        self._sent: dict[str, list[int]] = {}       # per group: entries unchanged since sent
        self.hit_tokens = 0
        self.query_tokens = 0
        self.hit_requests = 0
        self.miss_requests = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    # ------------------------------------------------------------------ queries
    def num_allocatable_blocks(self) -> int:
        """Free blocks plus cached blocks that can be evicted now."""
        return self.pool.num_allocatable()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` slots holds at most, all groups together: a full
        group all ``ceil(num_tokens / block_size)``, a window group its
        :func:`~.kv_cache_groups.window_blocks`."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        chunk = self.chunk_tokens or max(1, num_tokens)
        return sum(window_blocks(w, num_tokens, self.block_size, chunk) for w in self.windows)

    def lookup(self, scope: CacheScope | tuple, token_ids: Sequence[int]) -> int:
        """Cached leading tokens of ``token_ids`` in ``scope`` an admission would reuse."""
        return self.find_prefix(scope, token_ids).cached if self.prefix_cache else 0

    def blocks_needed(self, request_id: str | None, num_tokens: int,
                      scope: CacheScope | tuple = (), token_ids: Sequence[int] = (),
                      *, write_from: int | None = None) -> int:
        """Allocatable blocks that :meth:`admit` (``request_id=None``) or :meth:`grow` would
        use, net of the blocks a grow releases first: the mutation succeeds iff
        ``blocks_needed(...) <= num_allocatable_blocks()``."""
        if request_id is None:
            return self.find_prefix(scope, token_ids).blocks_needed(num_tokens, self.block_size)
        self._table(request_id)
        frm = num_tokens if write_from is None else write_from
        skipped, extra, targets = self._plan_grow(request_id, num_tokens, frm)
        return sum(extra) + sum(map(len, targets)) - self._released_allocatable(
            request_id, skipped)

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def requests(self) -> list[str]:
        return list(self._tables)

    def block_tables(self, request_id: str) -> tuple[Table, ...]:
        """Copies of the request's tables, one per group (None: an entry the window dropped)."""
        return tuple(list(t) for t in self._table(request_id))

    def block_table(self, request_id: str) -> Table:
        """A copy of group 0's table."""
        return list(self._table(request_id)[0])

    def held_blocks(self, request_id: str) -> list[int]:
        """Every block the request holds, all groups."""
        return [b for t in self._table(request_id) for b in t if b is not None]

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's tables cover (``len(table) * block_size``)."""
        return len(self._table(request_id)[0]) * self.block_size

    def scope_of(self, request_id: str) -> tuple:
        self._table(request_id)
        return self._scopes[request_id]

    def table_delta(self, request_id: str) -> tuple[int, tuple[int, ...]]:
        """Group 0's ``(kept, new_block_ids)`` since the last call (see :meth:`group_deltas`)."""
        return self._delta(request_id, 0)

    def group_deltas(self, request_id: str) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``(kept, new_block_ids)`` of groups 1.. since the last call: the table is its first
        ``kept`` entries as sent, then ``new_block_ids``. An entry the window has dropped is
        never sent again (the runner's stale id is never read); one that is None when first
        sent (behind a prefix hit) goes as block 0, padding no kernel reads."""
        self._table(request_id)
        return tuple(self._delta(request_id, g) for g in range(1, self.num_groups))

    def _delta(self, request_id: str, group: int) -> tuple[int, tuple[int, ...]]:
        table = self._table(request_id)[group]
        sent = self._sent[request_id]
        kept, sent[group] = sent[group], len(table)
        return kept, tuple(0 if b is None else b for b in table[kept:])

    def find_prefix(self, scope: CacheScope | tuple, token_ids: Sequence[int]
                    ) -> HybridPrefixHit:
        """The cached prefix of ``token_ids`` in ``scope`` every group accepts (the module
        docstring's rules; whole blocks, at most ``len - 1`` tokens), to pass to
        :meth:`admit`."""
        cache = self.prefix_cache
        if cache is None:
            return HybridPrefixHit(0, ((),) * self.num_groups, 0)
        path = cache.match(scope_key(scope), token_ids)
        bs, n = self.block_size, len(path)
        for g, w in enumerate(self.windows):       # full groups: the leading run
            if not w:
                n = next((i for i in range(n) if path[i].blocks[g] is None), n)
        reach = [-(-(w - 1) // bs) if w else 0 for w in self.windows]

        def accepted(h: int) -> bool:   # every window group has the blocks of h's window
            return all(path[i].blocks[g] is not None
                       for g, w in enumerate(self.windows) if w
                       for i in range(max(0, h - reach[g]), h))

        while n and not accepted(n):
            n -= 1
        groups = tuple(tuple(path[i].blocks[g] if not w or i >= n - reach[g] else None
                             for i in range(n)) for g, w in enumerate(self.windows))
        hit = HybridPrefixHit(n * bs, groups, 0, path[n - 1] if n else None)
        pool = self.pool
        cost = sum(1 for b in hit.hit_blocks if cache.is_evictable(b) and not pool.is_fenced(b))
        return HybridPrefixHit(n * bs, groups, cost, hit.node)

    # ------------------------------------------------------------------ mutations
    def admit(self, request_id: str, scope: CacheScope | tuple, token_ids: Sequence[int],
              num_tokens: int, hit: HybridPrefixHit | None = None) -> int:
        """Create tables of ``num_tokens`` slots: reuse the cached prefix (``hit``, from
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
        # capacity is guaranteed: mutate
        reused = list(hit.hit_blocks)
        self.pool.share(reused, request_id)
        if self.prefix_cache is not None:
            self.prefix_cache.refresh(reused)
        fresh = max(0, -(-num_tokens // self.block_size) - hit.cached // self.block_size)
        new = self.pool.allocate(fresh * self.num_groups, request_id)
        self._tables[request_id] = [list(hit.group_blocks[g]) + new[g * fresh:(g + 1) * fresh]
                                    for g in range(self.num_groups)]
        self._dropped[request_id] = [next((i for i, b in enumerate(blocks) if b is not None),
                                          len(blocks)) for blocks in hit.group_blocks]
        self._scopes[request_id] = key
        self._committed[request_id] = hit.cached // self.block_size
        self._node[request_id] = hit.node
        self._owned[request_id] = True
        self._sent[request_id] = [0] * self.num_groups
        if self.prefix_cache is not None:
            self.query_tokens += len(token_ids)
            self.hit_tokens += hit.cached
            if hit.cached:
                self.hit_requests += 1
            else:
                self.miss_requests += 1
        return hit.cached

    def grow(self, request_id: str, num_tokens: int, write_from: int) -> list[tuple[int, int]]:
        """Make every table hold ``num_tokens`` slots for the tokens from ``write_from`` on:
        first release each window group's blocks wholly before the window of position
        ``write_from``, then copy on write every shared block in ``[write_from, num_tokens)``
        and append blocks; returns the ``(src, dst)`` copies, fenced until
        :meth:`complete_copies`. KeyError / ValueError / :class:`OutOfBlocks`: unchanged."""
        self._table(request_id)
        if not (type(write_from) is int and type(num_tokens) is int
                and 0 <= write_from <= num_tokens):
            raise ValueError(f"need 0 <= write_from <= num_tokens, got {write_from}, {num_tokens}")
        skipped, extra, targets = self._plan_grow(request_id, num_tokens, write_from)
        if not (any(skipped) or any(extra) or any(targets)):
            return []                                   # most decode steps
        need = sum(extra) + sum(map(len, targets))
        available = self.pool.num_allocatable() + self._released_allocatable(request_id,
                                                                              skipped)
        if need > available:
            raise OutOfBlocks(f"cannot grow {request_id!r}: needs {need} blocks, "
                              f"{available} allocatable", need, available)
        tables, sent = self._tables[request_id], self._sent[request_id]
        for g, indices in enumerate(skipped):       # out of the window: release
            if indices:
                self._release(request_id, [(g, i) for i in indices])
                self._dropped[request_id][g] = indices[-1] + 1
        copies: list[tuple[int, int]] = []
        for g, indices in enumerate(targets):
            moved = self.pool.cow([tables[g][i] for i in indices], request_id)
            for i, (_, new) in zip(indices, moved, strict=True):
                tables[g][i] = new
            if indices:
                sent[g] = min(sent[g], indices[0])
                self._refresh([old for old, _ in moved])
            copies += moved
        for g, n in enumerate(extra):
            tables[g].extend(self.pool.allocate(n, request_id))
        return copies

    def truncate(self, request_id: str, num_tokens: int) -> list[int]:
        """Shrink every table to ``num_tokens`` slots (a speculative rollback) and return the
        released blocks, which may hold no committed block (ValueError, unchanged)."""
        tables = self._table(request_id)
        keep = -(-num_tokens // self.block_size) if type(num_tokens) is int \
            and num_tokens >= 0 else -1
        if keep < self._committed[request_id]:
            raise ValueError(f"truncate({request_id!r}, {num_tokens!r}) would drop cached blocks")
        gone = [(g, i) for g, t in enumerate(tables) for i in range(keep, len(t))]
        tail = [tables[g][i] for g, i in gone if tables[g][i] is not None]
        self._release(request_id, gone)
        for g, table in enumerate(tables):
            del table[keep:]
            self._sent[request_id][g] = min(self._sent[request_id][g], keep)
            self._dropped[request_id][g] = min(self._dropped[request_id][g], keep)
        return tail

    def pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write copies handed out and not yet completed, sorted."""
        return self.pool.pending_copies()

    def complete_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        """The executor finished these payload copies: lift their fences."""
        self.pool.complete_copies(copies)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Cache the request's full blocks whose KV is written (``token_ids``: those tokens),
        every group's at once (:meth:`HybridPrefixCache.insert`: an entry the window dropped
        is skipped; a full-attention block that is fenced or shared stops the walk)."""
        tables = self._table(request_id)
        if len(token_ids) > len(tables[0]) * self.block_size:
            raise ValueError(f"{len(token_ids)} committed tokens exceed the "
                             f"{len(tables[0]) * self.block_size} slots of {request_id!r}")
        cache = self.prefix_cache
        full = len(token_ids) // self.block_size
        if cache is None or full <= self._committed[request_id]:
            return
        # from the last commit's node while every full-group block above it is this request's
        # (held, so never evicted: the path is intact), else from the root
        below = self._node[request_id] if self._owned[request_id] else None
        out = cache.insert(self._scopes[request_id], token_ids, tables, full,
                           self._cacheable, below=below)
        self.pool.share(list(out.new_blocks), CACHE_OWNER)
        self._node[request_id] = out.node
        self._owned[request_id] = out.owned
        self._committed[request_id] = max(self._committed[request_id], out.depth)

    def needs_commit(self, request_id: str, num_tokens: int) -> bool:
        """Whether :meth:`commit` of the first ``num_tokens`` tokens may cache anything."""
        if self.prefix_cache is None:
            return False
        self._table(request_id)
        return num_tokens // self.block_size > self._committed[request_id]

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's tables share every block of the parent's (refcount +1 each)."""
        tables = self._table(parent_id)
        if not isinstance(child_id, str):
            raise TypeError(f"request_id must be a str, got {child_id!r}")
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already exists")
        self.pool.fork(self.held_blocks(parent_id), parent_id, child_id)
        self._tables[child_id] = [list(t) for t in tables]
        self._dropped[child_id] = list(self._dropped[parent_id])
        self._scopes[child_id] = self._scopes[parent_id]
        self._committed[child_id] = self._committed[parent_id]
        self._node[child_id] = self._node[parent_id]
        self._owned[child_id] = self._owned[parent_id]
        self._sent[child_id] = [0] * self.num_groups

    def free(self, request_id: str) -> bool:
        """Release the request's blocks in every group (cached ones stay, evictable, its tail
        evicted first; others become free once unfenced). False if it holds nothing."""
        if request_id not in self._tables:
            return False
        tables = self._tables[request_id]
        self._release(request_id, [(g, i) for i in range(len(tables[0]) - 1, -1, -1)
                                   for g in range(self.num_groups)])
        for table in (self._tables, self._dropped, self._scopes, self._committed, self._node,
                      self._owned, self._sent):
            del table[request_id]
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block in every group, as vLLM's ``reset_prefix_cache``: False
        (nothing changed) while any request holds blocks, else True with them free again."""
        if self.prefix_cache is None:
            return True
        if self._tables:
            return False
        cache = self.prefix_cache
        self.pool.release(cache.evict(cache.evictable_blocks()), CACHE_OWNER)
        assert cache.num_cached_blocks() == 0
        return True

    def state_tuple(self) -> tuple:
        """Everything observable (pool, cache, tables, counters) for before/after comparisons."""
        return (self.pool.state_tuple(),
                self.prefix_cache.state_tuple() if self.prefix_cache else None,
                tuple(sorted((rid, tuple(map(tuple, t))) for rid, t in self._tables.items())),
                tuple(sorted((rid, repr(s)) for rid, s in self._scopes.items())),
                tuple(sorted(self._committed.items())),
                tuple(sorted((rid, tuple(s)) for rid, s in self._sent.items())),
                (self.hit_tokens, self.query_tokens, self.hit_requests, self.miss_requests))

    # ------------------------------------------------------------------ internals
    def _table(self, request_id: str) -> list[Table]:
        try:
            return self._tables[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _plan_grow(self, request_id: str, num_tokens: int, write_from: int
                   ) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """Per group, for :meth:`grow`: the entries to release (wholly before the window of
        position ``write_from``), the blocks to append, the entries to copy on write (shared
        ones covering ``[write_from, num_tokens)``)."""
        bs = self.block_size
        want = -(-num_tokens // bs)
        skipped, extra, targets = [], [], []
        for g, (table, w) in enumerate(zip(self._tables[request_id], self.windows,
                                           strict=True)):
            dropped = self._dropped[request_id][g]
            upto = min(len(table), max(0, write_from - w + 1) // bs) if w else 0
            skipped.append(list(range(dropped, upto)))
            extra.append(max(0, want - len(table)))
            last = min(len(table), want)
            first = write_from // bs if write_from < num_tokens else last
            targets.append([i for i in range(first, last)
                            if self.pool.refcount(table[i]) > 1])
        return skipped, extra, targets

    def _released_allocatable(self, request_id: str, skipped: list[list[int]]) -> int:
        """How many of the ``skipped`` entries become allocatable once the request releases
        them: those nobody else holds but the cache, and no pending copy fences."""
        tables, pool = self._tables[request_id], self.pool
        return sum(1 for g, indices in enumerate(skipped) for i in indices
                   if not pool.is_fenced(tables[g][i])
                   and pool.owners(tables[g][i]) <= {request_id, CACHE_OWNER})

    def _release(self, request_id: str, entries: list[tuple[int, int]]) -> None:
        """Release the blocks at ``(group, index)`` ``entries`` (None ones are skipped) and set
        them to None; the cache re-reads them in this order (least recent first)."""
        tables = self._tables[request_id]
        blocks = []
        for g, i in entries:
            if i < len(tables[g]) and tables[g][i] is not None:
                blocks.append(tables[g][i])
                tables[g][i] = None
        self.pool.release(blocks, request_id)
        self._refresh(blocks)

    def _refresh(self, blocks: list[int]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.refresh(blocks)

    def _cacheable(self, block: int) -> bool:
        """Whether :meth:`commit` may index ``block`` now: no pending copy touches it and its
        committer is its only holder."""
        return not self.pool.is_fenced(block) and self.pool.refcount(block) == 1
