"""kvlab: an interactive textbook on KV memory and scheduling in LLM inference, and its engine.

Torch-free names come from :mod:`kvlab.core` at once; torch-dependent names (quantisation,
speculative decoding, the engine) load on first use, so ``import kvlab`` stays fast::

    from kvlab import LLM, SamplingParams
    llm = LLM("kvlab-tiny")
    outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

from kvlab._lazy import lazy_exports
from kvlab.core import (
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

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access (PEP 562).
_LAZY = {
    "quantize_groups": "kvlab.engine.quant",
    "dequantize_groups": "kvlab.engine.quant",
    "speculative_step": "kvlab.engine.spec",
    "LLM": "kvlab.engine.llm",
    "LLMEngine": "kvlab.engine.llm_engine",
    "SamplingParams": "kvlab.engine.params",
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
    "effective_bits",
    "goodput",
    "kv_bytes",
    "physical_slot",
    "validate_kv_descriptor",
    *_LAZY,
]
