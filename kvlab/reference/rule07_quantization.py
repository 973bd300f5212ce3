"""Spec rule 7 — group quantisation: symmetric b-bit integers with one scale per group.

Per group ``g`` of ``group_size`` consecutive values along the last axis:
``s_g = max|x_g| / (2^(b-1) - 1)`` and ``q_g = round(x_g / s_g)``, clamped to ``±(2^(b-1)-1)``.
Storing such integers is not executing a low-bit GEMM: report the checkpoint bit width, the
runtime weight format, the activation and accumulator dtypes and the kernel actually run.

``quantize_groups`` / ``dequantize_groups`` take and return torch tensors; ``effective_bits``
only counts bits. Importing this module does not import torch (``quantize_groups`` imports it
on its first call), so :mod:`kvlab.core` can re-export ``effective_bits`` and stay torch-free.
"""

from __future__ import annotations

__all__ = ["dequantize_groups", "effective_bits", "quantize_groups"]


def quantize_groups(x, bits=4, group_size=32):
    """x:[...,D] -> integer q:[...,D], scale:[...,D/group,1]."""
    import torch

    if (x.ndim == 0 or not 2 <= bits <= 8 or group_size <= 0
            or x.size(-1) % group_size):
        raise ValueError("invalid bits or non-divisible group size")
    qmax = 2 ** (bits - 1) - 1
    shape = (*x.shape[:-1], x.size(-1) // group_size, group_size)
    group = x.float().reshape(shape)
    scale = (group.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-12)
    q = (group / scale).round().clamp(-qmax, qmax).to(torch.int8)
    return q.reshape_as(x), scale


def dequantize_groups(q, scale, group_size):
    """Inverse of :func:`quantize_groups` up to rounding.

    q:[...,D] integers, scale:[...,D/group,1] -> float32 [...,D].
    """
    shape = (*q.shape[:-1], q.size(-1) // group_size, group_size)
    return (q.reshape(shape).float() * scale).reshape_as(q)


def effective_bits(bits, group_size, scale_bits=16, zero_bits=0):
    """Bits stored per weight: the payload plus each group's scale (and zero point) spread out."""
    return bits + (scale_bits + zero_bits) / group_size
