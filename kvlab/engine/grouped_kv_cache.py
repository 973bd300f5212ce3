"""The KV payload of a model with several KV cache groups (:mod:`kvlab.core.kv_cache_groups`):
one tensor of ``slots`` layer pages per block, which every group shares.

Layout: ``[slots, 2, num_blocks, block_size, kv_heads, head_dim]``. A block belongs to one
group at a time (the hybrid KV cache manager hands it out), and it is then a page in each of
that group's layers: layer ``groups[g].layers[j]`` reads and writes slot ``j``. So a block costs
``slots`` layer pages, not one per model layer, as in vLLM v1, where each KV cache tensor is
shared by one layer of every group (``vllm/v1/core/kv_cache_utils.py``,
``_get_kv_cache_config_uniform_page_size``, v0.32.0). A slot that no layer of a group uses is
padding. Copy-on-write copies a block in every slot (the slots its group does not use hold
nothing anyone reads).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlab.core.kv_cache_groups import KVCacheGroup
from kvlab.engine.kv_cache import PagedKVCache, PagedKVLayer

__all__ = ["GroupedKVCache"]


class GroupedKVCache(PagedKVCache):
    """A :class:`~kvlab.engine.kv_cache.PagedKVCache` of ``slots`` layers whose ``layers[l]``,
    one per model layer, is the slot of ``l`` in its group (see the module docstring)."""

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        slots = max(len(g.layers) for g in groups)
        super().__init__(slots, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                         device=device)
        slot_of = {layer: j for g in groups for j, layer in enumerate(g.layers)}
        assert sorted(slot_of) == list(range(len(slot_of))), "every layer in one group"
        self.groups = tuple(groups)
        self.layers = [PagedKVLayer(self.data[slot_of[layer], 0], self.data[slot_of[layer], 1])
                       for layer in range(len(slot_of))]
