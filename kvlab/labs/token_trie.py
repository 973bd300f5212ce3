"""TokenTrie: the production twin of the reference ``PrefixCache`` (spec rule 4).

Contract — identical to :class:`kvlab.reference.PrefixCache` on any sequence of calls (a
differential test in ``tests/test_radix.py`` checks it):

* ``put(scope, token_ids, block_table)`` stores ``tuple(block_table)`` under the key
  ``(scope, tuple(token_ids))``; a second ``put`` of the same key overwrites.
* ``longest(scope, token_ids)`` returns ``(n, table)`` for the longest stored key of that exact
  scope whose tokens are a prefix of the query, or ``(0, ())`` when none (an empty key never
  matches).

Instead of scanning every entry, it walks a path-compressed trie over token ids, one per scope
(scopes are compared by :func:`~.radix_cache.scope_key`), so a lookup costs O(length of the
match), independent of the number of entries. The engine's block-granular prefix cache, with
locking and eviction, is :class:`kvlab.core.radix_cache.RadixCache`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.core.cache_scope import CacheScope
from kvlab.core.radix_cache import scope_key

__all__ = ["TokenTrie"]

_MISSING = object()


class _Node:
    """A trie node: ``edge`` is the token run leading to it; ``value`` a stored table or missing."""

    __slots__ = ("children", "edge", "value")

    def __init__(self, edge: tuple):
        self.edge = edge
        self.children: dict = {}
        self.value = _MISSING


def _common_prefix_len(a: tuple, b: tuple, start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class TokenTrie:
    """Exact-scope longest-prefix map from token sequences to block tables (see module doc)."""

    def __init__(self) -> None:
        self._roots: dict[tuple, _Node] = {}
        self._num_entries = 0

    def put(self, scope: CacheScope | tuple, token_ids: Sequence[int], block_table) -> None:
        """Store ``block_table`` under ``(scope, tuple(token_ids))`` (overwrites, like the ref)."""
        key = scope_key(scope)
        tokens = tuple(token_ids)
        table = tuple(block_table)
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = _Node(())
        node, i = root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tokens[i:])
                node.children[tokens[i]] = leaf
                node, i = leaf, len(tokens)
                break
            common = _common_prefix_len(child.edge, tokens, i)
            if common < len(child.edge):  # split the edge where the new key leaves it
                mid = _Node(child.edge[:common])
                child.edge = child.edge[common:]
                mid.children[child.edge[0]] = child
                node.children[tokens[i]] = mid
                child = mid
            node, i = child, i + common
        if node.value is _MISSING:
            self._num_entries += 1
        node.value = table

    def longest(self, scope: CacheScope | tuple, token_ids: Sequence[int]) -> tuple[int, tuple]:
        """``(matched_tokens, block_table)`` of the longest stored prefix, or ``(0, ())``."""
        root = self._roots.get(scope_key(scope))
        best: tuple[int, tuple] = (0, ())
        if root is None:
            return best
        tokens = tuple(token_ids)
        node, i = root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            edge = child.edge
            if tokens[i:i + len(edge)] != edge:
                break  # keys end only at nodes, so nothing deeper can match
            node, i = child, i + len(edge)
            if node.value is not _MISSING:
                best = (i, node.value)
        return best

    @property
    def num_entries(self) -> int:
        """Number of distinct keys stored through :meth:`put`."""
        return self._num_entries

    def state_tuple(self) -> tuple:
        """Every stored ``(scope, tokens, table)``, sorted, as comparable plain data."""
        entries = []
        for key, root in self._roots.items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                full = path + node.edge
                if node.value is not _MISSING:
                    entries.append((repr(key), full, node.value))
                stack.extend((child, full) for child in node.children.values())
        return tuple(sorted(entries))
