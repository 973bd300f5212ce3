"""Paged attention over one step's flat batch, and the index tensors it reads. A step lays its
chunks end to end, single-token chunks first, sorted by context length (:func:`build_metadata`,
once per step); a chunk of ``q`` tokens at ``start`` attends causally to positions
``0 .. start+q-1``. KV per layer: ``[num_blocks, block_size, kv_heads, head_dim]``. Chapter 7.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvlab.kernels import cpu, triton

from .bucket_attention import attend_bucket

if TYPE_CHECKING:
    from .prefill_groups import KernelRows, PrefillGroup

BATCH_PREFILLS = True   # default of paged_attention's batch_prefills (benchmarks compare)

__all__ = ["AttentionMetadata", "ChunkSpec", "DecodeBucket", "PrefillChunk", "Workspace",
           "build_metadata", "paged_attention", "write_kv"]


@dataclass(frozen=True)
class ChunkSpec:
    """One request's tokens in a step: ``token_ids`` at positions ``start_pos ...``."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class PrefillChunk:
    """A multi-token chunk in the flat batch: rows ``offset .. offset+num_tokens-1``; ``slots``
    are the flat slots of its positions ``0 .. start_pos+num_tokens-1``."""

    offset: int
    num_tokens: int
    start_pos: int
    slots: torch.Tensor


@dataclass(frozen=True)
class DecodeBucket:
    """Single-token rows ``row0 .. row0+size-1`` attended together: ``block_index [size *
    max_blocks]`` (tables padded with block 0) and the additive length ``mask [size, 1,
    max_blocks * block_size]``."""

    row0: int
    size: int
    max_blocks: int
    block_index: torch.Tensor
    mask: torch.Tensor


