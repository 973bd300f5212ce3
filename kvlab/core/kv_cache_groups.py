"""KV cache groups: the layers that share one block table (vLLM v1's ``KVCacheGroupSpec``).

A model whose layers all attend the same way has one group, every layer. A hybrid model, e.g.
one full-attention layer for every three sliding-window ones, has one group per kind of layer
and, since a block of the one pool is a page in *every* layer of the group that holds it, all
groups have the same number of layer slots: :func:`group_layers` cuts them as vLLM 0.32.0's
``_get_kv_cache_groups_uniform_page_size`` (``vllm/v1/core/kv_cache_utils.py``) does. The group
size is the smallest kind's layer count (the largest, when that is under 1.5x the smallest); a
kind whose count it does not divide gets padding slots, pages paid for and never used; a kind
with several groups deals its layers round robin (``layers[i::n]``).

:func:`window_blocks` is what one request holds in a group at most: every block of its tokens
in a full-attention group, and in a sliding-window group only the blocks its window and its
step's new tokens touch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["KVCacheGroup", "group_layers", "window_blocks"]


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table: their sliding ``window`` (0: full attention; ``W``:
    a query sees the last ``W`` positions, itself included) and the ``layers`` (model layer
    indices) whose pages a block of this group holds, one per slot."""

    window: int
    layers: tuple[int, ...]


def group_layers(windows: Sequence[int]) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups of a model whose layer ``i`` has sliding window ``windows[i]`` (0:
    full attention), full-attention groups first (see the module docstring). Every group has
    ``max(len(g.layers))`` slots."""
    if not windows or any(type(w) is not int or w < 0 for w in windows):
        raise ValueError(f"windows must be a non-empty sequence of ints >= 0, got {windows!r}")
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    sizes = [len(layers) for layers in kinds.values()]
    size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups = []
    for window in sorted(kinds):            # 0 (full attention) first, then by window
        layers = kinds[window]
        n = -(-len(layers) // size)
        groups += [KVCacheGroup(window, tuple(layers[i::n])) for i in range(n)]
    return tuple(groups)


def window_blocks(window: int, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
    """Blocks one request of ``num_tokens`` tokens holds at most in a group with ``window``,
    when it computes at most ``chunk_tokens`` tokens a step: all ``ceil(num_tokens /
    block_size)`` without a window; with one, the blocks of the ``window - 1`` tokens before a
    step's first token and the step's own tokens, plus one for a window that starts inside a
    block (vLLM's ``SlidingWindowSpec.max_admission_blocks_per_request``), never more than
    all."""
    full = -(-num_tokens // block_size)
    if not window:
        return full
    return min(full, -(-(window - 1 + chunk_tokens) // block_size) + 1)
