"""Named invariant checks for the KV memory layer (spec rule 11), extensible by later chapters.

An :class:`InvariantSet` is an ordered list of named checks. Each check takes the subject (a
pool, a radix cache, a KV manager, later a scheduler or an engine) and raises AssertionError
with a message when something is wrong; :meth:`InvariantSet.check` re-raises it as
``AssertionError("invariant '<name>' broken: <message>")`` so the failure names the rule.

Later layers extend a set instead of rewriting it::

    SCHEDULER_INVARIANTS = KV_MANAGER_INVARIANTS.extended()
    SCHEDULER_INVARIANTS.add("one queue per request", lambda s: ...)

The KV-manager checks (all recomputed from scratch, never from the counters they verify):

* ``refcount == live owners``: each block's refcount equals its owner set, and that set is
  exactly {requests whose table lists it} plus the prefix cache iff the tree indexes it.
* ``one state per block``: every block is exactly one of free / owned by a request / cached
  (only the cache holds it), and free blocks are exactly the ownerless unfenced ones.
* ``pending copies fenced``: both blocks of every pending copy are fenced and not free, and the
  fence counts equal the pending copies touching each block.
* ``radix tree well formed``: parent/child links, one node per block, chunk sizes, lock counts
  that dominate the children's, the evictable-leaf set.
* ``locks match requests``: each node's lock count equals the number of requests whose locked
  path passes through it; a block in a request table that the tree indexes lies on a locked
  node (so eviction can never take a block that is in use).
* ``cache accounting exact``: evictable = indexed blocks on unlocked nodes, protected = on locked
  nodes, and their sum is the cached block count; the pool's evictable count agrees.

A hybrid manager (:class:`~kvlab.core.hybrid_kv_cache_manager.HybridKVCacheManager`: a table
per KV cache group) has its own set, :data:`HYBRID_KV_MANAGER_INVARIANTS`, the same rules per
group: the pool's; ``refcount == live owners`` over every group's tables; ``tables per group``
(one length for all of a request's groups, no block twice, a block in one group only, a full
group's table without holes, a window group's holes only before its live blocks);
``window groups bounded`` (what a request holds in a window group never exceeds
:func:`~kvlab.core.kv_cache_groups.window_blocks`); ``hybrid tree well formed`` (links, one index
entry per block in the group that holds it, no empty leaf); ``evictable accounting exact``
(evictable = indexed blocks only the cache holds, and the pool agrees); pending copies not free.
:func:`check_kv_manager` picks the set by the manager's kind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.block_pool import CACHE_OWNER, BlockPool
from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvlab.core.kv_cache_groups import window_blocks
from kvlab.core.radix_cache import RadixCache
from kvlab.core.request import PLACEHOLDER, RUNNING_STATUSES, WAITING_STATUSES
from kvlab.disagg.remote_kv_scheduler import RemoteKVScheduler
from kvlab.labs.kv_snapshot import radix_nodes

Check = Callable[[Any], None]


@dataclass
class InvariantSet:
    """An ordered, named list of checks over one kind of subject."""

    checks: list[tuple[str, Check]] = field(default_factory=list)

    def add(self, name: str, check: Check) -> Check:
        """Register ``check`` under ``name`` (unique); returns it so it can be a decorator."""
        if any(existing == name for existing, _ in self.checks):
            raise ValueError(f"an invariant named {name!r} is already registered")
        self.checks.append((name, check))
        return check

    def extended(self) -> InvariantSet:
        """A copy to which a later layer can add its own checks."""
        return InvariantSet(list(self.checks))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.checks]

    def check(self, subject: Any) -> None:
        """Run every check in order; AssertionError naming the first broken invariant."""
        for name, fn in self.checks:
            try:
                fn(subject)
            except AssertionError as error:
                raise AssertionError(f"invariant {name!r} broken: {error}") from error


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# ---------------------------------------------------------------------------- pool
def _pool_refcounts(pool: BlockPool) -> None:
    for b in range(pool.num_blocks):
        _require(pool.refcount(b) == len(pool.owners(b)),
                 f"block {b}: refcount {pool.refcount(b)} != {len(pool.owners(b))} owners")


def _pool_free_set(pool: BlockPool) -> None:
    expected = {b for b in range(pool.num_blocks)
                if not pool.owners(b) and pool.fence_count(b) == 0}
    free = pool.free_blocks()
    _require(free == expected,
             f"free set {sorted(free)} != ownerless unfenced blocks {sorted(expected)}")
    pool.check_free_index()


def _pool_fences(pool: BlockPool) -> None:
    touching: Counter[int] = Counter()
    for (src, dst), count in Counter(pool.pending_copies()).items():
        touching[src] += count
        touching[dst] += count
    fences = {b: c for b in range(pool.num_blocks) if (c := pool.fence_count(b))}
    _require(fences == dict(touching),
             f"fences {fences} != pending copies per block {dict(touching)}")
    for b in fences:
        _require(not pool.is_free(b), f"block {b} is fenced by a pending copy but free")


POOL_INVARIANTS = InvariantSet()
POOL_INVARIANTS.add("refcount == owners", _pool_refcounts)
POOL_INVARIANTS.add("free blocks are exactly the ownerless unfenced ones", _pool_free_set)
POOL_INVARIANTS.add("pending copies fenced", _pool_fences)


# ---------------------------------------------------------------------------- radix
def _radix_structure(cache: RadixCache) -> None:
    seen_blocks: dict[int, Any] = {}
    for key, root in cache.roots():
        _require(root.parent is None and root.scope == key, f"root of scope {key!r} malformed")
        _require(bool(root.children), f"empty tree kept for scope {key!r}")
    for node in radix_nodes(cache):
        parent = node.parent
        _require(parent is not None and parent.children.get(node.chunk) is node,
                 f"node {node.node_id} not linked from its parent")
        _require(len(node.chunk) == cache.block_size,
                 f"node {node.node_id} holds {len(node.chunk)} tokens, not a whole block")
        _require(node.depth == parent.depth + 1, f"node {node.node_id} depth wrong")
        _require(node.block not in seen_blocks, f"block {node.block} indexed twice")
        seen_blocks[node.block] = node
        _require(cache.node_of(node.block) is node,
                 f"block index does not point to node {node.node_id}")
        children_locks = sum(c.lock_ref for c in node.children.values())
        _require(node.lock_ref >= children_locks,
                 f"node {node.node_id} lock {node.lock_ref} < children's {children_locks}")
    indexed = cache.indexed_blocks()
    _require(len(seen_blocks) == len(indexed),
             f"block index has {len(indexed)} entries, tree {len(seen_blocks)} nodes")
    leaves = {n for n in radix_nodes(cache) if n.lock_ref == 0 and not n.children}
    _require(leaves == cache.evictable_leaves(), "evictable-leaf set is stale")


def _radix_accounting(cache: RadixCache) -> None:
    nodes = list(radix_nodes(cache))
    locked = sum(1 for n in nodes if n.lock_ref > 0)
    _require(cache.protected_blocks() == locked,
             f"protected blocks {cache.protected_blocks()} != locked nodes {locked}")
    _require(cache.evictable_blocks() == len(nodes) - locked,
             f"evictable blocks {cache.evictable_blocks()} != unlocked nodes {len(nodes) - locked}")
    _require(cache.cached_tokens() == len(nodes) * cache.block_size,
             "cached token count wrong")


RADIX_INVARIANTS = InvariantSet()
RADIX_INVARIANTS.add("radix tree well formed", _radix_structure)
RADIX_INVARIANTS.add("cache accounting exact", _radix_accounting)


# ---------------------------------------------------------------------------- manager
def _mgr_pool(mgr) -> None:
    POOL_INVARIANTS.check(mgr.pool)


def _mgr_radix(mgr) -> None:
    if mgr.prefix_cache is not None:
        RADIX_INVARIANTS.check(mgr.prefix_cache)


def live_owners(mgr) -> list[set]:
    """Per block, the owners a KV manager's state implies: the requests whose tables hold it
    and :data:`CACHE_OWNER` when the prefix cache indexes it."""
    expected: list[set] = [set() for _ in range(mgr.pool.num_blocks)]
    for rid in mgr.requests():
        for b in request_blocks(mgr, rid):
            expected[b].add(rid)
    if mgr.prefix_cache is not None:
        for b in mgr.prefix_cache.indexed_blocks():
            expected[b].add(CACHE_OWNER)
    return expected


def request_blocks(mgr, request_id: str) -> list[int]:
    """Every block ``request_id`` holds: its table, or all its groups' (a hybrid manager)."""
    if isinstance(mgr, HybridKVCacheManager):
        return mgr.held_blocks(request_id)
    return mgr.block_table(request_id)