class Workspace:
    """A runner's attention resources: scratch buffers that grow and are reused (fresh large
    tensors page-fault on every step), and ``decode_kernel``, the compiled CPU op
    (:func:`kvlab.kernels.cpu.decode_op`) or None for the torch path, chosen once here."""

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.device, self.dtype = torch.device(device), dtype
        self.decode_kernel = cpu.decode_op(self.device, dtype)
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` backed by buffer ``name`` (contents undefined)."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), device=self.device, dtype=self.dtype)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


@dataclass
class AttentionMetadata:
    """One step's index tensors on the model's device: single-token rows first (in buckets, and
    as ``decode_tables [S, W]`` / ``decode_lens [S]`` for the kernels), then multi-token chunks;
    ``last_row[c]``: the row of chunk ``c``'s last token. Plans are filled on first use."""

    input_ids: torch.Tensor      # [N] long
    positions: torch.Tensor      # [N] long
    slot_mapping: torch.Tensor   # [N] long, flat slot each new K/V is written to
    num_single: int
    buckets: list[DecodeBucket]
    prefills: list[PrefillChunk]
    last_row: list[int]
    block_size: int
    workspace: Workspace | None = None
    max_position: int = 0        # the largest entry of ``positions``
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefill_plan: tuple[list[PrefillGroup], list[PrefillChunk]] | None = None
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


def build_metadata(chunks: Sequence[ChunkSpec], block_size: int,
                   device: torch.device | str = "cpu", workspace: Workspace | None = None,
                   single_tables: Callable[[list[int], int], torch.Tensor] | None = None
                   ) -> AttentionMetadata:
    """Lay out ``chunks`` as one flat batch (single-token chunks first) and index it; ValueError
    when a chunk is empty or its table does not cover it. ``single_tables(indices, width)``:
    the single-token chunks' padded tables from a caller that keeps them as a tensor."""
    if not chunks:
        raise ValueError("build_metadata: no chunks to run")
    for i, c in enumerate(chunks):
        if len(c.token_ids) == 0:
            raise ValueError(f"build_metadata: chunk {i} has no tokens")
        end = c.start_pos + len(c.token_ids)
        kept = single_tables is not None and len(c.token_ids) == 1
        if c.start_pos < 0 or (not kept and len(c.block_table) * block_size < end):
            raise ValueError(
                f"build_metadata: chunk {i} block table ({len(c.block_table)} blocks of "
                f"{block_size}) does not cover positions {c.start_pos}..{end - 1}")
    singles = sorted((i for i, c in enumerate(chunks) if len(c.token_ids) == 1),
                     key=lambda i: chunks[i].start_pos)
    multis = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
    ids = [chunks[i].token_ids[0] for i in singles]
    last_row = [0] * len(chunks)
    for row, i in enumerate(singles):
        last_row[i] = row
    pos = torch.tensor([chunks[i].start_pos for i in singles], dtype=torch.long)
    pos_parts, slot_parts = [pos], [torch.zeros(0, dtype=torch.long)]
    buckets: list[DecodeBucket] = []
    decode_tables = decode_lens = None
    if singles:
        width = int(pos[-1]) // block_size + 1
        tables = single_tables(singles, width) if single_tables is not None else torch.tensor(
            [list(chunks[i].block_table[:width])
             + [0] * (width - min(width, len(chunks[i].block_table))) for i in singles],
            dtype=torch.long)
        need = (pos // block_size + 1).tolist()
        slot_parts = [tables.gather(1, (pos // block_size)[:, None])[:, 0] * block_size
                      + pos % block_size]
        # one additive mask for all rows (key position > query position -> -inf), sliced per
        # bucket: rows lo..hi-1 and their first need[hi-1] blocks
        span = torch.arange(width * block_size)
        dtype = workspace.dtype if workspace is not None else torch.float32
        mask = torch.zeros(len(singles), span.numel(), dtype=dtype).masked_fill_(
            span[None, :] > pos[:, None], float("-inf")).to(device)
        buckets = [DecodeBucket(lo, hi - lo, need[hi - 1],
                                tables[lo:hi, :need[hi - 1]].reshape(-1).to(device),
                                mask[lo:hi, None, :need[hi - 1] * block_size])
                   for lo, hi in split_buckets(need)]
        decode_tables, decode_lens = tables.to(device), (pos + 1).to(device)
    prefills: list[PrefillChunk] = []
    offset = len(singles)
    for i in multis:
        c = chunks[i]
        q = len(c.token_ids)
        ids.extend(c.token_ids)
        table = torch.tensor(c.block_table[:-(-(c.start_pos + q) // block_size)],
                             dtype=torch.long)
        all_slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[
            :c.start_pos + q]      # the slot of every position 0 .. end-1 (spec rule 2)
        pos_parts.append(torch.arange(c.start_pos, c.start_pos + q))
        slot_parts.append(all_slots[c.start_pos:])
        prefills.append(PrefillChunk(offset, q, c.start_pos, all_slots.to(device)))
        last_row[i] = offset + q - 1
        offset += q
    return AttentionMetadata(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.cat(pos_parts).to(device), slot_mapping=torch.cat(slot_parts).to(device),
        num_single=len(singles), buckets=buckets, prefills=prefills, last_row=last_row,
        block_size=block_size, workspace=workspace,
        max_position=max(c.start_pos + len(c.token_ids) for c in chunks) - 1,
        decode_tables=decode_tables, decode_lens=decode_lens)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new ``k, v: [N, kv_heads, D]`` at flat slots ``slot_mapping: [N]`` (in place)."""
    if k_cache.is_cuda and triton.available():
        triton.store_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    kv_heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    batch_prefills: bool | None = None, cpu_kernel: bool = True) -> torch.Tensor:
    """Attention of the flat batch; ``q: [N, H, D]``, new ``k, v: [N, KV, D]`` -> ``[N, H, D]``.
    :func:`write_kv` must have run first (decodes and chunks behind a prefix read the cache).
    The compiled kernel takes single-token rows and short chunks behind a prefix
    (``cpu_kernel=False``: the torch path); on CUDA, Triton takes the decode buckets."""
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    gqa = heads != kv_heads
    out = torch.empty_like(q)
    ws = meta.workspace or Workspace(q.device, q.dtype)
    kernel = ws.decode_kernel if cpu_kernel else None
    assert kernel is None or q.dtype == k_cache.dtype == v_cache.dtype, "one dtype"
    fused = q.is_cuda and triton.available()
    if kernel is not None and meta.decode_tables is not None:  # every single-token row at once
        rows = slice(0, meta.num_single)
        kernel(out[rows], q[rows].contiguous(), k_cache, v_cache, meta.decode_tables,
               meta.decode_lens, float(scale))
    for b in [] if kernel is not None else meta.buckets:
        rows = slice(b.row0, b.row0 + b.size)
        if fused:
            triton.decode_attention(
                q[rows], k_cache, v_cache, b.block_index.view(b.size, b.max_blocks),
                meta.positions[rows], scale, out=out[rows])
        else:
            out[rows] = attend_bucket(q[rows], k_cache, v_cache, b, scale, ws)
    flat_k = k_cache.view(-1, kv_heads, dim)
    flat_v = v_cache.view(-1, kv_heads, dim)
    prefills = meta.prefills
    behind = any(c.start_pos > 0 for c in prefills)   # chunks that read a cached prefix
    if kernel is not None and behind:  # short chunks behind a prefix: a kernel row per token
        from .prefill_groups import kernel_rows

        plan = kernel_rows(meta)
        if plan.rows.numel():
            qr = q.index_select(0, plan.rows)
            o = torch.empty_like(qr)
            kernel(o, qr, k_cache, v_cache, plan.tables, plan.lens, float(scale))
            out.index_copy_(0, plan.rows, o)
        prefills = plan.rest
    alone = prefills
    if behind and prefills and (BATCH_PREFILLS if batch_prefills is None else batch_prefills):
        from .prefill_groups import attend_groups, group_prefills

        groups, alone = group_prefills(meta, split_buckets, chunks=prefills)
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
