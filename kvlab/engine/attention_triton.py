"""The CUDA attention backend: Triton's paged decode kernel (:mod:`kvlab.kernels.triton`) for
the paged rows (a sliding-window layer's rows on the torch path: the kernel has no window); the
dense chunks (prompts, long chunks behind a prefix) on the torch path,
whose SDPA runs flash attention on CUDA. Tested against
:class:`~kvlab.engine.attention_torch.TorchAttention` (``tests/test_triton_kernels.py``, under
Triton's interpreter on CPU tensors).
"""

from __future__ import annotations

import torch

from kvlab.engine.attention import AttentionBackend
from kvlab.engine.attention_metadata import AttentionMetadata
from kvlab.engine.attention_torch import attend_chunks, attend_rows
from kvlab.kernels import triton

__all__ = ["TritonAttention"]


class TritonAttention(AttentionBackend):
    """Paged rows through ``triton.row_attention`` (short chunks behind a prefix too)."""

    name = "triton"
    paged_max_tokens = 16

    def attend_rows(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    scale: float, window: int = 0) -> None:
        if window:
            out.copy_(attend_rows(q, k_cache, v_cache, tables, lens, scale, window))
            return
        triton.row_attention(out, q, k_cache, v_cache, tables, lens, scale)

    def attend_chunks(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, exact: bool,
                      window: int = 0) -> None:
        attend_chunks(out, q, k, v, k_cache, v_cache, meta, meta.dense, scale, window)
