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

from .block_pool import CACHE_OWNER, BlockPool
from .capacity import (
    DTYPE_BYTES,
    CapacityPlan,
    dtype_bytes,
    kv_element_bytes,
    kv_heads_per_rank,
    plan_capacity,
)
from .catalog import GPUS, MODELS, GPUSpec, ModelShape, dense_param_count, get_gpu, get_model
from .fragmentation import (
    WasteReport,
    WorkloadRequest,
    compare_policies,
    sharegpt_like_workload,
    simulate,
    waste_table,
)
from .invariants import KV_MANAGER_INVARIANTS, InvariantSet, check_kv_manager
from .kv_manager import KVCacheManager
from .kv_snapshot import KVSnapshot
from .lifecycle import TRANSITIONS, EventLog, Lifecycle
from .paging import BlockTable, block_table_array, slot_mapping, slots_for
from .policies import BaselineScheduler, ProductionScheduler
from .radix import PrefixMatch, RadixCache, RadixSnapshot
from .recovery import recover
from .scheduler_api import (
    FinishReason,
    RequestStatus,
    RuntimeRequest,
    ScheduledChunk,
    SchedulerOutput,
)
from .scheduler_config import SchedulerConfig
from .scope import SCOPE_FIELDS, CacheScope, scope_key
from .token_trie import TokenTrie

__all__ = [
    "ALLOWED",
    "CACHE_OWNER",
    "DTYPE_BYTES",
    "GPUS",
    "KV_MANAGER_INVARIANTS",
    "MODELS",
    "REQUIRED_KV_FIELDS",
    "SCOPE_FIELDS",
    "TRANSITIONS",
    "BaselineScheduler",
    "BlockAllocator",
    "BlockPool",
    "BlockTable",
    "CacheScope",
    "CapacityPlan",
    "EventLog",
    "FinishReason",
    "GPUSpec",
    "InvariantSet",
    "KVCacheManager",
    "KVSnapshot",
    "Lifecycle",
    "ModelShape",
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
    "WasteReport",
    "WorkloadRequest",
    "block_table_array",
    "build_batch",
    "check_kv_manager",
    "compare_policies",
    "dense_param_count",
    "dtype_bytes",
    "effective_bits",
    "get_gpu",
    "get_model",
    "goodput",
    "kv_bytes",
    "kv_element_bytes",
    "kv_heads_per_rank",
    "physical_slot",
    "plan_capacity",
    "recover",
    "scope_key",
    "sharegpt_like_workload",
    "simulate",
    "slot_mapping",
    "slots_for",
    "validate_kv_descriptor",
    "waste_table",
]
