"""Speculative verification as one attention call: equal-length multi-token chunks, batched.

A verification step gives every speculating request a chunk of ``k + 1`` tokens after its cached
context. :func:`~kvlab.engine.attention.paged_attention` used to attend multi-token chunks one
by one (a gather and an SDPA call per request and layer), which made a verification cost 1-3x a
decode step. Here chunks that read a cached prefix and have the same length are sorted by
context, split into groups like the decode buckets (little padding), and each group runs as one
padded ``scaled_dot_product_attention`` over ``[group, heads, k+1, span]`` with a causal-and-length
mask. Chunks without a cached prefix (fresh prompts) and lone lengths keep the per-chunk path.
Results equal the per-chunk path up to float rounding (``tests/test_prefill_groups.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .attention import AttentionMetadata, PrefillChunk

__all__ = ["KernelRows", "PrefillGroup", "attend_groups", "group_prefills", "kernel_rows"]

#: chunks with a cached prefix up to this long go to the CPU kernel, one row per query token
#: (each row re-reads the context, so long chunks stay with SDPA's matmuls)
KERNEL_MAX_TOKENS = 16


@dataclass(frozen=True)
class PrefillGroup:
    """Multi-token chunks of the same length ``num_tokens``, each with a cached prefix,
    attended in one padded call (speculative verification makes many such chunks per step).

    ``rows``: ``[size * num_tokens]`` flat rows, chunk after chunk; ``slots``: ``[size * span]``
    flat cache slots of each chunk's positions ``0 .. span-1`` (a chunk shorter than ``span`` is
    padded with its own position-0 slot); ``mask``: ``[size, 1, num_tokens, span]`` bool, True
    where the key position is at or before the query's (padding is never attended).
    """

    size: int
    num_tokens: int
    span: int
    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor



@dataclass(frozen=True)
class KernelRows:
    """Short chunks with a cached prefix (speculative verification) as rows of the CPU decode
    kernel (:mod:`kvlab.kernels.cpu`): query token ``i`` of a chunk at ``start_pos``
    attends ``start_pos + i + 1`` positions through its chunk's block table.

    ``rows``: ``[R]`` flat rows; ``tables``: ``[R, W]`` block ids (padded with 0); ``lens``:
    ``[R]``; ``rest``: the step's other multi-token chunks, left to SDPA.
    """

    rows: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    rest: list[PrefillChunk]


def kernel_rows(meta: AttentionMetadata) -> KernelRows:
    """Split the step's multi-token chunks into :class:`KernelRows` (those with a cached prefix
    and at most :data:`KERNEL_MAX_TOKENS` tokens) and the rest. Cached on ``meta``."""
    if meta.kernel_plan is not None:
        return meta.kernel_plan
    bs = meta.block_size
    fits = [c.start_pos > 0 and c.num_tokens <= KERNEL_MAX_TOKENS for c in meta.prefills]
    short = [c for c, f in zip(meta.prefills, fits, strict=True) if f]
    rest = [c for c, f in zip(meta.prefills, fits, strict=True) if not f]
    dev = meta.positions.device
    tabs = [c.slots[::bs] // bs for c in short]   # the block of positions 0, bs, 2 bs, ...
    total = sum(c.num_tokens for c in short)
    tables = torch.zeros(total, max((t.numel() for t in tabs), default=0), dtype=torch.long,
                         device=dev)
    at = 0
    for c, t in zip(short, tabs, strict=True):
        tables[at:at + c.num_tokens, :t.numel()] = t
        at += c.num_tokens
    rows = [torch.arange(c.offset, c.offset + c.num_tokens) for c in short]
    lens = [torch.arange(c.start_pos + 1, c.start_pos + c.num_tokens + 1) for c in short]
    empty = torch.zeros(0, dtype=torch.long)
    meta.kernel_plan = KernelRows(torch.cat(rows).to(dev) if rows else empty.to(dev), tables,
                                  torch.cat(lens).to(dev) if lens else empty.to(dev), rest)
    return meta.kernel_plan


def group_prefills(meta: AttentionMetadata,
                   split: Callable[..., list[tuple[int, int]]], min_size: int = 2,
                   chunks: list[PrefillChunk] | None = None
                   ) -> tuple[list[PrefillGroup], list[PrefillChunk]]:
    """Batch the step's multi-token chunks that read a cached prefix (``start_pos > 0``) by
    length: chunks of equal ``num_tokens`` are sorted by context and cut by ``split`` (the
    decode buckets' :func:`~kvlab.engine.attention.split_buckets`: little padding); each
    group of >= ``min_size`` becomes one :class:`PrefillGroup`; the rest (fresh prompts,
    lone lengths) are returned as they are.
    ``chunks``: a subset of ``meta.prefills`` to plan (default all; the same one every layer).
    Cached on ``meta`` (every layer reuses the plan)."""
    if meta.prefill_plan is not None:
        return meta.prefill_plan
    by_len: dict[int, list[PrefillChunk]] = {}
    alone: list[PrefillChunk] = []
    for c in meta.prefills if chunks is None else chunks:
        if c.start_pos > 0:
            by_len.setdefault(c.num_tokens, []).append(c)
        else:
            alone.append(c)
    groups: list[PrefillGroup] = []
    for q, cs in by_len.items():
        if len(cs) < min_size:
            alone.extend(cs)
            continue
        cs.sort(key=lambda c: c.start_pos)
        for lo, hi in split([c.start_pos for c in cs], min_size=4):
            part = cs[lo:hi]
            if len(part) < min_size:
                alone.extend(part)
                continue
            span = part[-1].start_pos + q
            slots = torch.cat([c.slots if c.slots.numel() == span else torch.cat(
                [c.slots, c.slots[:1].expand(span - c.slots.numel())]) for c in part])
            rows = torch.cat([torch.arange(c.offset, c.offset + q) for c in part])
            qpos = torch.tensor([c.start_pos for c in part])[:, None] + torch.arange(q)
            mask = torch.arange(span)[None, None, :] <= qpos[:, :, None]
            dev = part[0].slots.device
            groups.append(PrefillGroup(len(part), q, span, rows.to(dev), slots,
                                       mask[:, None].to(dev)))
    meta.prefill_plan = (groups, alone)
    return meta.prefill_plan


def attend_groups(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor,
                  groups: list[PrefillGroup], scale: float, out: torch.Tensor) -> None:
    """Attention of every group's rows of ``q: [N, H, D]`` over its padded context from the
    flat caches ``[slots, KV, D]``, written into ``out: [N, H, D]`` at the same rows."""
    _, heads, dim = q.shape
    kv_heads = flat_k.shape[1]
    for g in groups:
        n, qn, t = g.size, g.num_tokens, g.span
        qg = q.index_select(0, g.rows).view(n, qn, heads, dim).transpose(1, 2)
        kg = flat_k.index_select(0, g.slots).view(n, t, kv_heads, dim).transpose(1, 2)
        vg = flat_v.index_select(0, g.slots).view(n, t, kv_heads, dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale,
                                           enable_gqa=heads != kv_heads)   # [n, H, q, D]
        out.index_copy_(0, g.rows, o.transpose(1, 2).reshape(n * qn, heads, dim))
