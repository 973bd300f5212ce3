"""The honest quantization report (spec rule 7): five facts, stated separately.

1. **checkpoint bit width**: the bits of the weights on disk (32 for an fp32 safetensors file
   quantized at load; 4 for a pre-quantized int4 checkpoint), and the effective bits stored
   once scales and zero points are counted;
2. **runtime weight format**: how the linear weights sit in memory while the engine runs;
3. **activation dtype**: what the matmuls multiply the weights with;
4. **accumulator dtype**: what the dot products sum in (torch's CPU GEMMs and the packed
   int8/int4 CPU kernels accumulate in float32 for every activation dtype kvlab runs);
5. **kernel executed**: read from the kernel log every linear forward writes, so it says what
   ran. Before the first forward it says so rather than guess.

Plus measured bytes: quantized linear weights, the other (unquantized) weights, KV cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvlab.engine.quantization.checkpoint_io import quantized_linear_names
from kvlab.engine.quantization.linear import QuantizedLinear
from kvlab.engine.quantization.setup import EngineQuantization

__all__ = ["QuantizationReport", "build_report"]


@dataclass(frozen=True)
class QuantizationReport:
    checkpoint_bits: str
    runtime_weight_format: str
    activation_dtype: str
    accumulator_dtype: str
    kernels_executed: dict[str, int]
    weight_source: str
    linear_params: int
    linear_weight_bytes: int          # stored format: payload + scales + zero points
    effective_bits: float | None      # spec rule 7's count for the format
    measured_bits: float              # 8 * linear_weight_bytes / linear_params
    runtime_extra_bytes: int          # kernel-specific copies (int4 kernel layout)
    other_weight_bytes: int           # embeddings, norms, untied lm_head
    kv_cache_dtype: str
    kv_cache_bytes: int
    kv_bytes_per_token: float

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        ran = ", ".join(f"{k} x{n}" for k, n in self.kernels_executed.items()) or \
            "nothing yet (no forward pass has run)"
        eff = "" if self.effective_bits is None else (
            f" (effective {self.effective_bits:.4g} bits/weight by rule 7; measured "
            f"{self.measured_bits:.4g} from bytes)")
        return "\n".join([
            f"checkpoint bit width : {self.checkpoint_bits}{eff}",
            f"runtime weight format: {self.runtime_weight_format}",
            f"activation dtype     : {self.activation_dtype}",
            f"accumulator dtype    : {self.accumulator_dtype}",
            f"kernel executed      : {ran}",
            f"weights              : {self.linear_weight_bytes:,} B in {self.linear_params:,} "
            f"linear params ({self.weight_source}) + {self.other_weight_bytes:,} B other"
            + (f" + {self.runtime_extra_bytes:,} B kernel layout" if self.runtime_extra_bytes
               else ""),
            f"KV cache             : {self.kv_cache_dtype}, {self.kv_cache_bytes:,} B "
            f"({self.kv_bytes_per_token:g} B/token)",
        ])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def build_report(quant: EngineQuantization, model: torch.nn.Module, cache,
                 block_size: int, forward_passes: int) -> QuantizationReport:
    """The report of an engine's ``model`` (a LlamaModel) and KV ``cache``. Quantized linears
    log the kernel of every call; plain ones run ``aten.linear`` once per layer and forward
    pass (``forward_passes``: the engine's model forwards so far)."""
    names = quantized_linear_names(model)
    mods = [model.get_submodule(n) for n in names]
    qmods = [m for m in mods if isinstance(m, QuantizedLinear)]
    params = sum(m.out_features * m.in_features for m in mods)
    act = _dtype_name(model.dtype)
    linear_ids = {id(p) for m in mods for p in m.parameters(recurse=False)}
    if qmods:
        c = qmods[0].config
        lin_bytes = sum(m.stored_bytes for m in qmods)
        extra = sum(m.runtime_extra_bytes for m in qmods)
        bias_bytes = sum(m.bias.numel() * m.bias.element_size() for m in qmods
                         if m.bias is not None)
        payload = ("two per byte (uint8 nibbles)" if c.payload_bits() == 4 else "one per byte")
        fmt = (f"int{c.bits} {'symmetric' if c.symmetric else 'zero-point (uint8 zeros)'}, "
               f"{payload}, one {c.scale_dtype} scale per {c.group_size} weights; "
               f"kernel policy {c.kernel!r}")
        eff: float | None = c.effective_bits()
        ckpt_bits = (f"{c.bits} (int{c.bits}, pre-quantized)" if quant.source.startswith("pre")
                     else f"{_bits(quant.checkpoint_dtype)} ({quant.checkpoint_dtype} on disk; "
                          f"quantized to int{c.bits} at load)")
    else:
        lin_bytes = sum(m.weight.numel() * m.weight.element_size() for m in mods)
        extra = 0
        bias_bytes = sum(m.bias.numel() * m.bias.element_size() for m in mods
                         if m.bias is not None)
        fmt = f"{act} dense (not quantized)"
        eff = None
        ckpt_bits = f"{_bits(quant.checkpoint_dtype)} ({quant.checkpoint_dtype} on disk)"
    other = sum(p.numel() * p.element_size() for p in model.parameters()
                if id(p) not in linear_ids) + bias_bytes
    kv_tokens = cache.num_blocks * block_size
    ran = quant.log.summary()
    if not qmods and forward_passes:
        ran = {f"aten.linear [{act}]": forward_passes * len(mods)}
    return QuantizationReport(
        checkpoint_bits=ckpt_bits, runtime_weight_format=fmt, activation_dtype=act,
        accumulator_dtype="float32", kernels_executed=ran,
        weight_source=quant.source, linear_params=params, linear_weight_bytes=lin_bytes,
        effective_bits=eff, measured_bits=8 * lin_bytes / params if params else 0.0,
        runtime_extra_bytes=extra, other_weight_bytes=other,
        kv_cache_dtype=quant.kv.name if quant.kv.quantized else f"auto ({act})",
        kv_cache_bytes=cache.nbytes, kv_bytes_per_token=cache.nbytes / kv_tokens)


def _bits(dtype: str) -> str:
    sizes = {"float32": "32", "float16": "16", "bfloat16": "16", "float64": "64"}
    return sizes.get(dtype, dtype)


def engine_report(engine) -> QuantizationReport:
    """The report of an :class:`~kvlab.engine.llm_engine.LLMEngine` now (taken under its lock)."""
    with engine.core.lock:
        return build_report(engine.quantization, engine.model, engine.cache, engine.block_size,
                            engine.stats.forward_passes)
