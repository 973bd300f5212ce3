"""The prefix cache of the hybrid KV cache manager (:mod:`.hybrid_kv_cache_manager`): one
radix tree per scope over block-sized chunks of tokens, as :class:`~.radix_cache.RadixCache`,
whose nodes hold one block **per KV cache group** (or none: a group may have dropped it).

What differs from the single-layout tree, and why:

* **A node is a chunk, not a block.** Chunk ``i`` of a prompt has a block in each group that
  cached it. A sliding-window group frees the blocks that fall out of a request's window while
  the request runs (they stay cached until evicted), so its blocks along a path have holes; a
  full-attention group's never do while its requests run.
* **Evictable = held by the cache alone**, in any group, least recently released first (vLLM
  v1's rule: a cached block whose reference count drops to zero joins the free queue, which
  evicts from its head, ``vllm/v1/core/block_pool.py`` in v0.32.0), instead of the unlocked
  leaves of the single-layout tree: a window group's hole may sit anywhere on a path, so "leaf
  first" means nothing there. The manager tells the cache which cached blocks it touched
  (:meth:`HybridPrefixCache.refresh`), so the count stays exact and O(1).
* **Hits follow each group's rule** (:mod:`.hybrid_kv_cache_manager`): a full-attention group
  needs every block of the prefix, a window group only the blocks inside the window of the
  first token to compute. An evicted full-attention block cuts every group's hit there: no
  group is ever served beyond what all of them can serve.

A node with no block and no child is removed. The cache owns no memory: the manager moves the
block references (:data:`~.block_pool.CACHE_OWNER`) and asks the pool for reference counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvlab.core.block_pool import BlockPool
from kvlab.core.cache_scope import CacheScope
from kvlab.core.radix_cache import scope_key

__all__ = ["HybridNode", "HybridPrefixCache", "InsertOutcome"]


class HybridNode:
    """Chunk ``chunk`` of the path to it (depth ``depth``, the root 0): ``blocks[g]``, group
    ``g``'s block holding its KV, or None. ``alive`` is False once the node left the tree."""

    __slots__ = ("alive", "blocks", "children", "chunk", "depth", "parent", "scope")

    def __init__(self, scope: tuple, parent: HybridNode | None, chunk: tuple, groups: int):
        self.scope, self.parent, self.chunk = scope, parent, chunk
        self.depth = 0 if parent is None else parent.depth + 1
        self.blocks: list[int | None] = [None] * groups
        self.children: dict[tuple, HybridNode] = {}
        self.alive = True


@dataclass(frozen=True)
class InsertOutcome:
    """:meth:`HybridPrefixCache.insert`'s answer: the walk reached ``node`` (depth ``depth``:
    the chunks cached in every full-attention group), indexing ``new_blocks`` (the caller gives
    the cache a reference on each); ``owned``: every full-attention block on the path is the
    caller's own (none kept from another writer)."""

    node: HybridNode | None
    depth: int
    new_blocks: tuple[int, ...]
    owned: bool


