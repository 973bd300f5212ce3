"""kvlab.core: the metadata layer of the engine, pure Python, never imports torch.

It decides *what* runs: capacities, page tables, block ownership, prefix reuse, request
states, batches, P/D descriptors and metrics. Tensors live in :mod:`kvlab.engine`.
"""

from .blocks import BlockAllocator
from .capacity import kv_bytes
from .disagg import REQUIRED_KV_FIELDS, validate_kv_descriptor
from .metrics import goodput
from .paging import physical_slot
from .prefix import PrefixCache
from .quantization import effective_bits
from .request import ALLOWED, Phase, Request
from .sched import build_batch

__all__ = [
    "ALLOWED",
    "REQUIRED_KV_FIELDS",
    "BlockAllocator",
    "Phase",
    "PrefixCache",
    "Request",
    "build_batch",
    "effective_bits",
    "goodput",
    "kv_bytes",
    "physical_slot",
    "validate_kv_descriptor",
]
