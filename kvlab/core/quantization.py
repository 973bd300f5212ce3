"""Storage arithmetic of group-quantised formats (spec rule 7), torch-free.

The tensor operations (``quantize_groups`` / ``dequantize_groups``) live in
:mod:`kvlab.engine.quant`; this module only counts bits.
"""

from __future__ import annotations


def effective_bits(bits, group_size, scale_bits=16, zero_bits=0):
    """Bits stored per weight: the payload plus each group's scale (and zero point) spread out."""
    return bits + (scale_bits + zero_bits) / group_size
