"""The KV cache tensors: one K and one V tensor per layer, paged into fixed-size blocks.

Layout: a single tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; layer ``l``'s
K is ``data[l, 0]`` and V is ``data[l, 1]``, each ``[num_blocks, block_size, kv_heads,
head_dim]``. Which request owns which block is decided by :mod:`kvlab.core` (block tables); this
module only holds the payload and performs copy-on-write copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PagedKVCache", "blocks_for_budget"]


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
    """(source ids, destination ids) of copy-on-write ``copies`` as index tensors. ValueError
    when an id is outside ``0..num_blocks-1`` or a destination repeats."""
    src = [int(s) for s, _ in copies]
    dst = [int(d) for _, d in copies]
    bad = [b for b in src + dst if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"copy_blocks: block ids {bad} outside 0..{num_blocks - 1}")
    if len(set(dst)) != len(dst):
        raise ValueError(f"copy_blocks: a destination block repeats in {list(copies)}")
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
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

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
        ValueError (and nothing copied) when an index is out of range or a dst repeats.
        """
        if not copies:
            return
        s, d = copy_indices(copies, self.num_blocks, self.data.device)
        self.data[:, :, d] = self.data[:, :, s]
