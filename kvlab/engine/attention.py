"""Paged attention over a flattened mixed batch, and the dense reference it is tested against.

One engine step feeds the model a *flattened* batch: the tokens of every scheduled chunk laid end
to end (``N`` tokens). A chunk is either a prefill chunk (``q > 1`` new tokens at positions
``start .. start+q-1``, attending causally to its cached prefix ``0 .. start-1`` plus itself) or a
single token (a decode, or a one-token prefill chunk) attending to positions ``0 .. start``.

:func:`build_metadata` turns the chunks into index tensors once per step (every layer reuses
them). Tokens are reordered so that all single-token chunks come first: they are attended
together in one padded batch ``[B, T, kv_heads, D]`` gathered through their block tables, with a
length mask. Multi-token chunks are attended one by one (a Python loop per *chunk*, never per
token); a chunk with no cached prefix attends to its own fresh K/V with a causal mask and never
touches the cache for reading.

KV layout per layer: ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``; a
position ``p`` of a request lives at flat slot ``block_table[p // block_size] * block_size +
p % block_size`` (spec rule 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionMetadata",
    "ChunkSpec",
    "PrefillChunk",
    "build_metadata",
    "dense_causal_attention",
    "paged_attention",
    "write_kv",
]


@dataclass(frozen=True)
class ChunkSpec:
    """One request's tokens in a step: ``token_ids`` at positions ``start_pos ...``."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class PrefillChunk:
    """A multi-token chunk inside the reordered flat batch: rows ``offset .. offset+q-1``."""

    offset: int
    num_tokens: int
    start_pos: int
    slots: torch.Tensor  # [start_pos + num_tokens] flat slots of positions 0..end-1 (long)


@dataclass
class AttentionMetadata:
    """Index tensors of one step (all on the model's device).

    ``order[i]`` is the index (in the caller's chunk list) of the chunk owning flat row group i;
    ``last_row[c]`` is the flat row of chunk ``c``'s last token (its logits sample the next token).
    Rows ``0 .. num_single-1`` are the single-token chunks, in ``single_chunks`` order.
    """

    input_ids: torch.Tensor      # [N] long
    positions: torch.Tensor      # [N] long
    slot_mapping: torch.Tensor   # [N] long, flat slot each new K/V is written to
    num_single: int
    single_block_tables: torch.Tensor | None  # [B, max_blocks] long (padded with block 0)
    single_context_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]
    last_row: list[int]          # per input chunk (caller's order)
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_metadata(
    chunks: Sequence[ChunkSpec], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Lay out ``chunks`` as one flat batch (single-token chunks first) and index it.

    Raises ValueError when a chunk is empty or its block table does not cover its positions.
    """
    if not chunks:
        raise ValueError("build_metadata: no chunks to run")
    singles = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    multis = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
    for i, c in enumerate(chunks):
        if len(c.token_ids) == 0:
            raise ValueError(f"build_metadata: chunk {i} has no tokens")
        end = c.start_pos + len(c.token_ids)
        if c.start_pos < 0 or len(c.block_table) * block_size < end:
            raise ValueError(
                f"build_metadata: chunk {i} block table ({len(c.block_table)} blocks of "
                f"{block_size}) does not cover positions {c.start_pos}..{end - 1}"
            )
    ids: list[int] = []
    last_row = [0] * len(chunks)
    # single-token chunks: vectorised slot computation
    s_pos = [chunks[i].start_pos for i in singles]
    for row, i in enumerate(singles):
        ids.append(chunks[i].token_ids[0])
        last_row[i] = row
    pos_parts: list[torch.Tensor] = []
    slot_parts: list[torch.Tensor] = []
    single_tables = single_mask = None
    if singles:
        max_blocks = max(len(chunks[i].block_table) for i in singles)
        table_rows = [list(chunks[i].block_table) for i in singles]
        padded = [r + [0] * (max_blocks - len(r)) for r in table_rows]
        tables = torch.tensor(padded, dtype=torch.long)
        pos = torch.tensor(s_pos, dtype=torch.long)
        slots = tables.gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
        pos_parts.append(pos)
        slot_parts.append(slots)
        span = torch.arange(max_blocks * block_size)
        single_mask = (span[None, :] <= pos[:, None])[:, None, None, :]
        single_tables = tables
    prefills: list[PrefillChunk] = []
    offset = len(singles)
    for i in multis:
        c = chunks[i]
        q = len(c.token_ids)
        ids.extend(c.token_ids)
        table = torch.tensor(list(c.block_table), dtype=torch.long)
        all_pos = torch.arange(c.start_pos + q)
        all_slots = table[all_pos // block_size] * block_size + all_pos % block_size
        pos_parts.append(all_pos[c.start_pos:])
        slot_parts.append(all_slots[c.start_pos:])
        prefills.append(PrefillChunk(offset, q, c.start_pos, all_slots.to(device)))
        last_row[i] = offset + q - 1
        offset += q
    return AttentionMetadata(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.cat(pos_parts).to(device),
        slot_mapping=torch.cat(slot_parts).to(device),
        num_single=len(singles),
        single_block_tables=None if single_tables is None else single_tables.to(device),
        single_context_mask=None if single_mask is None else single_mask.to(device),
        prefills=prefills,
        last_row=last_row,
        block_size=block_size,
    )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new ``k, v: [N, kv_heads, D]`` at flat slots ``slot_mapping: [N]`` (in place)."""
    kv_heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Attention of the flat batch; ``q: [N, H, D]``, new ``k, v: [N, KV, D]`` -> ``[N, H, D]``.

    The new K/V must already be written to the cache (:func:`write_kv`): single-token chunks and
    chunks with a cached prefix read their whole context from the cache.
    """
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    gqa = heads != kv_heads
    out = torch.empty_like(q)
    b = meta.num_single
    if b:
        tables = meta.single_block_tables
        # [B, nb, bs, KV, D] -> [B, KV, T, D]
        kc = k_cache[tables].flatten(1, 2).transpose(1, 2)
        vc = v_cache[tables].flatten(1, 2).transpose(1, 2)
        qs = q[:b].unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            qs, kc, vc, attn_mask=meta.single_context_mask, scale=scale, enable_gqa=gqa
        )
        out[:b] = o[:, :, 0]
    flat_k = k_cache.view(-1, kv_heads, dim)
    flat_v = v_cache.view(-1, kv_heads, dim)
    for c in meta.prefills:
        rows = slice(c.offset, c.offset + c.num_tokens)
        qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if c.start_pos == 0:
            kc = k[rows].transpose(0, 1).unsqueeze(0)
            vc = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            kc = flat_k[c.slots].transpose(0, 1).unsqueeze(0)  # [1, KV, T, D]
            vc = flat_v[c.slots].transpose(0, 1).unsqueeze(0)
            total = c.start_pos + c.num_tokens
            qpos = torch.arange(c.start_pos, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[rows] = o[0].transpose(0, 1)
    return out


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Reference: one sequence, ``q: [T, H, D]``, ``k, v: [T, KV, D]``, plain causal softmax.

    Written out with explicit matmuls and a float64 softmax (no SDPA, no paging) so that tests
    compare the paged path against an independent computation.
    """
    t, heads, _ = q.shape
    group = heads // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1).double()  # [H, T, D]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1).double()
    scores = q.transpose(0, 1).double() @ kk.transpose(1, 2) * scale  # [H, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(0, 1).to(q.dtype)
