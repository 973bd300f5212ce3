"""Spec rule 4 — prefix reuse: the reference ``PrefixCache``, a deliberate linear scan.

A key binds an immutable compatibility ``scope`` (model/weights version, tokenizer/template,
adapter, RoPE, dtype/layout/quantisation schema, security domain, ...) to the exact token ids.
A hit requires the scope to match exactly; the production radix tree keeps that contract.
Its production twin is :class:`kvlab.labs.token_trie.TokenTrie`; the engine's block-granular
prefix cache is :class:`kvlab.core.radix_cache.RadixCache`.
"""

from __future__ import annotations

__all__ = ["PrefixCache"]


class PrefixCache:
    """Reference prefix cache: ``longest`` scans every entry (O(entries · length))."""

    def __init__(self):
        self.entries = {}

    def put(self, scope, token_ids, block_table) -> None:
        """scope is an immutable compatibility tuple."""
        key = (tuple(scope), tuple(token_ids))
        self.entries[key] = tuple(block_table)

    def longest(self, scope, token_ids):
        """Return ``(matched_tokens, block_table)`` of the longest cached prefix, or ``(0, ())``."""
        scope, token_ids = tuple(scope), tuple(token_ids)
        best = (0, ())
        for (entry_scope, prefix), table in self.entries.items():
            if entry_scope == scope and len(prefix) > best[0] and token_ids[:len(prefix)] == prefix:
                best = (len(prefix), table)
        return best
