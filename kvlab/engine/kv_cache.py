"""The KV cache tensors, paged into fixed-size blocks, and the one interface attention reads a
layer's KV through (:class:`KVLayer`, which the quantized cache implements too).

Layout: a single tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; layer ``l``'s
K is ``data[l, 0]`` and V is ``data[l, 1]``, each ``[num_blocks, block_size, kv_heads,
head_dim]``. Which request owns which block is decided by :mod:`kvlab.core` (block tables); this
module only holds the payload: it writes a step's new K/V and performs copy-on-write copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from kvlab.engine.attention_metadata import AttentionMetadata
from kvlab.kernels import triton

__all__ = ["KVLayer", "PagedKVCache", "PagedKVLayer", "blocks_for_budget", "write_kv"]


class KVLayer(Protocol):
    """One layer's KV as attention sees it. ``exact``: reads give back exactly what was written
    (False for a quantized cache, whose reads are rounded)."""

    exact: bool

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's new ``k, v: [N, kv_heads, D]`` at flat slots ``slot_mapping``."""
        ...

    def view(self, meta: AttentionMetadata
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(k_cache, v_cache, meta)``: paged tensors ``[blocks, block_size, kv_heads, D]`` in
        the compute dtype holding every block ``meta`` reads, and ``meta`` indexing them."""
        ...


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new ``k, v: [N, kv_heads, D]`` at flat slots ``slot_mapping: [N]`` (in place):
    ``index_copy_``, or on CUDA the Triton store kernel (one program per token)."""
    if k_cache.is_cuda and triton.available():
        triton.store_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    kv_heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, v)


class PagedKVLayer(NamedTuple):
    """One layer of a :class:`PagedKVCache`: views of its K and V (``k, v = layer`` unpacks)."""

    k: torch.Tensor
    v: torch.Tensor
    exact = True          # (a class attribute, not a field: the layer unpacks into K and V)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(self.k, self.v, k, v, slot_mapping)

    def view(self, meta: AttentionMetadata
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return self.k, self.v, meta


def blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many blocks of ``block_bytes`` fit in ``budget_bytes`` (ValueError when none)."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    n = budget_bytes // block_bytes
    if n < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {block_bytes} bytes")
    return int(n)


def copy_indices(copies: Sequence[tuple[int, int]], num_blocks: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(source ids, destination ids) of copy-on-write ``copies`` (from the block pool: ids in
    ``0..num_blocks-1``, no destination twice) as index tensors."""
    src = [int(s) for s, _ in copies]
    dst = [int(d) for _, d in copies]
    assert all(0 <= b < num_blocks for b in src + dst), "copy_blocks: ids outside the cache"
    assert len(set(dst)) == len(dst), f"copy_blocks: a destination repeats in {list(copies)}"
    return torch.tensor(src, device=device), torch.tensor(dst, device=device)


class PagedKVCache:
    """KV payload for ``num_layers`` layers; ``layers[l] = (k_cache, v_cache)`` views."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {v!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)
        self.layers = [PagedKVLayer(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes one block holds over all layers, K and V."""
        return self.nbytes // self.num_blocks

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy every ``(src, dst)`` block's K and V in all layers (copy-on-write payload).

        Sources are read before any destination is written, so chains are well defined.
        """
        if not copies:
            return
        s, d = copy_indices(copies, self.num_blocks, self.data.device)
        self.data[:, :, d] = self.data[:, :, s]