def _mgr_owners(mgr) -> None:
    pool: BlockPool = mgr.pool
    for rid in mgr.requests():
        table = request_blocks(mgr, rid)
        _require(len(set(table)) == len(table), f"tables of {rid!r} repeat a block")
    expected = live_owners(mgr)
    for b in range(pool.num_blocks):
        owners = set(pool.owners(b))
        _require(owners == expected[b],
                 f"block {b}: owners {owners} != table holders/cache {expected[b]}")


def _mgr_one_state(mgr) -> None:
    pool: BlockPool = mgr.pool
    free = owned = cached = 0
    free_set = pool.free_blocks()
    for b in range(pool.num_blocks):
        owners = pool.owners(b)
        kinds = [b in free_set, bool(owners - {CACHE_OWNER}), owners == {CACHE_OWNER}]
        _require(sum(kinds) <= 1, f"block {b} is in more than one of free/owned/cached")
        _require(sum(kinds) == 1 or pool.fence_count(b) > 0,
                 f"block {b} is in none of free/owned/cached and not fenced")
        free += kinds[0]
        owned += kinds[1]
        cached += kinds[2]
    parked = pool.num_blocks - free - owned - cached
    _require(all(pool.fence_count(b) > 0 for b in range(pool.num_blocks)
                 if not pool.owners(b) and b not in free_set),
             f"{parked} ownerless blocks neither free nor fenced")


