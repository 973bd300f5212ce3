"""kvlab: an interactive textbook on KV memory and scheduling in LLM inference, and its engine.

The specification's reference names come from :mod:`kvlab.reference` (the torch-free ones at
once, ``speculative_step`` on first use); the engine's names load on first use, so
``import kvlab`` stays fast and never imports torch by itself::

    from kvlab import LLM, SamplingParams
    llm = LLM("kvlab-tiny")
    outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

from kvlab._lazy import lazy_exports
from kvlab.reference import (
    ALLOWED,
    REQUIRED_KV_FIELDS,
    BlockAllocator,
    Phase,
    PrefixCache,
    Request,
    build_batch,
    dequantize_groups,
    effective_bits,
    goodput,
    kv_bytes,
    physical_slot,
    quantize_groups,
    validate_kv_descriptor,
)

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access (PEP 562).
_LAZY = {
    "speculative_step": "kvlab.reference.rule08_speculative",
    "LLM": "kvlab.engine.llm",
    "LLMEngine": "kvlab.engine.llm_engine",
    "EngineArgs": "kvlab.engine.engine_args",
    "SamplingParams": "kvlab.core.sampling_params",
    "RequestOutputKind": "kvlab.core.sampling_params",
    "RequestOutput": "kvlab.engine.outputs",
    "CompletionOutput": "kvlab.engine.outputs",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)

__all__ = [
    "ALLOWED",
    "REQUIRED_KV_FIELDS",
    "BlockAllocator",
    "Phase",
    "PrefixCache",
    "Request",
    "build_batch",
    "dequantize_groups",
    "effective_bits",
    "goodput",
    "kv_bytes",
    "physical_slot",
    "quantize_groups",
    "validate_kv_descriptor",
    *_LAZY,
]
