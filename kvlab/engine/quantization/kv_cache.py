"""A paged KV cache stored in int8 or fp8 (e4m3) with one fp16 scale per (token, KV head).

Layout: ``data: [layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (int8, or uint8
holding fp8 e4m3 bit patterns: CPU torch cannot ``index_copy_`` float8 tensors) and
``scales: [layers, 2, num_blocks, block_size, kv_heads]`` fp16. Why per token and head:
:mod:`kvlab.core.kv_dtype`.

Attention: each ``layers[l]`` is a :class:`QuantizedKVLayer`, a
:class:`~kvlab.engine.kv_cache.KVLayer` like a plain cache's: :meth:`~QuantizedKVLayer.write`
quantizes the new K/V into their slots, :meth:`~QuantizedKVLayer.view` dequantizes only the
blocks this step reads into a compact float buffer with block ids remapped (computed once per
step, shared by all layers), and the engine's attention backend runs over that. The float copy
is transient and the size of the step's working set, never of the whole cache. Its reads are
rounded (``exact`` is False), so a fresh prompt attends its own new K/V, as over a plain cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvlab.core.kv_dtype import KVDtypeSpec
from kvlab.engine.attention_metadata import AttentionMetadata
from kvlab.engine.kv_cache import copy_indices

__all__ = ["QuantizedKVLayer", "QuantizedPagedKVCache", "dequantize_kv", "quantize_kv"]

_SCALE_TINY = 2.0 ** -14   # smallest normal fp16: scales below it would lose precision


def quantize_kv(x: torch.Tensor, spec: KVDtypeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [..., D]`` -> (payload ``[..., D]`` int8 or uint8-coded fp8, fp16 scale ``[...]``).

    ``s = max|x| / qmax`` per row, rounded up to fp16; int8: ``round(x / s)``; fp8: ``x / s``
    cast to e4m3 (round to nearest, magnitude <= 448)."""
    xf = x.float()
    s = (xf.abs().amax(-1) / spec.qmax).clamp_min(_SCALE_TINY)
    s16 = s.half()
    s16 = torch.where(s16.float() < s, torch.nextafter(s16, torch.full_like(s16, 65504.0)), s16)
    y = xf / s16.float()[..., None]
    if spec.name == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), s16
    return y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), s16


def dequantize_kv(q: torch.Tensor, s: torch.Tensor, spec: KVDtypeSpec,
                  dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv` up to rounding, in ``dtype``."""
    vals = q.float() if spec.name == "int8" else q.view(torch.float8_e4m3fn).float()
    return (vals * s.float()[..., None]).to(dtype)


class QuantizedPagedKVCache:
    """KV payload of ``num_layers`` layers in a quantized dtype (see the module docstring).
    Same interface as :class:`~kvlab.engine.kv_cache.PagedKVCache` (``data``, ``layers``,
    ``num_blocks``, ``block_size``, ``nbytes``, ``block_bytes``, ``copy_blocks``) plus
    ``compute_dtype``, the dtype attention runs in."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, spec: KVDtypeSpec, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"QuantizedPagedKVCache: {name} must be a positive int, "
                                 f"got {v!r}")
        if not spec.quantized:
            raise ValueError(f"QuantizedPagedKVCache needs a quantized KV dtype, got {spec.name}")
        self.spec = spec
        self.num_blocks, self.block_size = num_blocks, block_size
        self.compute_dtype = dtype
        payload = torch.int8 if spec.name == "int8" else torch.uint8
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=payload, device=device)
        self.scales = torch.zeros(shape[:-1], dtype=torch.float16, device=device)
        self.layers = [QuantizedKVLayer(self, i) for i in range(num_layers)]
        self._step: tuple[AttentionMetadata, AttentionMetadata, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return (self.data.numel() * self.data.element_size()
                + self.scales.numel() * self.scales.element_size())

    @property
    def block_bytes(self) -> int:
        return self.nbytes // self.num_blocks

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy every ``(src, dst)`` block's payload and scales, all layers.
        ValueError (nothing copied) for an out-of-range id or a repeated destination."""
        if not copies:
            return
        s, d = copy_indices(copies, self.num_blocks, self.data.device)
        self.data[:, :, d] = self.data[:, :, s]
        self.scales[:, :, d] = self.scales[:, :, s]

    def compact(self, meta: AttentionMetadata) -> tuple[AttentionMetadata, torch.Tensor]:
        """(metadata with block ids remapped onto the step's blocks, those block ids); cached
        for the step's ``meta`` so all layers share it."""
        if self._step is not None and self._step[0] is meta:
            return self._step[1], self._step[2]
        dev = self.data.device
        blocks = torch.unique(meta.block_tables) if meta.block_tables.numel() else torch.zeros(
            1, dtype=torch.long, device=dev)
        remap = torch.zeros(self.num_blocks, dtype=torch.long, device=dev)
        remap[blocks] = torch.arange(blocks.numel(), device=dev)
        small = dataclasses.replace(meta, block_tables=remap[meta.block_tables],
                                    paged_tables=remap[meta.paged_tables])
        self._step = (meta, small, blocks)
        return small, blocks


class QuantizedKVLayer:
    """One layer of a :class:`QuantizedPagedKVCache`, a :class:`~kvlab.engine.kv_cache.KVLayer`
    whose reads are rounded."""

    exact = False

    def __init__(self, cache: QuantizedPagedKVCache, layer: int):
        self.cache, self.layer = cache, layer

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize new ``k, v: [N, kv_heads, D]`` into flat slots ``slot_mapping``."""
        c = self.cache
        kv_heads, dim = c.data.shape[-2:]
        for i, x in ((0, k), (1, v)):
            q, s = quantize_kv(x, c.spec)
            c.data[self.layer, i].view(-1, kv_heads, dim).index_copy_(0, slot_mapping, q)
            c.scales[self.layer, i].view(-1, kv_heads).index_copy_(0, slot_mapping, s)

    def read_blocks(self, which: int, blocks: torch.Tensor) -> torch.Tensor:
        """Dequantized K (``which=0``) or V (1) of ``blocks``: ``[len, block_size, kv, D]``."""
        c = self.cache
        return dequantize_kv(c.data[self.layer, which][blocks],
                             c.scales[self.layer, which][blocks], c.spec, c.compute_dtype)

    def view(self, meta: AttentionMetadata
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's blocks dequantized (``[len, block_size, kv, D]``, K and V) and ``meta``
        with its tables remapped onto them."""
        small, blocks = self.cache.compact(meta)
        return self.read_blocks(0, blocks), self.read_blocks(1, blocks), small
