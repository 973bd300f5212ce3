"""kvlab.engine: the torch layer — model, paged attention, sampling, executor, LLM / LLMEngine.

The offline engine is shaped like vLLM's: :class:`LLM` (``generate``), :class:`LLMEngine`
(``add_request`` / ``step`` / ``abort_request`` / ``snapshot``), :class:`SamplingParams` and
:class:`RequestOutput`. Those names load on first use (PEP 562). The torch listings of the
specification (``quantize_groups``, ``dequantize_groups``, ``effective_bits``,
``speculative_step``) live in :mod:`kvlab.reference` and are re-exported here.
"""

from __future__ import annotations

from kvlab._lazy import lazy_exports
from kvlab.reference.rule07_quantization import dequantize_groups, effective_bits, quantize_groups
from kvlab.reference.rule08_speculative import speculative_step

# name -> module defining it, imported on first attribute access
_LAZY = {
    "LLM": ".llm",
    "LLMEngine": ".llm_engine",
    "EngineArgs": ".engine_args",
    "EngineStats": ".outputs",
    "SamplingParams": "kvlab.core.sampling_params",
    "RequestOutputKind": "kvlab.core.sampling_params",
    "RequestOutput": ".outputs",
    "CompletionOutput": ".outputs",
    "RequestMetrics": ".outputs",
    "ModelConfig": ".config",
    "ConfigError": ".config",
    "CheckpointError": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "LlamaModel": ".model",
    "PagedKVCache": ".kv_cache",
    "ModelRunner": ".model_runner",
    "Tokenizer": "kvlab.engine.tokenizer",
    "EngineSnapshot": ".snapshot",
    "QuantConfig": ".quantization",
    "save_quantized": ".quantization",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)

__all__ = [
    "dequantize_groups",
    "effective_bits",
    "quantize_groups",
    "speculative_step",
    *_LAZY,
]
