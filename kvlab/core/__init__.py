"""kvlab.core: the metadata layer of the engine, pure Python, never imports torch.

It decides *what* runs: capacities, page tables, block ownership, prefix reuse, request
states, batches, P/D descriptors and metrics. Tensors live in :mod:`kvlab.engine`.

The torch-free reference listings of the specification live in :mod:`kvlab.reference` and are
re-exported here (the very same objects); every other name is a production version the engine
uses, tested against them.
"""

from kvlab.reference import (
    ALLOWED,
    REQUIRED_KV_FIELDS,
    BlockAllocator,
    Phase,
    PrefixCache,
    Request,
    build_batch,
    effective_bits,
    goodput,
    kv_bytes,
    physical_slot,
    validate_kv_descriptor,
)

from .baseline_scheduler import BaselineScheduler
from .block_pool import CACHE_OWNER, BlockPool
from .cache_scope import SCOPE_FIELDS, CacheScope
from .engine_core import ScheduledChunk, SchedulerOutput
from .event_log import EventLog
from .invariants import KV_MANAGER_INVARIANTS, InvariantSet, check_kv_manager
from .kv_cache_manager import KVCacheManager
from .kv_snapshot import KVSnapshot, RadixSnapshot, radix_snapshot
from .paging import BlockTable, block_table_array, slot_mapping, slots_for
from .production_scheduler import ProductionScheduler
from .radix_cache import PrefixMatch, RadixCache, scope_key
from .request import TRANSITIONS, FinishReason, Lifecycle, RequestStatus, RuntimeRequest
from .scheduler_config import SchedulerConfig
from .token_trie import TokenTrie

__all__ = [
    "ALLOWED",
    "CACHE_OWNER",
    "KV_MANAGER_INVARIANTS",
    "REQUIRED_KV_FIELDS",
    "SCOPE_FIELDS",
    "TRANSITIONS",
    "BaselineScheduler",
    "BlockAllocator",
    "BlockPool",
    "BlockTable",
    "CacheScope",
    "EventLog",
    "FinishReason",
    "InvariantSet",
    "KVCacheManager",
    "KVSnapshot",
    "Lifecycle",
    "Phase",
    "PrefixCache",
    "PrefixMatch",
    "ProductionScheduler",
    "RadixCache",
    "RadixSnapshot",
    "Request",
    "RequestStatus",
    "RuntimeRequest",
    "ScheduledChunk",
    "SchedulerConfig",
    "SchedulerOutput",
    "TokenTrie",
    "block_table_array",
    "build_batch",
    "check_kv_manager",
    "effective_bits",
    "goodput",
    "kv_bytes",
    "physical_slot",
    "radix_snapshot",
    "scope_key",
    "slot_mapping",
    "slots_for",
    "validate_kv_descriptor",
]
