"""The torch attention backend: paged attention computed with gathers and SDPA, the definition
the compiled backends are tested against. It runs wherever no compiled op does (the CPU with
``KVLAB_CPU_ATTENTION=0`` or no compiler, CUDA without Triton), and the other backends call its
functions for what they do not compile (the dense chunks on CUDA). Chapter 7.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.engine.attention import AttentionBackend
from kvlab.engine.attention_metadata import AttentionMetadata

__all__ = ["TorchAttention", "attend_behind_prefix", "attend_chunks", "attend_rows",
           "attend_window"]


class TorchAttention(AttentionBackend):
    """Paged rows: :func:`attend_rows`; dense chunks: :func:`attend_chunks`."""

    name = "torch"

    def attend_rows(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    scale: float, window: int = 0) -> None:
        out.copy_(attend_rows(q, k_cache, v_cache, tables, lens, scale, window))

    def attend_chunks(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, exact: bool,
                      window: int = 0) -> None:
        attend_chunks(out, q, k, v, k_cache, v_cache, meta, meta.dense, scale, window)


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                tables: torch.Tensor, lens: torch.Tensor, scale: float,
                window: int = 0) -> torch.Tensor:
    """Row ``r`` of ``q [R, H, D]`` attends the first ``lens[r]`` positions of ``tables[r]``
    (the last ``window`` of them when ``window > 0``), gathered into one padded
    ``[R, KV, W*bs, D]``; returns ``[R, H, D]``."""
    rows, heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    first = 0
    if window and lens.device.type == "cpu":   # gather only from the first block a window
        first = max(0, int(lens.min()) - window) // bs   # reaches (no sync on a GPU)
        tables = tables[:, first:].contiguous()
    span = tables.shape[1] * bs
    k = k_cache.index_select(0, tables.reshape(-1)).view(rows, span, kv_heads, dim)
    v = v_cache.index_select(0, tables.reshape(-1)).view(rows, span, kv_heads, dim)
    pos = torch.arange(first * bs, first * bs + span, device=q.device)[None, :]
    mask = pos < lens[:, None]
    if window:
        mask &= pos >= (lens - window)[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None],
        scale=scale, enable_gqa=heads != kv_heads)
    return out[:, :, 0]


def attend_chunks(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  chunks: tuple[int, ...], scale: float, window: int = 0) -> None:
    """Write the attention of ``chunks`` (dense chunks of ``meta``) into ``out [N, H, D]``: a
    fresh prompt is one causal SDPA over its new ``k, v [N, KV, D]``; a chunk behind a cached
    prefix reads the prefix and its own K/V through its table (:func:`attend_behind_prefix`),
    as the compiled chunk op does, so both paths see what the cache stores (a quantized cache's
    rounded values included). With a ``window``: :func:`attend_window`."""
    if window:
        attend_window(out, q, k, v, k_cache, v_cache, meta, chunks, scale, window)
        return
    _, bs, kv_heads, dim = k_cache.shape
    for s in chunks:
        lo, hi, start = meta.query_start[s], meta.query_start[s + 1], meta.start_pos[s]
        qc = q[lo:hi].transpose(0, 1)[None]                                 # [1, heads, n, D]
        if start == 0:
            kc, vc = (t[lo:hi].transpose(0, 1)[None] for t in (k, v))
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale,
                                               enable_gqa=q.shape[1] != kv_heads)
        else:
            end = start + hi - lo
            blocks = meta.block_tables[s, :-(-end // bs)]
            kt, vt = (c.index_select(0, blocks).view(-1, kv_heads, dim)[:end].transpose(0, 1)
                      for c in (k_cache, v_cache))
            o = attend_behind_prefix(qc, kt[None, :, :start], vt[None, :, :start],
                                     kt[None, :, start:], vt[None, :, start:], scale)
        out[lo:hi] = o[0].transpose(0, 1)


def attend_window(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  chunks: tuple[int, ...], scale: float, window: int) -> None:
    """:func:`attend_chunks` for a sliding-window layer: query ``i`` of a chunk sees keys
    ``i - window + 1 .. i``, by one SDPA with a boolean band mask. A fresh prompt reads its own
    new ``k, v``; a chunk behind a prefix reads, through its table, only the blocks from the
    first one its first query's window reaches."""
    _, bs, kv_heads, dim = k_cache.shape
    gqa = q.shape[1] != kv_heads
    for s in chunks:
        lo, hi, start = meta.query_start[s], meta.query_start[s + 1], meta.start_pos[s]
        end = start + hi - lo
        first = max(0, start - window + 1) // bs * bs        # first key position read
        if start == 0:
            kc, vc = (t[lo:hi].transpose(0, 1)[None] for t in (k, v))
        else:
            blocks = meta.block_tables[s, first // bs:-(-end // bs)]
            kc, vc = (c.index_select(0, blocks).view(-1, kv_heads, dim)[:end - first]
                      .transpose(0, 1)[None] for c in (k_cache, v_cache))
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(first, end, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], kc, vc,
                                           attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[lo:hi] = o[0].transpose(0, 1)


def attend_behind_prefix(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q [1, H, n, D]`` at positions ``P .. P+n-1`` over a prefix's
    ``kp, vp [1, KV, P, D]`` and its own ``k, v [1, KV, n, D]``. On the CPU: two flash calls
    without a mask (the prefix in full, the chunk causal) merged by their log-sum-exps, as
    vLLM merges a prefix's and a suffix's attention (``merge_attn_states``,
    ``vllm/v1/attention/ops/merge_attn_states.py``, v0.32.0); a boolean mask would take
    torch's CPU flash kernel off its causal fast path (about twice the time). Elsewhere one
    SDPA with a bottom-right causal mask."""
    gqa, start, n = q.shape[1] != k.shape[1], kp.shape[2], q.shape[2]
    if q.device.type != "cpu":
        mask = torch.arange(start + n, device=q.device) <= torch.arange(
            start, start + n, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, torch.cat((kp, k), 2), torch.cat((vp, v), 2),
                                              attn_mask=mask, scale=scale, enable_gqa=gqa)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, lse1 = flash(q, kp, vp, scale=scale)[:2]
    o2, lse2 = flash(q, k, v, is_causal=True, scale=scale)[:2]
    share = torch.sigmoid(lse1 - lse2)[..., None]        # the prefix's share of the softmax
    o1, o2 = o1.to(share.dtype), o2.to(share.dtype)
    return o1.sub_(o2).mul_(share).add_(o2).to(q.dtype)
