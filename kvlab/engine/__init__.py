"""kvlab.engine: the torch layer — model, paged attention, sampling, quantisation, speculation."""

from .quant import dequantize_groups, effective_bits, quantize_groups
from .spec import speculative_step

__all__ = ["dequantize_groups", "effective_bits", "quantize_groups", "speculative_step"]
