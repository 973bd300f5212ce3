"""Decode attention by gathering: the torch path of :func:`kvlab.engine.attention.paged_attention`.

A :class:`~kvlab.engine.attention.DecodeBucket`'s blocks are gathered into a reusable workspace
as a padded batch ``[B, T, KV, D]`` and attended with batched matmuls under the bucket's length
mask. Where the compiled CPU kernel (:mod:`kvlab.kernels.cpu`) or the Triton kernel runs,
this is the reference it is tested against; elsewhere it is the path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .attention import DecodeBucket, Workspace

__all__ = ["attend_bucket", "attend_bucket_block_diagonal", "gather_bucket"]


def gather_bucket(k_cache: torch.Tensor, v_cache: torch.Tensor, b: DecodeBucket,
                  ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket's K and V blocks in workspace buffers, one row of ``block_size * KV * D`` per
    table entry (``[B * max_blocks, ...]``, row-major by request)."""
    num_blocks = k_cache.shape[0]
    flat_k, flat_v = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
    rows = b.block_index.numel()
    gk = torch.index_select(flat_k, 0, b.block_index, out=ws.get("gk", (rows, flat_k.shape[1])))
    gv = torch.index_select(flat_v, 0, b.block_index, out=ws.get("gv", (rows, flat_v.shape[1])))
    return gk, gv


def attend_bucket(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   b: DecodeBucket, scale: float, ws: Workspace) -> torch.Tensor:
    """Attention of ``q: [B, H, D]`` (one token each) over their block tables -> [B, H, D].

    K/V blocks are gathered into ``[B, T, KV, D]`` (no transpose copy). Query heads are grouped
    by KV head (``q.view(B, KV, G, D)``, ``G = H // KV``) and each KV head ``j`` runs two batched
    matmuls directly on the strided view ``K[:, :, j]`` (row stride ``KV * D``, no copy):
    ``[B, G, D] @ [B, D, T]`` and ``[B, G, T] @ [B, T, D]``; exactly the QK^T and PV work needed.

    Why not one matmul over ``[B, KV, ...]``: that needs K as ``[B, KV, T, D]``, a transpose
    copy of the whole gathered context (it doubled the time of an earlier grouped version), and
    writing into a strided ``out=`` slice sends CPU ``bmm`` to a per-matrix ``addmm`` loop.
    Each per-head ``bmm`` here has unit-stride rows and a fresh output, so it stays one batched
    BLAS call. The block-diagonal query it replaces does ``KV`` times the QK^T/PV work and is
    slower for groups of 2+ heads, but faster for multi-head attention (group 1), where the
    grouped form degenerates to ``KV`` matrix-vector products; it is kept for that case
    (measured in ``benchmarks/bench_decode_attention.py``).
    """
    _, bs, kv_heads, dim = k_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads
    if group == 1 and kv_heads > 1:  # multi-head: per-head matrix-vector products lose
        return attend_bucket_block_diagonal(q, k_cache, v_cache, b, scale, ws)
    t = b.max_blocks * bs
    gk, gv = gather_bucket(k_cache, v_cache, b, ws)
    k4 = gk.view(b.size, t, kv_heads, dim)
    v4 = gv.view(b.size, t, kv_heads, dim)
    qg = q.view(b.size, kv_heads, group, dim)
    mask = b.mask.to(q.dtype).expand(b.size, group, t)
    outs = [torch.bmm(torch.baddbmm(mask, qg[:, j], k4[:, :, j].transpose(1, 2),
                                    alpha=scale).softmax(-1), v4[:, :, j])
            for j in range(kv_heads)]
    return (outs[0] if kv_heads == 1 else torch.stack(outs, 1)).view(b.size, heads, dim)


def attend_bucket_block_diagonal(q: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, b: DecodeBucket, scale: float,
                                  ws: Workspace) -> torch.Tensor:
    """:func:`attend_bucket` with a block-diagonal query: head ``h`` is placed in the columns
    of its KV head ``h // group`` (zeros elsewhere), so one ``[B, H, KV*D] @ [B, KV*D, T]``
    matmul scores every head against its own KV head; PV is read back on the same diagonal."""
    _, bs, kv_heads, dim = k_cache.shape
    heads = q.shape[1]
    t = b.max_blocks * bs
    gk, gv = gather_bucket(k_cache, v_cache, b, ws)
    heads_idx = torch.arange(heads, device=ws.device)
    kv_idx = heads_idx // (heads // kv_heads)            # each query head's KV head
    onehot = torch.zeros(heads, kv_heads, 1, device=ws.device, dtype=ws.dtype)
    onehot[heads_idx, kv_idx] = 1
    qd = q[:, :, None, :] * onehot  # [B, H, KV, D], zero outside each head's own KV head
    scores = torch.baddbmm(b.mask.to(q.dtype).expand(b.size, heads, t),
                           qd.view(b.size, heads, kv_heads * dim),
                           gk.view(b.size, t, kv_heads * dim).transpose(1, 2), alpha=scale)
    out = torch.bmm(scores.softmax(-1), gv.view(b.size, t, kv_heads * dim))
    return out.view(b.size, heads, kv_heads, dim)[:, heads_idx, kv_idx]