def _mgr_locks(mgr) -> None:
    cache = mgr.prefix_cache
    if cache is None:
        _require(all(mgr.locked_node(r) is None for r in mgr.requests()),
                 "lock held without a cache")
        return
    expected: Counter = Counter()
    for rid in mgr.requests():
        node = mgr.locked_node(rid)
        _require(cache.is_alive(node), f"{rid!r} locks a node that was evicted")
        if node is not None:
            for n in node.path():
                expected[n.node_id] += 1
    for node in radix_nodes(cache):
        _require(node.lock_ref == expected[node.node_id],
                 f"node {node.node_id} (block {node.block}) lock {node.lock_ref} "
                 f"!= {expected[node.node_id]} requests on its path")
    for rid in mgr.requests():
        for b in mgr.block_table(rid):
            node = cache.node_of(b)
            _require(node is None or node.lock_ref > 0,
                     f"block {b} of {rid!r} is cached on an unlocked (evictable) node")


def _mgr_accounting(mgr) -> None:
    cache = mgr.prefix_cache
    pool: BlockPool = mgr.pool
    fenced_evictable = sum(1 for b in range(pool.num_blocks)
                           if pool.fence_count(b) > 0 and cache is not None
                           and cache.is_evictable(b))
    evictable = cache.evictable_blocks() if cache is not None else 0
    _require(pool.num_evictable() == evictable - fenced_evictable,
             f"pool evictable {pool.num_evictable()} != {evictable - fenced_evictable}")
    if cache is not None:
        only_cache = sum(1 for b in range(pool.num_blocks)
                         if pool.owners(b) == {CACHE_OWNER} and cache.is_evictable(b))
        _require(only_cache == evictable,
                 f"{evictable} evictable nodes but {only_cache} blocks held only by the cache "
                 "on unlocked nodes")
    _require(mgr.hit_tokens <= mgr.query_tokens, "more hit tokens than queried tokens")


def _mgr_pending(mgr) -> None:
    for src, dst in mgr.pool.pending_copies():
        for b in (src, dst):
            _require(not mgr.pool.is_free(b), f"block {b} of pending copy {(src, dst)} is free")


