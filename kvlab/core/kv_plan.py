"""What an admission needs from the KV pool, computed once for the check and for the admit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block_pool import BlockPool
from .radix import PrefixMatch, RadixCache


@dataclass(frozen=True)
class AdmitPlan:
    """What :meth:`~kvlab.core.kv_manager.KVCacheManager.admit` would do: reuse ``hit_blocks``
    (``cached`` tokens), allocate ``fresh`` blocks, and lock ``lock_cost`` cached blocks that
    are evictable now (locking takes them out of the allocatable count)."""

    match: PrefixMatch | None
    cached: int
    hit_blocks: tuple[int, ...]
    fresh: int
    lock_cost: int

    @property
    def needed(self) -> int:
        """Allocatable blocks the admission consumes (fresh ones + evictable ones it locks)."""
        return self.fresh + self.lock_cost


def plan_admission(pool: BlockPool, cache: RadixCache | None, total_blocks: int, key: tuple,
                   token_ids: Sequence[int]) -> AdmitPlan:
    """The plan for a table of ``total_blocks`` blocks whose tokens begin with ``token_ids``,
    reusing the cached prefix in scope ``key`` (none without a cache)."""
    if cache is None:
        return AdmitPlan(None, 0, (), total_blocks, 0)
    match = cache.match(key, token_ids)
    hit = tuple(match.blocks)
    lock_cost = sum(1 for b in hit if cache.is_evictable(b) and not pool.is_fenced(b))
    return AdmitPlan(match, match.num_tokens, hit, max(0, total_blocks - len(hit)), lock_cost)
