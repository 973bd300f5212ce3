"""Group quantization in the engine (spec rule 7): packed int8/int4 weights, a quantized KV
cache, pre-quantized checkpoints and the five-fact report.

- :mod:`.formats`: :class:`QuantConfig`, quantize / dequantize, int4 packing;
- :mod:`.linear`: :class:`QuantizedLinear` (weight-only, W8A16 / W4A16) and the kernel log;
- :mod:`.kv_cache`: :class:`QuantizedPagedKVCache` (int8 / fp8 e4m3, per token-head scales);
- :mod:`.checkpoint_io`: :func:`save_quantized` / :func:`load_quantized` (safetensors layout);
- :mod:`.setup`: :class:`EngineQuantization`, what the engine holds;
- :mod:`.report`: :class:`QuantizationReport`.
"""

from kvlab.engine.quantization.checkpoint_io import load_quantized, save_quantized
from kvlab.engine.quantization.formats import (
    PackedWeight,
    QuantConfig,
    dequantize,
    pack_int4,
    quantize,
    unpack_int4,
)
from kvlab.engine.quantization.kv_cache import QuantizedPagedKVCache, dequantize_kv, quantize_kv
from kvlab.engine.quantization.linear import KernelLog, QuantizedLinear
from kvlab.engine.quantization.report import QuantizationReport, build_report
from kvlab.engine.quantization.setup import EngineQuantization

__all__ = [
    "EngineQuantization",
    "KernelLog",
    "PackedWeight",
    "QuantConfig",
    "QuantizationReport",
    "QuantizedLinear",
    "QuantizedPagedKVCache",
    "build_report",
    "dequantize",
    "dequantize_kv",
    "load_quantized",
    "pack_int4",
    "quantize",
    "quantize_kv",
    "save_quantized",
    "unpack_int4",
]
