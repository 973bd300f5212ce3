"""The attention seam: :class:`AttentionBackend`, one object chosen per engine
(:func:`kvlab.engine.ops.select_kernels`) that runs every layer's paged attention.

A backend answers two questions, each over the paged cache
``[num_blocks, block_size, kv_heads, head_dim]``: how the *paged rows* attend (one query token
each, through its own table: :meth:`~AttentionBackend.attend_rows`) and how the *dense chunks*
attend (a prompt, or a long chunk behind a cached prefix: :meth:`~AttentionBackend.attend_chunks`).
:meth:`~AttentionBackend.forward`, shared by all, stores the step's new K/V through the layer's
:class:`~kvlab.engine.kv_cache.KVLayer` and runs both (:meth:`~AttentionBackend.attend`). The
backends:

- :class:`~kvlab.engine.attention_torch.TorchAttention`: gathers and SDPA, the definition the
  others are tested against;
- :class:`~kvlab.engine.attention_cpu.CpuAttention`: kvlab's compiled CPU ops;
- :class:`~kvlab.engine.attention_triton.TritonAttention`: Triton's decode kernel on CUDA.

Chapter 7 reads them in this order.

A layer with a sliding window passes ``window = W``: a query at position ``i`` then sees the keys
at ``i - W + 1 .. i`` only (transformers' ``sliding_window_overlay``, vLLM's ``(W - 1, 0)``
FlashAttention window); ``window = 0``, every layer of a full-attention model, sees ``0 .. i``.
Table entries of blocks wholly before a row's window are never read (a hybrid manager frees
those blocks and leaves stale ids there).
"""

from __future__ import annotations

import torch

from kvlab.engine.attention_metadata import AttentionMetadata
from kvlab.engine.kv_cache import KVLayer

__all__ = ["AttentionBackend"]


class AttentionBackend:
    """The contract every attention backend keeps (see the module docstring).

    ``paged_max_tokens``: a chunk behind a cached prefix with at most this many tokens is
    attended row by row through its table, as decodes are (0: only single-token rows); the
    metadata builder reads it."""

    name = "abstract"
    paged_max_tokens = 0

    def __eq__(self, other: object) -> bool:   # the same kind over the same ops
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVLayer,
                meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        """One layer's attention in a step: store the new ``k, v: [N, KV, D]`` through ``kv``,
        then :meth:`attend` over what ``kv`` gives to read; ``q: [N, H, D]`` -> ``[N, H, D]``.
        ``window``: the layer's sliding window (0: none; see the module docstring)."""
        kv.write(k, v, meta.slot_mapping)
        k_cache, v_cache, meta = kv.view(meta)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale, kv.exact, window)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               exact: bool = True, window: int = 0) -> torch.Tensor:
        """Attention of the flat batch over paged caches that already hold the step's new
        K/V: the paged rows (:meth:`attend_rows`), then the dense chunks
        (:meth:`attend_chunks`)."""
        out = torch.empty_like(q)
        rows = meta.paged_rows
        if rows.numel() == q.shape[0]:          # a decode step: every row is a paged row
            self.attend_rows(out, q.contiguous(), k_cache, v_cache, meta.paged_tables,
                             meta.paged_lens, scale, window)
        elif rows.numel():
            o = q.new_empty((rows.numel(), *q.shape[1:]))
            self.attend_rows(o, q.index_select(0, rows), k_cache, v_cache, meta.paged_tables,
                             meta.paged_lens, scale, window)
            out.index_copy_(0, rows, o)
        if meta.dense:
            self.attend_chunks(out, q, k, v, k_cache, v_cache, meta, scale, exact, window)
        return out

    def attend_rows(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    scale: float, window: int = 0) -> None:
        """Row ``r`` of ``q [R, H, D]`` attends the first ``lens[r]`` positions of table
        ``tables[r]`` (the last ``window`` of them when ``window > 0``), written into
        ``out [R, H, D]`` (contiguous)."""
        raise NotImplementedError

    def attend_chunks(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, exact: bool,
                      window: int = 0) -> None:
        """Write the causal attention of every dense chunk of ``meta`` into ``out [N, H, D]``
        (each query seeing its last ``window`` positions when ``window > 0``).
        A fresh prompt attends its own new ``k, v``; a chunk behind a cached prefix reads the
        prefix and itself through its table. ``exact``: the cache gives back exactly what was
        written, so a fresh prompt may read itself from the cache too."""
        raise NotImplementedError
