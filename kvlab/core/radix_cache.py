"""The prefix cache: block-granular radix trees, one per compatibility scope (spec rule 4). A
node is one full block of tokens and the physical block holding their KV; its path from the
root spells the whole prefix. Requests lock their path while they run; eviction drops unlocked
leaves, least recently used first. It owns no memory: the KV cache manager moves the block
references. Chapter 4 explains.

An optional :class:`CacheListener` hears every change of the indexed set as it happens: the
nodes an insert adds (a chain under one parent), each node eviction drops, and a clear. The
engine's KV-event publisher is one (chapter 13); with no listener the cache does no extra work.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvlab.core.cache_scope import CacheScope


def scope_key(scope: CacheScope | tuple | list) -> tuple:
    """A scope as a dict key: a CacheScope's :meth:`~CacheScope.key`, else ``tuple(scope)``
    as the reference ``PrefixCache`` does; TypeError when that is not hashable."""
    key = scope.key() if isinstance(scope, CacheScope) else tuple(scope)
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"cache scope must be hashable, got {key!r}") from None
    return key


class RadixNode:
    """One cached block: ``chunk`` (its tokens) under ``parent``, KV in physical ``block``."""

    __slots__ = ("block", "children", "chunk", "depth", "last_access", "lock_ref", "node_id",
                 "parent", "scope")

    def __init__(self, node_id: int, scope: tuple, parent: RadixNode | None, chunk: tuple,
                 block: int, depth: int):
        self.node_id = node_id
        self.scope = scope
        self.parent = parent
        self.chunk = chunk
        self.block = block
        self.depth = depth  # blocks from the root (the root is 0)
        self.children: dict[tuple, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path(self) -> list[RadixNode]:
        """Nodes from just below the root down to this node."""
        nodes = []
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes


class CacheListener(Protocol):
    """What a :class:`RadixCache` reports, in the order it happens. ``stored(nodes)``: a chain of
    new nodes, ``nodes[0]`` under ``nodes[0].parent`` (the root when it starts a prefix), each
    the parent of the next. ``removed(node)``: an evicted node, always a leaf, its parent still
    in the tree. ``cleared()``: every node is gone. Listeners must not change the cache."""

    def stored(self, nodes: Sequence[RadixNode]) -> None: ...
    def removed(self, node: RadixNode) -> None: ...
    def cleared(self) -> None: ...


@dataclass(frozen=True)
class PrefixMatch:
    """:meth:`RadixCache.match`'s answer: ``num_tokens`` cached tokens in ``blocks``; ``node``
    the handle to lock (None: no match); ``unlocked_blocks`` of them are evictable now."""

    num_tokens: int
    blocks: tuple[int, ...]
    node: RadixNode | None
    unlocked_blocks: int


@dataclass(frozen=True)
class InsertResult:
    """Result of :meth:`RadixCache.insert`: the deepest node of the path and adopted blocks."""

    node: RadixNode | None
    new_blocks: tuple[int, ...]


class RadixCache:
    """Block-granular prefix cache, one radix tree per scope (contract: the module docstring)."""

    def __init__(self, block_size: int = 16):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self._roots: dict[tuple, RadixNode] = {}
        self._block_node: dict[int, RadixNode] = {}
        self._num_locked = 0
        self._clock = 0
        self._next_id = 0
        self._leaves: set[RadixNode] = set()  # unlocked non-root nodes without children
        self._heap: list[tuple[int, int, RadixNode]] = []  # lazy LRU heap over self._leaves
        self.listener: CacheListener | None = None

    def match(self, scope: CacheScope | tuple, token_ids: Sequence[int], *,
              leave_last: bool = True) -> PrefixMatch:
        """Longest cached path for ``token_ids`` in ``scope``, whole blocks, no side effects; with
        ``leave_last`` at most ``len(token_ids) - 1`` tokens (the last one is always computed)."""
        bs = self.block_size
        root = self._roots.get(scope_key(scope))
        limit = len(token_ids) - 1 if leave_last else len(token_ids)
        max_blocks = max(0, limit) // bs
        blocks: list[int] = []
        unlocked = 0
        node = root
        if root is not None:
            for i in range(max_blocks):
                child = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
                if child is None:
                    break
                blocks.append(child.block)
                unlocked += child.lock_ref == 0
                node = child
        return PrefixMatch(len(blocks) * bs, tuple(blocks),
                           node if blocks else None, unlocked)

    def roots(self) -> list[tuple[tuple, RadixNode]]:
        """``(scope key, root node)`` of every scope that has a tree."""
        return list(self._roots.items())

    def indexed_blocks(self) -> list[int]:
        """Every block the tree indexes (one node each)."""
        return list(self._block_node)

    def evictable_leaves(self) -> frozenset[RadixNode]:
        """The unlocked leaves eviction chooses from (kept incrementally)."""
        return frozenset(self._leaves)

    def num_cached_blocks(self) -> int:
        """Blocks indexed by the tree (each holds ``block_size`` cached tokens)."""
        return len(self._block_node)

    def cached_tokens(self) -> int:
        return len(self._block_node) * self.block_size

    def evictable_blocks(self) -> int:
        """Blocks on unlocked nodes: all of them can be evicted, leaves first."""
        return len(self._block_node) - self._num_locked

    def protected_blocks(self) -> int:
        """Blocks on locked nodes (in use by some request's path)."""
        return self._num_locked

    def is_evictable(self, block: int) -> bool:
        node = self._block_node.get(block)
        return node is not None and node.lock_ref == 0

    def contains_block(self, block: int) -> bool:
        return block in self._block_node

    def node_of(self, block: int) -> RadixNode | None:
        return self._block_node.get(block)

    def is_alive(self, node: RadixNode | None) -> bool:
        """Whether ``node`` (a handle from match/insert) is still in the tree."""
        if node is None:
            return True
        if node.is_root:
            return self._roots.get(node.scope) is node
        return self._block_node.get(node.block) is node

    def scopes(self) -> list[tuple]:
        """Scopes with at least one cached block."""
        return list(self._roots)

    def insert(self, scope: CacheScope | tuple, token_ids: Sequence[int],
               blocks: Sequence[int], *, below: RadixNode | None = None) -> InsertResult:
        """Index ``blocks[i]`` as the KV of ``token_ids[i*bs:(i+1)*bs]`` (under ``below``, a live
        node whose path spells the preceding tokens, else from the root). An existing path keeps
        its block (first writer wins); returns the deepest node and the newly indexed blocks,
        which the caller must give the cache a reference on. ValueError: cache unchanged."""
        key = scope_key(scope)
        if below is not None:
            self._check_alive(below)
            if below.scope != key:
                raise ValueError("insert(below=...): the node belongs to another scope")
        bs = self.block_size
        blocks = list(blocks)
        if len(token_ids) < len(blocks) * bs:
            raise ValueError(
                f"{len(blocks)} blocks need {len(blocks) * bs} tokens, got {len(token_ids)}"
            )
        for block in blocks:
            if not isinstance(block, int) or isinstance(block, bool) or block < 0:
                raise ValueError(f"block ids must be non-negative ints, got {block!r}")
        if len(set(blocks)) != len(blocks):
            raise ValueError("one block table cannot contain duplicate blocks")
        chunks = [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(len(blocks))]
        # dry run: how far does the path exist already?
        root = below if below is not None else self._roots.get(key)
        node, existing = root, 0
        if root is not None:
            for chunk in chunks:
                child = node.children.get(chunk)
                if child is None:
                    break
                node, existing = child, existing + 1
        new_blocks = tuple(blocks[existing:])
        for block in new_blocks:
            if block in self._block_node:
                raise ValueError(f"block {block} is already cached under another path")
        if not blocks:
            return InsertResult(None, ())
        # mutate
        if root is None:
            root = self._roots[key] = self._new_node(key, None, (), -1)
        node = root
        created: list[RadixNode] = []
        for i, chunk in enumerate(chunks):
            child = node.children.get(chunk)
            if child is None:
                child = self._new_node(key, node, chunk, blocks[i])
                self._leaves.discard(node)
                node.children[chunk] = child
                self._block_node[blocks[i]] = child
                created.append(child)
            node = child
        self._touch(node)
        if created and self.listener is not None:
            self.listener.stored(created)
        return InsertResult(node, new_blocks)

    def lock(self, node: RadixNode | None) -> None:
        """Protect the path from the root to ``node`` from eviction (re-entrant; counts)."""
        self._check_alive(node)
        if node is None:
            return
        for n in node.path():
            if n.lock_ref == 0:
                self._num_locked += 1
                self._leaves.discard(n)
            n.lock_ref += 1

    def unlock(self, node: RadixNode | None) -> None:
        """Undo one :meth:`lock` of ``node``; the path becomes most recently used."""
        self._check_alive(node)
        if node is None:
            return
        path = node.path()
        if any(n.lock_ref <= 0 for n in path):
            raise ValueError("unlock of a path that is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_locked -= 1
        self._touch(node)

    def evict(self, num_blocks: int) -> list[int]:
        """Forget up to ``num_blocks`` unlocked leaves, least recently used first; their blocks."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        evicted: list[int] = []
        while len(evicted) < num_blocks and self._leaves:
            last_access, _, node = heapq.heappop(self._heap)
            if node not in self._leaves or node.last_access != last_access:
                continue  # stale heap entry
            self._leaves.discard(node)
            parent = node.parent
            del parent.children[node.chunk]
            del self._block_node[node.block]
            evicted.append(node.block)
            if self.listener is not None:
                self.listener.removed(node)
            if parent.is_root:
                if not parent.children:
                    del self._roots[parent.scope]
            else:
                self._refresh_leaf(parent)
        return evicted

    def clear(self) -> list[int]:
        """Forget every cached block (vLLM's ``reset_prefix_cache``) and return them; the caller
        drops the cache's reference on each. ValueError, cache unchanged, while a path is locked
        (a running request reads those blocks)."""
        if self._num_locked:
            raise ValueError(f"cannot clear the prefix cache: {self._num_locked} cached blocks "
                             "are locked by running requests")
        blocks = list(self._block_node)
        self._roots.clear()
        self._block_node.clear()
        self._leaves.clear()
        self._heap.clear()
        if self.listener is not None:
            self.listener.cleared()
        return blocks

    def state_tuple(self) -> tuple:
        """Everything observable, as comparable plain data (for before/after tests)."""
        engine = []
        for key, root in self._roots.items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                for chunk, child in node.children.items():
                    cpath = (*path, chunk)
                    engine.append((repr(key), cpath, child.block, child.lock_ref,
                                   child.last_access))
                    stack.append((child, cpath))
        return (tuple(sorted(engine)), self._clock, self._num_locked)

    def _new_node(self, scope: tuple, parent: RadixNode | None, chunk: tuple,
                  block: int) -> RadixNode:
        self._next_id += 1
        depth = 0 if parent is None else parent.depth + 1
        return RadixNode(self._next_id, scope, parent, chunk, block, depth)

    def _touch(self, node: RadixNode) -> None:
        """Stamp the path to ``node`` with a new clock value (most recently used)."""
        self._clock += 1
        for n in node.path():
            n.last_access = self._clock
        # ancestors have children, so only the deepest node can be an evictable leaf
        self._refresh_leaf(node)

    def _refresh_leaf(self, node: RadixNode) -> None:
        """Keep ``node``'s membership in the evictable-leaf set (and heap) up to date."""
        if node.lock_ref == 0 and not node.children and not node.is_root:
            self._leaves.add(node)
            heapq.heappush(self._heap, (node.last_access, node.node_id, node))
            if len(self._heap) > 2 * len(self._leaves) + 64:
                self._heap = [(n.last_access, n.node_id, n) for n in self._leaves]
                heapq.heapify(self._heap)
        else:
            self._leaves.discard(node)

    def _check_alive(self, node: RadixNode | None) -> None:
        if node is not None and not isinstance(node, RadixNode):
            raise TypeError(f"expected a node handle from match()/insert(), got {node!r}")
        if not self.is_alive(node):
            raise ValueError("node handle is no longer in the cache (evicted)")
