"""The compiled CPU attention backend: kvlab's C++ ops (:mod:`kvlab.kernels.cpu`), called with no
Python in between. Paged rows, short chunks behind a cached prefix included, walk their block
tables straight through the cache; the dense chunks go to the chunk op in one call. Tested
against :class:`~kvlab.engine.attention_torch.TorchAttention` (``tests/test_cpu_kernels.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.engine.attention import AttentionBackend
from kvlab.engine.attention_metadata import AttentionMetadata
from kvlab.engine.attention_torch import attend_chunks
from kvlab.kernels import cpu

__all__ = ["CpuAttention"]


class CpuAttention(AttentionBackend):
    """The ops of one loaded build (``cpu.compiled()``), for float32, bfloat16 or float16 (the
    dtypes of :data:`kvlab.kernels.cpu.DTYPES`)."""

    name = "cpu"
    #: a row re-reads its context, so only short chunks pay as paged rows (longer ones go to
    #: the chunk op, which reads each block once per chunk)
    paged_max_tokens = 16

    def __init__(self, build: Any) -> None:
        self._decode, self._chunk = build.decode_attention, build.chunk_attention

    @classmethod
    def create(cls, dtype: torch.dtype) -> CpuAttention | None:
        """The backend for ``dtype``, or None where it cannot run (another dtype, no build,
        ``KVLAB_CPU_ATTENTION=0``)."""
        build = cpu.compiled() if dtype in cpu.DTYPES else None
        return None if build is None else cls(build)

    def attend_rows(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    scale: float, window: int = 0) -> None:
        assert q.dtype == k_cache.dtype == v_cache.dtype, "one dtype"
        self._decode(out, q, k_cache, v_cache, tables, lens, float(scale), window)

    def attend_chunks(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, exact: bool,
                      window: int = 0) -> None:
        """The chunk op reads every chunk from the cache; a fresh prompt over a cache that
        rounds (``exact`` False) attends its own new K/V on the torch path instead, as it
        would over a plain cache. The op needs a head dim divisible by 4."""
        compiled = meta.dense if exact else tuple(s for s in meta.dense if meta.start_pos[s])
        if q.shape[-1] % 4:
            compiled = ()
        if compiled:
            self._chunk(out, q, k_cache, v_cache, meta.block_tables, meta.query_start,
                        meta.start_pos, compiled, float(scale), window)
        rest = tuple(s for s in meta.dense if s not in compiled)
        if rest:
            attend_chunks(out, q, k, v, k_cache, v_cache, meta, rest, scale, window)
