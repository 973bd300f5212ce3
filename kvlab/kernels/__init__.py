"""Attention kernels beside the engine's torch path, each tested against it.

- :mod:`kvlab.kernels.cpu`: a compiled C++ paged-attention kernel (built on first use).
- :mod:`kvlab.kernels.triton`: Triton kernels for CUDA (paged attention, the KV store).

They import torch and nothing of kvlab's engine. :func:`row_kernel` is the one door: the op
that attends a step's paged rows (:data:`kvlab.engine.attention.RowKernel`), chosen once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import cpu, triton

__all__ = ["row_kernel"]


def row_kernel(device: torch.device | str, dtype: torch.dtype) -> Callable[..., None] | None:
    """``op(out, q, k_cache, v_cache, tables, lens, scale)`` for ``device`` and ``dtype``:
    the compiled CPU op, Triton's on CUDA, or None where neither runs (the torch path)."""
    device = torch.device(device)
    if device.type == "cuda":
        return triton.row_attention if triton.available() else None
    return cpu.decode_op(device, dtype)
