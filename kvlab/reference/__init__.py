"""kvlab.reference: the specification's code listings, one module per spec rule.

Each module holds one listing of ``shared/spec/inference-engine.zh.md`` under the listing's own
names, with its signature and behaviour unchanged (every assert of the document holds against
it, see ``tests/test_spec.py``). These are the *reference semantics*; the production versions
that the engine uses live in :mod:`kvlab.core` and :mod:`kvlab.engine` and are tested against
them.

====  =======================  =========================================  ==================
rule  module                   names                                      production twin
====  =======================  =========================================  ==================
1     ``rule01_capacity``      ``kv_bytes``                               ``core.capacity``
2     ``rule02_paging``        ``physical_slot``                          ``core.paging``
3     ``rule03_refcount``      ``BlockAllocator``                         ``core.block_pool``
4     ``rule04_prefix``        ``PrefixCache``                            ``core.token_trie``
5     ``rule05_request``       ``Phase``, ``ALLOWED``, ``Request``        ``core.lifecycle``
6     ``rule06_batching``      ``build_batch``                            ``core.scheduler``
7     ``rule07_quantization``  ``quantize_groups``, ``dequantize_groups``,
                               ``effective_bits``
8     ``rule08_speculative``   ``speculative_step``
9     ``rule09_disagg``        ``REQUIRED_KV_FIELDS``,
                               ``validate_kv_descriptor``
10    ``rule10_goodput``       ``goodput``
====  =======================  =========================================  ==================

Rule 11 (invariants under fault injection) has no listing: :mod:`kvlab.labs.invariants.structural`
and the
property tests check it.

Importing this package never imports torch. ``quantize_groups`` imports torch on its first
call; ``speculative_step``, whose module imports torch, loads on first attribute access.
Nothing here imports :mod:`kvlab.core`: the reference is the bottom layer.
"""

from __future__ import annotations

from kvlab._lazy import lazy_exports
from kvlab.reference.rule01_capacity import kv_bytes
from kvlab.reference.rule02_paging import physical_slot
from kvlab.reference.rule03_refcount import BlockAllocator
from kvlab.reference.rule04_prefix import PrefixCache
from kvlab.reference.rule05_request import ALLOWED, Phase, Request
from kvlab.reference.rule06_batching import build_batch
from kvlab.reference.rule07_quantization import dequantize_groups, effective_bits, quantize_groups
from kvlab.reference.rule09_disagg import REQUIRED_KV_FIELDS, validate_kv_descriptor
from kvlab.reference.rule10_goodput import goodput

# name -> module defining it, imported on first attribute access (the module imports torch)
_LAZY = {
    "speculative_step": ".rule08_speculative",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)

__all__ = [  # noqa: RUF022 - in rule order, like the imports
    "kv_bytes",
    "physical_slot",
    "BlockAllocator",
    "PrefixCache",
    "Phase",
    "ALLOWED",
    "Request",
    "build_batch",
    "quantize_groups",
    "dequantize_groups",
    "effective_bits",
    "speculative_step",
    "REQUIRED_KV_FIELDS",
    "validate_kv_descriptor",
    "goodput",
]