class HybridPrefixCache:
    """Radix trees of chunks holding one block per group (contract: the module docstring).
    ``windows[g]``: group ``g``'s sliding window (0: full attention)."""

    def __init__(self, block_size: int, windows: Sequence[int], pool: BlockPool):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.windows = tuple(windows)
        self.pool = pool
        self._roots: dict[tuple, HybridNode] = {}
        self._where: dict[int, tuple[HybridNode, int]] = {}   # block -> (node, group)
        self._unheld: set[int] = set()         # indexed blocks only the cache holds
        self._stamp: dict[int, int] = {}       # block -> when it last became unheld
        self._heap: list[tuple[int, int]] = []  # lazy LRU heap of (stamp, block)
        self._clock = 0

    # ------------------------------------------------------------------ reading
    def match(self, scope: CacheScope | tuple, token_ids: Sequence[int]) -> list[HybridNode]:
        """The nodes of the longest path spelling whole chunks of ``token_ids[:-1]`` (the last
        token is always computed), root excluded; no side effects."""
        bs = self.block_size
        node = self._roots.get(scope_key(scope))
        path: list[HybridNode] = []
        if node is not None:
            for i in range(max(0, len(token_ids) - 1) // bs):
                node = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
                if node is None:
                    break
                path.append(node)
        return path

    def indexed_blocks(self) -> list[int]:
        """Every block the trees index (each at one node, in one group)."""
        return list(self._where)

    def num_cached_blocks(self) -> int:
        return len(self._where)

    def group_of(self, block: int) -> int | None:
        """The group whose KV ``block`` caches, or None if it is not indexed."""
        where = self._where.get(block)
        return None if where is None else where[1]

    def node_of(self, block: int) -> HybridNode | None:
        where = self._where.get(block)
        return None if where is None else where[0]

    def roots(self) -> list[tuple[tuple, HybridNode]]:
        return list(self._roots.items())

    def nodes(self) -> Iterator[HybridNode]:
        """Every node below the roots, parents before children."""
        for _, root in self._roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    # ------------------------------------------------------------------ evictor (BlockPool)
    def evictable_blocks(self) -> int:
        """Indexed blocks held by the cache alone (all can be evicted now)."""
        return len(self._unheld)

    def is_evictable(self, block: int) -> bool:
        return block in self._unheld

    def evict(self, num_blocks: int) -> list[int]:
        """Forget up to ``num_blocks`` blocks held by the cache alone, least recently released
        first; their ids (the pool then drops the cache's reference)."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        evicted: list[int] = []
        while len(evicted) < num_blocks and self._unheld:
            stamp, block = heapq.heappop(self._heap)
            if block not in self._unheld or self._stamp[block] != stamp:
                continue                      # a stale entry: held again, or re-stamped
            node, group = self._where.pop(block)
            self._unheld.discard(block)
            del self._stamp[block]
            node.blocks[group] = None
            self._prune(node)
            evicted.append(block)
        return evicted

    def refresh(self, blocks: Sequence[int]) -> None:
        """The caller changed who holds ``blocks`` (a hit shared, a request released, a
        copy-on-write moved off them): re-read their reference counts. Blocks that became
        held by the cache alone are the most recently released, in the order given (so pass a
        request's blocks tail first: its tail is then evicted first, as vLLM frees them)."""
        for block in blocks:
            if block not in self._where:
                continue
            if self.pool.refcount(block) == 1:
                if block not in self._unheld:
                    self._clock += 1
                    self._unheld.add(block)
                    self._stamp[block] = self._clock
                    heapq.heappush(self._heap, (self._clock, block))
            else:
                self._unheld.discard(block)
        if len(self._heap) > 2 * len(self._unheld) + 64:   # drop the stale entries
            self._heap = [(self._stamp[b], b) for b in self._unheld]
            heapq.heapify(self._heap)

    # ------------------------------------------------------------------ writing
    def insert(self, scope: CacheScope | tuple, token_ids: Sequence[int],
               tables: Sequence[Sequence[int | None]], num_chunks: int,
               cacheable: Callable[[int], bool], *, below: HybridNode | None = None
               ) -> InsertOutcome:
        """Index chunk ``i < num_chunks`` of ``token_ids`` with ``tables[g][i]`` for each group
        ``g`` whose node slot is empty and whose block is ``cacheable`` (an existing block
        stays: first writer wins), walking from the root, or from ``below`` (a live node whose
        path spells the chunks before it, all full-attention blocks the caller's own). A
        full-attention group must have a block at every node of a path, so the walk stops at
        the first chunk where one has none and cannot take the caller's."""
        key = scope_key(scope)
        bs, groups = self.block_size, len(self.windows)
        assert len(tables) == groups and len(token_ids) >= num_chunks * bs
        full = [g for g, w in enumerate(self.windows) if not w]

        def takes(block: int | None) -> bool:   # the slot may take the caller's block
            return block is not None and block not in self._where and cacheable(block)

        node = below
        if node is None or not node.alive:
            node = self._roots.get(key)
            if node is None:
                node = self._roots[key] = HybridNode(key, None, (), groups)
        new: list[int] = []
        owned = True
        for i in range(node.depth, num_chunks):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            child = node.children.get(chunk)
            if any((child is None or child.blocks[g] is None) and not takes(tables[g][i])
                   for g in full):
                break
            if child is None:
                child = node.children[chunk] = HybridNode(key, node, chunk, groups)
            for g in range(groups):
                if child.blocks[g] is None:
                    if takes(tables[g][i]):
                        child.blocks[g] = tables[g][i]
                        self._where[tables[g][i]] = (child, g)
                        new.append(tables[g][i])
                elif g in full and child.blocks[g] != tables[g][i]:
                    owned = False       # the caller keeps a duplicate of another's block
            node = child
        depth = node.depth
        self._prune(node)
        return InsertOutcome(node if node.alive and node.parent is not None else None, depth,
                             tuple(new), owned)

    # ------------------------------------------------------------------ internals
    def _prune(self, node: HybridNode) -> None:
        """Remove ``node`` and its ancestors while they hold no block and have no child."""
        while node.parent is not None and not node.children and all(
                b is None for b in node.blocks):
            parent = node.parent
            del parent.children[node.chunk]
            node.alive = False
            node = parent
        if node.parent is None and not node.children and self._roots.get(node.scope) is node:
            del self._roots[node.scope]
            node.alive = False

    def state_tuple(self) -> tuple:
        """Everything observable, as comparable plain data (for before/after tests)."""
        nodes = []
        for key, root in self._roots.items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                for chunk, child in node.children.items():
                    nodes.append((repr(key), (*path, chunk), tuple(child.blocks)))
                    stack.append((child, (*path, chunk)))
        return (tuple(sorted(nodes)), tuple(sorted(self._stamp.items())), self._clock)
