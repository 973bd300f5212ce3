"""kvlab.core: the spine of the engine, pure Python, never imports torch.

It decides *what* runs: requests and their states, the scheduler and its two policies, the KV
cache manager over a refcounted block pool and a radix prefix cache, and the one step loop
(:class:`~kvlab.core.engine_core.EngineCore`) with the records that cross its seams. Tensors
live in :mod:`kvlab.engine`; the chapters' labs in :mod:`kvlab.labs`.

The torch-free reference listings of the specification live in :mod:`kvlab.reference` and are
re-exported here (the very same objects); every other name is a production version the engine
uses, tested against them.
"""

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.block_pool import CACHE_OWNER, BlockPool, OutOfBlocks
from kvlab.core.cache_scope import SCOPE_FIELDS, CacheScope
from kvlab.core.engine_core import EngineCore, StepObserver
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.radix_cache import PrefixMatch, RadixCache, scope_key
from kvlab.core.request import TRANSITIONS, FinishReason, Lifecycle, RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import ModelOutput, ScheduledChunk, SchedulerOutput
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

__all__ = [
    "ALLOWED",
    "CACHE_OWNER",
    "REQUIRED_KV_FIELDS",
    "SCOPE_FIELDS",
    "TRANSITIONS",
    "BaselineScheduler",
    "BlockAllocator",
    "BlockPool",
    "CacheScope",
    "EngineCore",
    "FinishReason",
    "KVCacheManager",
    "Lifecycle",
    "ModelOutput",
    "OutOfBlocks",
    "Phase",
    "PrefixCache",
    "PrefixMatch",
    "ProductionScheduler",
    "RadixCache",
    "Request",
    "RequestStatus",
    "RuntimeRequest",
    "ScheduledChunk",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepObserver",
    "build_batch",
    "effective_bits",
    "goodput",
    "kv_bytes",
    "physical_slot",
    "scope_key",
    "validate_kv_descriptor",
]
