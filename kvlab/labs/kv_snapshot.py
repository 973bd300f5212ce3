"""Plain-data pictures of the KV cache manager and its radix tree, for figures and checks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlab.core.cache_scope import CacheScope
from kvlab.core.radix_cache import scope_key

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.radix_cache import RadixCache, RadixNode


@dataclass(frozen=True)
class RadixNodeView:
    """Plain-data view of one tree node (for figures)."""

    node_id: int
    parent_id: int | None
    depth: int
    chunk: tuple[int, ...]
    block: int
    lock_ref: int
    last_access: int


@dataclass(frozen=True)
class RadixSnapshot:
    """Plain-data view of the tree of one scope; ``nodes`` in depth-first order."""

    block_size: int
    scope: tuple
    nodes: tuple[RadixNodeView, ...]


@dataclass(frozen=True)
class KVSnapshot:
    """A plain-data picture of the manager (drawn by kvlab.viz.blocks.pool_figure).

    ``block_states[b]`` is one of ``free, exclusive, shared, cached, pending_copy``;
    ``refcounts[b]`` counts live owners including the prefix cache; ``block_owners[b]`` names them
    (the cache as ``"<prefix-cache>"``). ``tables`` maps request id to its block table.
    Counters: ``hit_tokens`` / ``query_tokens`` over admissions (prompt tokens served from the
    cache / prompt tokens admitted), ``hit_requests`` / ``miss_requests`` (admissions with / without
    a cached block).
    """

    num_blocks: int
    block_size: int
    block_states: tuple[str, ...]
    refcounts: tuple[int, ...]
    block_owners: tuple[tuple[str, ...], ...]
    tables: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pending_copies: tuple[tuple[int, int], ...] = ()
    cached_blocks: int = 0
    cached_tokens: int = 0
    evictable_blocks: int = 0
    protected_blocks: int = 0
    free_blocks: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    hit_requests: int = 0
    miss_requests: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served by the prefix cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def count(self, state: str) -> int:
        return sum(1 for s in self.block_states if s == state)


def snapshot_of(kv: KVCacheManager) -> KVSnapshot:
    """The manager's picture, from its public accessors."""
    pool = kv.pool
    cache = kv.prefix_cache
    return KVSnapshot(
        num_blocks=kv.num_blocks,
        block_size=kv.block_size,
        block_states=tuple(pool.state(b) for b in range(kv.num_blocks)),
        refcounts=tuple(pool.refcount(b) for b in range(kv.num_blocks)),
        block_owners=tuple(tuple(sorted(str(o) for o in pool.owners(b)))
                           for b in range(kv.num_blocks)),
        tables={rid: tuple(kv.block_table(rid)) for rid in sorted(kv.requests())},
        pending_copies=tuple(pool.pending_copies()),
        cached_blocks=cache.num_cached_blocks() if cache else 0,
        cached_tokens=cache.cached_tokens() if cache else 0,
        evictable_blocks=pool.num_evictable(),
        protected_blocks=cache.protected_blocks() if cache else 0,
        free_blocks=pool.num_free(),
        hit_tokens=kv.hit_tokens,
        query_tokens=kv.query_tokens,
        hit_requests=kv.hit_requests,
        miss_requests=kv.miss_requests,
    )


def radix_snapshot(cache: RadixCache, scope: CacheScope | tuple) -> RadixSnapshot:
    """Plain-data tree of ``scope`` (depth-first, children in chunk order)."""
    key = scope_key(scope)
    views: list[RadixNodeView] = []

    def visit(node) -> None:
        for chunk in sorted(node.children):
            child = node.children[chunk]
            views.append(RadixNodeView(
                child.node_id, None if node.is_root else node.node_id, child.depth,
                child.chunk, child.block, child.lock_ref, child.last_access))
            visit(child)

    for root_key, root in cache.roots():
        if root_key == key:
            visit(root)
    return RadixSnapshot(cache.block_size, key, tuple(views))


def radix_nodes(cache: RadixCache) -> Iterator[RadixNode]:
    """Every non-root node of the tree, any order (for invariant checks)."""
    for _, root in cache.roots():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
