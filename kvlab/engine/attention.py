"""Paged attention over a flattened mixed batch, and the dense reference it is tested against.

One engine step feeds the model a *flattened* batch: the tokens of every scheduled chunk laid end
to end (``N`` tokens). A chunk is either a prefill chunk (``q > 1`` new tokens at positions
``start .. start+q-1``, attending causally to its cached prefix ``0 .. start-1`` plus itself) or a
single token (a decode, or a one-token prefill chunk) attending to positions ``0 .. start``.

:func:`build_metadata` turns the chunks into index tensors once per step (every layer reuses
them). Tokens are reordered so that all single-token chunks come first, sorted by context
length. On CPU they are attended in one call of the compiled kernel
(:mod:`kvlab.engine.cpu_kernels`), which reads K/V through the block tables where they lie; on
CUDA by the Triton kernel; otherwise they are split into a few buckets, each attended as one
padded batch gathered block by block into a reusable workspace
(:mod:`kvlab.engine.bucket_attention`). Short chunks behind a cached prefix (speculative
verification) also go to the CPU kernel, one row per token. Other multi-token chunks go
through SDPA: equal-length ones behind a cached prefix in padded groups
(:mod:`kvlab.engine.prefill_groups`), the rest one by one (a Python loop per *chunk*, never per
token); a chunk with no cached prefix attends to its own fresh K/V with a causal mask and never
touches the cache for reading.

KV layout per layer: ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``; a
position ``p`` of a request lives at flat slot ``block_table[p // block_size] * block_size +
p % block_size`` (spec rule 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import cpu_kernels, triton_kernels
from .bucket_attention import attend_bucket

if TYPE_CHECKING:
    from .prefill_groups import KernelRows, PrefillGroup

#: default of :func:`paged_attention`'s ``batch_prefills`` (benchmarks switch it off to compare)
BATCH_PREFILLS = True
#: default of :func:`paged_attention`'s ``cpu_kernel`` (tests switch it off for the torch path)
CPU_KERNEL = True

__all__ = [
    "AttentionMetadata",
    "ChunkSpec",
    "DecodeBucket",
    "PrefillChunk",
    "Workspace",
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


@dataclass(frozen=True)
class DecodeBucket:
    """Single-token chunks attended together: flat rows ``row0 .. row0+B-1``.

    ``block_index``: ``[B * max_blocks]`` physical blocks (tables padded with block 0, row-major);
    ``mask``: ``[B, 1, max_blocks * block_size]`` additive (0 where the key position is in
    the context, -inf elsewhere; may be a strided view).
    """

    row0: int
    size: int
    max_blocks: int
    block_index: torch.Tensor
    mask: torch.Tensor


class Workspace:
    """Reusable scratch buffers (one per name, grown on demand, never shrunk).

    Fresh multi-megabyte tensors cost page faults on every allocation; attention gathers K/V
    into these instead. Not thread-safe; one per executor.
    """

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.device, self.dtype = torch.device(device), dtype
        self._buffers: dict[str, torch.Tensor] = {}
        self._index: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` backed by buffer ``name`` (contents undefined)."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), device=self.device, dtype=self.dtype)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def head_map(self, heads: int, kv_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For grouped-query attention: ``h = arange(heads)``, each head's KV head
        ``h // (heads // kv_heads)``, and the one-hot ``[heads, kv_heads, 1]`` of that map
        (in the workspace dtype). Cached per shape."""
        key = ("head_map", heads, kv_heads)
        if key not in self._index:
            h = torch.arange(heads, device=self.device)
            kv = h // (heads // kv_heads)
            onehot = torch.zeros(heads, kv_heads, 1, device=self.device, dtype=self.dtype)
            onehot[h, kv] = 1
            self._index[key] = (h, kv, onehot)
        return self._index[key]