KV_MANAGER_INVARIANTS = InvariantSet()
KV_MANAGER_INVARIANTS.add("pool consistent", _mgr_pool)
KV_MANAGER_INVARIANTS.add("radix consistent", _mgr_radix)
KV_MANAGER_INVARIANTS.add("refcount == live owners", _mgr_owners)
KV_MANAGER_INVARIANTS.add("one state per block", _mgr_one_state)
KV_MANAGER_INVARIANTS.add("locks match requests; in-use blocks never evictable", _mgr_locks)
KV_MANAGER_INVARIANTS.add("evictable/protected accounting exact", _mgr_accounting)
KV_MANAGER_INVARIANTS.add("pending copies not free", _mgr_pending)


# ---------------------------------------------------------------------------- hybrid manager
def _hybrid_tables(mgr: HybridKVCacheManager) -> None:
    group_of: dict[int, int] = {}
    cache = mgr.prefix_cache
    for rid in mgr.requests():
        tables = mgr.block_tables(rid)
        _require(len({len(t) for t in tables}) == 1,
                 f"{rid!r}: its groups' tables differ in length {[len(t) for t in tables]}")
        for g, (table, window) in enumerate(zip(tables, mgr.windows, strict=True)):
            live = [i for i, b in enumerate(table) if b is not None]
            if not window:
                _require(len(live) == len(table), f"{rid!r}: full group {g} has a hole")
            _require(live == list(range(len(table) - len(live), len(table))),
                     f"{rid!r}: group {g}'s holes are not all before its live blocks")
            for b in table:
                if b is None:
                    continue
                _require(group_of.setdefault(b, g) == g,
                         f"block {b} is in group {g} of {rid!r} and group {group_of[b]} too")
                if cache is not None and cache.group_of(b) is not None:
                    _require(cache.group_of(b) == g,
                             f"block {b} of {rid!r}'s group {g} is cached for group "
                             f"{cache.group_of(b)}")


def _hybrid_bounded(mgr: HybridKVCacheManager) -> None:
    for rid in mgr.requests():
        for g, (table, window) in enumerate(zip(mgr.block_tables(rid), mgr.windows,
                                                strict=True)):
            slots = len(table) * mgr.block_size
            bound = window_blocks(window, slots, mgr.block_size, mgr.chunk_tokens or slots)
            held = sum(b is not None for b in table)
            _require(held <= bound, f"{rid!r} holds {held} blocks in window group {g} "
                                    f"(window {window}), more than its bound {bound}")


def _hybrid_tree(mgr: HybridKVCacheManager) -> None:
    cache = mgr.prefix_cache
    if cache is None:
        return
    for key, root in cache.roots():
        _require(root.parent is None and root.scope == key and root.alive,
                 f"root of scope {key!r} malformed")
        _require(bool(root.children), f"empty tree kept for scope {key!r}")
    seen = 0
    for node in cache.nodes():
        parent = node.parent
        _require(node.alive and parent is not None and parent.children.get(node.chunk) is node,
                 "a node is not linked from its parent")
        _require(len(node.chunk) == mgr.block_size and node.depth == parent.depth + 1,
                 f"node at depth {node.depth}: chunk of {len(node.chunk)} tokens or wrong depth")
        _require(bool(node.children) or any(b is not None for b in node.blocks),
                 f"an empty leaf at depth {node.depth} is kept")
        for g, b in enumerate(node.blocks):
            if b is not None:
                seen += 1
                _require(cache.node_of(b) is node and cache.group_of(b) == g,
                         f"block {b} (group {g}) is not indexed where the tree holds it")
    _require(seen == cache.num_cached_blocks(),
             f"the index has {cache.num_cached_blocks()} blocks, the tree {seen}")


def _hybrid_accounting(mgr: HybridKVCacheManager) -> None:
    cache, pool = mgr.prefix_cache, mgr.pool
    if cache is None:
        _require(pool.num_evictable() == 0, "evictable blocks without a cache")
        return
    alone = {b for b in cache.indexed_blocks() if pool.refcount(b) == 1}
    evictable = {b for b in cache.indexed_blocks() if cache.is_evictable(b)}
    _require(evictable == alone, f"evictable {sorted(evictable)} != blocks only the cache "
                                 f"holds {sorted(alone)}")
    _require(cache.evictable_blocks() == len(alone),
             f"evictable count {cache.evictable_blocks()} != {len(alone)}")
    fenced = sum(1 for b in alone if pool.is_fenced(b))
    _require(pool.num_evictable() == len(alone) - fenced,
             f"pool evictable {pool.num_evictable()} != {len(alone) - fenced}")
    _require(mgr.hit_tokens <= mgr.query_tokens, "more hit tokens than queried tokens")