@dataclass
class AttentionMetadata:
    """Index tensors of one step (all on the model's device).

    ``last_row[c]`` is the flat row of chunk ``c``'s last token (its logits sample the next
    token). Rows ``0 .. num_single-1`` hold the single-token chunks (sorted by context length
    and split into :class:`DecodeBucket` s); multi-token chunks follow.
    """

    input_ids: torch.Tensor      # [N] long
    positions: torch.Tensor      # [N] long
    slot_mapping: torch.Tensor   # [N] long, flat slot each new K/V is written to
    num_single: int
    buckets: list[DecodeBucket]
    prefills: list[PrefillChunk]
    last_row: list[int]          # per input chunk (caller's order)
    block_size: int
    workspace: Workspace | None = None
    max_position: int = 0        # the largest entry of ``positions``
    #: all single-token rows at once, for kernels that need no buckets: their block tables
    #: ``[num_single, W]`` (padded with block 0) and context lengths ``positions + 1``
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    #: ``prefills`` split into padded groups and the chunks attended alone (filled on first use
    #: by :func:`~kvlab.engine.prefill_groups.group_prefills`; every layer reuses it)
    prefill_plan: tuple[list[PrefillGroup], list[PrefillChunk]] | None = None
    #: the short chunks the CPU kernel attends (:func:`~kvlab.engine.prefill_groups.kernel_rows`)
    kernel_plan: KernelRows | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def split_buckets(num_blocks_sorted: list[int], min_size: int = 8, max_buckets: int = 6
                   ) -> list[tuple[int, int]]:
    """Split rows sorted by table length into <= ``max_buckets`` contiguous equal-count groups
    of >= ``min_size`` rows (padding waste shrinks with the spread inside each group)."""
    n = len(num_blocks_sorted)
    k = max(1, min(max_buckets, n // min_size))
    if num_blocks_sorted and num_blocks_sorted[0] == num_blocks_sorted[-1]:
        k = 1
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]


def build_metadata(
    chunks: Sequence[ChunkSpec], block_size: int, device: torch.device | str = "cpu",
    workspace: Workspace | None = None,
) -> AttentionMetadata:
    """Lay out ``chunks`` as one flat batch (single-token chunks first) and index it.

    Raises ValueError when a chunk is empty or its block table does not cover its positions.
    """
    if not chunks:
        raise ValueError("build_metadata: no chunks to run")
    for i, c in enumerate(chunks):
        if len(c.token_ids) == 0:
            raise ValueError(f"build_metadata: chunk {i} has no tokens")
        end = c.start_pos + len(c.token_ids)
        if c.start_pos < 0 or len(c.block_table) * block_size < end:
            raise ValueError(
                f"build_metadata: chunk {i} block table ({len(c.block_table)} blocks of "
                f"{block_size}) does not cover positions {c.start_pos}..{end - 1}"
            )
    # single-token chunks, sorted by context length so buckets pad little
    singles = sorted((i for i, c in enumerate(chunks) if len(c.token_ids) == 1),
                     key=lambda i: chunks[i].start_pos)
    multis = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
    ids: list[int] = []
    last_row = [0] * len(chunks)
    pos_list: list[int] = []
    slot_list: list[int] = []
    buckets: list[DecodeBucket] = []
    decode_tables = None
    if singles:
        need = []
        for row, i in enumerate(singles):
            c = chunks[i]
            p = c.start_pos
            ids.append(c.token_ids[0])
            last_row[i] = row
            pos_list.append(p)
            slot_list.append(c.block_table[p // block_size] * block_size + p % block_size)
            need.append(p // block_size + 1)
        # one additive mask for all rows (key position > query position -> -inf), sliced per
        # bucket: rows lo..hi-1 and the first nb blocks
        width = need[-1]
        span = torch.arange(width * block_size)
        dtype = workspace.dtype if workspace is not None else torch.float32
        mask_all = torch.zeros(len(singles), width * block_size, dtype=dtype).masked_fill_(
            span[None, :] > torch.tensor(pos_list)[:, None], float("-inf")).to(device)
        tables = torch.tensor([list(chunks[i].block_table[:width])
                               + [0] * (width - min(width, len(chunks[i].block_table)))
                               for i in singles], dtype=torch.long)
        for lo, hi in split_buckets(need):
            nb = need[hi - 1]
            buckets.append(DecodeBucket(lo, hi - lo, nb,
                                        tables[lo:hi, :nb].reshape(-1).to(device),
                                        mask_all[lo:hi, None, :nb * block_size]))
        decode_tables = tables.to(device)
    pos_parts = [torch.tensor(pos_list, dtype=torch.long)]
    slot_parts = [torch.tensor(slot_list, dtype=torch.long)]
    prefills: list[PrefillChunk] = []
    offset = len(singles)
    for i in multis:
        c = chunks[i]
        q = len(c.token_ids)
        ids.extend(c.token_ids)
        all_pos = torch.arange(c.start_pos + q)
        table = torch.tensor(c.block_table[:-(-(c.start_pos + q) // block_size)],
                             dtype=torch.long)
        all_slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[
            :c.start_pos + q]      # the slot of every position 0 .. end-1 (spec rule 2)
        pos_parts.append(all_pos[c.start_pos:])
        slot_parts.append(all_slots[c.start_pos:])
        prefills.append(PrefillChunk(offset, q, c.start_pos, all_slots.to(device)))
        last_row[i] = offset + q - 1
        offset += q
    return AttentionMetadata(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=(pos_parts[0] if len(pos_parts) == 1 else torch.cat(pos_parts)).to(device),
        slot_mapping=(slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts)).to(
            device),
        num_single=len(singles),
        buckets=buckets,
        prefills=prefills,
        last_row=last_row,
        block_size=block_size,
        workspace=workspace,
        max_position=max(c.start_pos + len(c.token_ids) for c in chunks) - 1,
        decode_tables=decode_tables,
        decode_lens=(pos_parts[0] + 1).to(device) if singles else None,
    )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new ``k, v: [N, kv_heads, D]`` at flat slots ``slot_mapping: [N]`` (in place).
    On CUDA with Triton installed this is :func:`kvlab.engine.triton_kernels.store_kv`."""
    if k_cache.is_cuda and triton_kernels.available():
        triton_kernels.store_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    kv_heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    *, batch_prefills: bool | None = None, cpu_kernel: bool | None = None,
) -> torch.Tensor:
    """Attention of the flat batch; ``q: [N, H, D]``, new ``k, v: [N, KV, D]`` -> ``[N, H, D]``.

    The new K/V must already be written to the cache (:func:`write_kv`): single-token chunks and
    chunks with a cached prefix read their whole context from the cache. On CUDA with Triton
    installed the decode buckets run :func:`kvlab.engine.triton_kernels.decode_attention` on the
    same metadata (tables from ``block_index``, lengths from ``positions``); on CPU all of them
    run in one call of the compiled kernel of :mod:`kvlab.engine.cpu_kernels` where it built,
    with the short chunks behind a cached prefix (``cpu_kernel=False``: the torch gather path
    and SDPA; None: the module's :data:`CPU_KERNEL`).

    Other multi-token chunks with a cached prefix and equal length are attended in padded
    groups (:mod:`kvlab.engine.prefill_groups`), one call per group, not per chunk;
    ``batch_prefills=False`` attends every chunk alone (the reference it is tested against;
    None: the module's :data:`BATCH_PREFILLS`).
    """
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    gqa = heads != kv_heads
    out = torch.empty_like(q)
    ws = meta.workspace or Workspace(q.device, q.dtype)
    fused = q.is_cuda and triton_kernels.available()
    compiled = (not q.is_cuda and q.dtype in cpu_kernels.DTYPES
                and (CPU_KERNEL if cpu_kernel is None else cpu_kernel) and cpu_kernels.available())
    if compiled and meta.decode_tables is not None:  # every single-token row in one call
        rows = slice(0, meta.num_single)
        cpu_kernels.decode_attention(q[rows], k_cache, v_cache, meta.decode_tables,
                                     meta.decode_lens, scale, out=out[rows])
    for b in [] if compiled else meta.buckets:
        rows = slice(b.row0, b.row0 + b.size)
        if fused:
            triton_kernels.decode_attention(
                q[rows], k_cache, v_cache, b.block_index.view(b.size, b.max_blocks),
                meta.positions[rows], scale, out=out[rows])
        else:
            out[rows] = attend_bucket(q[rows], k_cache, v_cache, b, scale, ws)
    flat_k = k_cache.view(-1, kv_heads, dim)
    flat_v = v_cache.view(-1, kv_heads, dim)
    prefills = meta.prefills
    behind = any(c.start_pos > 0 for c in prefills)   # chunks that read a cached prefix
    if compiled and behind:  # short chunks behind a cached prefix: one kernel row per token
        from .prefill_groups import kernel_rows

        plan = kernel_rows(meta)
        if plan.rows.numel():
            out.index_copy_(0, plan.rows, cpu_kernels.decode_attention(
                q.index_select(0, plan.rows), k_cache, v_cache, plan.tables, plan.lens, scale))
        prefills = plan.rest
    alone = prefills
    if behind and prefills and (BATCH_PREFILLS if batch_prefills is None else batch_prefills):
        from .prefill_groups import attend_groups, group_prefills

        groups, alone = group_prefills(meta, chunks=prefills)
        attend_groups(q, flat_k, flat_v, groups, scale, out)
    for c in alone:
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