HYBRID_KV_MANAGER_INVARIANTS = InvariantSet()
HYBRID_KV_MANAGER_INVARIANTS.add("pool consistent", _mgr_pool)
HYBRID_KV_MANAGER_INVARIANTS.add("tables per group", _hybrid_tables)
HYBRID_KV_MANAGER_INVARIANTS.add("refcount == live owners", _mgr_owners)
HYBRID_KV_MANAGER_INVARIANTS.add("one state per block", _mgr_one_state)
HYBRID_KV_MANAGER_INVARIANTS.add("window groups bounded", _hybrid_bounded)
HYBRID_KV_MANAGER_INVARIANTS.add("hybrid tree well formed", _hybrid_tree)
HYBRID_KV_MANAGER_INVARIANTS.add("evictable accounting exact", _hybrid_accounting)
HYBRID_KV_MANAGER_INVARIANTS.add("pending copies not free", _mgr_pending)


def check_pool(pool: BlockPool) -> None:
    POOL_INVARIANTS.check(pool)


def check_radix(cache: RadixCache) -> None:
    RADIX_INVARIANTS.check(cache)


def check_kv_manager(mgr) -> None:
    """The KV manager's invariants (a hybrid manager's own set); AssertionError naming the
    first broken one."""
    if isinstance(mgr, HybridKVCacheManager):
        HYBRID_KV_MANAGER_INVARIANTS.check(mgr)
    else:
        KV_MANAGER_INVARIANTS.check(mgr)


def check_scheduler(scheduler: Any) -> None:
    """A scheduler's invariants (spec rules 5 and 11): every non-terminal request is in exactly
    one queue (waiting: WAITING or PREEMPTED, no KV; running: RUNNING, holding a table), an
    ended request has a reason and no KV, token counters stay in range; then the KV manager's
    own invariants (a P/D wrapper: its parked requests' too). AssertionError naming the first
    broken one."""
    if isinstance(scheduler, RemoteKVScheduler):
        check_scheduler(scheduler.inner)
        scheduler.check_parked()
        return
    waiting, running = set(scheduler.waiting), set(scheduler.running)
    assert len(waiting) == len(scheduler.waiting), "a request is twice in the waiting queue"
    assert len(running) == len(scheduler.running), "a request is twice in the running queue"
    assert not waiting & running, f"in both queues: {sorted(waiting & running)}"
    for rid, request in ((r.request_id, r) for r in scheduler.requests()):
        status = request.status
        if status in WAITING_STATUSES:
            assert rid in waiting, f"{rid} is {status.value} but not in the waiting queue"
        elif status in RUNNING_STATUSES:
            assert rid in running, f"{rid} is {status.value} but not in the running queue"
        else:
            assert rid not in waiting and rid not in running, f"{rid} ended but is queued"
            assert request.finish_reason is not None, f"{rid} ended without a reason"
        holds = scheduler.kv.has(rid)
        if status in RUNNING_STATUSES:
            assert holds, f"running request {rid} holds no KV"
        else:
            assert not holds, f"{rid} is {status.value} but still holds KV"
        assert 0 <= request.num_computed_tokens <= request.num_tokens, \
            f"{rid}: num_computed_tokens out of range"
        assert len(request.output_token_ids) <= request.max_tokens, \
            f"{rid}: more outputs than max_tokens"
        in_flight = request.num_output_placeholders   # (overlap scheduling)
        assert request.output_token_ids.count(PLACEHOLDER) == in_flight and all(
            t == PLACEHOLDER for t in request.output_token_ids[len(request.output_token_ids)
                                                              - in_flight:]), \
            f"{rid}: placeholders other than its last {in_flight} outputs"
        assert not in_flight or rid in scheduler.inflight_ids, \
            f"{rid}: {in_flight} placeholder outputs but no step in flight"
    check_kv_manager(scheduler.kv)
