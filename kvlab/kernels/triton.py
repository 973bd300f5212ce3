"""Triton kernels for the CUDA path: paged decode attention and the KV store.

Both read the metadata :func:`kvlab.engine.attention_metadata.flat_metadata` builds, unchanged:

- :func:`store_kv` writes ``k, v: [N, KV, D]`` at flat slots ``slot_mapping: [N]`` (what
  :func:`~kvlab.engine.kv_cache.write_kv` does with ``index_copy_``): one program per token.
- :func:`decode_attention` attends rows of one query token each through their block tables
  (``meta.paged_tables``); each row's context length is its position + 1. One program per
  (row, KV head, split) walks its share of the row's blocks straight from the cache (no
  gather), a few blocks per iteration, scores the ``G = H // KV`` query heads of that KV head
  against them as one matrix product (padded to 16 rows for the tensor cores) and keeps an
  online softmax (running max, running sum, rescaled accumulator) in float32. With one split
  it writes the output; with more (a batch too small to fill the GPU splits each context) a
  second kernel merges the splits' partial results by log-sum-exp. The output is in the
  query dtype.

:func:`available` says whether Triton can run here; the engine selects these kernels for CUDA
(:class:`kvlab.engine.attention_triton.TritonAttention`) and keeps its torch code elsewhere. The
kernels also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported), which is how the tests check them against the torch path.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["available", "decode_attention", "row_attention", "store_kv"]


@functools.cache
def available() -> bool:
    """True when Triton is importable (kernels need CUDA, or ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v,
                         ROW: tl.constexpr, ROW_P2: tl.constexpr):
        n = tl.program_id(0)
        slot = tl.load(slot_ptr + n).to(tl.int64)
        offs = tl.arange(0, ROW_P2)
        m = offs < ROW
        tl.store(kc_ptr + slot * ROW + offs, tl.load(k_ptr + n * stride_k + offs, mask=m),
                 mask=m)
        tl.store(vc_ptr + slot * ROW + offs, tl.load(v_ptr + n * stride_v + offs, mask=m),
                 mask=m)

    @triton.jit
    def _decode_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, table_ptr,
                       pos_ptr, scale, stride_qn, stride_qh, stride_on, stride_oh, max_blocks,
                       KV: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                       D: tl.constexpr, D_P2: tl.constexpr, BS: tl.constexpr,
                       BS_P2: tl.constexpr, PAGES: tl.constexpr, SPLITS: tl.constexpr,
                       F32: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, G_P2)
        d = tl.arange(0, D_P2)
        t = tl.arange(0, PAGES * BS_P2)       # PAGES pages per iteration
        page, off = t // BS_P2, t % BS_P2
        gm = g < G
        dm = d < D
        heads = kvh * G + g
        q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0)
        if F32:
            q = q.to(tl.float32)
        ctx = tl.load(pos_ptr + row).to(tl.int32) + 1
        num_blocks = (ctx + BS - 1) // BS
        per_split = (num_blocks + SPLITS - 1) // SPLITS
        lo = split * per_split
        hi = tl.minimum(lo + per_split, num_blocks)
        m_i = tl.full([G_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([G_P2], tl.float32)
        acc = tl.zeros([G_P2, D_P2], tl.float32)
        for j in range(lo, hi, PAGES):
            pj = j + page
            blk = tl.load(table_ptr + row * max_blocks + pj, mask=pj < hi, other=0).to(tl.int64)
            valid = (pj < hi) & (off < BS) & (pj * BS + off < ctx)
            base = ((blk * BS + off) * KV + kvh) * D
            kvm = valid[:, None] & dm[None, :]
            k = tl.load(kc_ptr + base[:, None] + d[None, :], mask=kvm, other=0.0)
            v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=kvm, other=0.0)
            # the group's query heads against the tile's keys as one matrix product; in
            # float32 at full precision (not TF32) where F32 (float32 data; the interpreter,
            # whose bfloat16 products are wrong), else on the tensor cores in the data's dtype
            if F32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee" if F32 else None)
            s = tl.where(valid[None, :], s * scale, float("-inf"))   # [G_P2, tokens]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee" if F32 else None)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        hm = gm[:, None] & dm[None, :]
        if SPLITS == 1:
            tl.store(out_ptr + row * stride_on + heads[:, None] * stride_oh + d[None, :],
                     (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hm)
        else:   # this split's unnormalised partial, its max and sum: [rows, H, SPLITS, ...]
            at = (row * KV * G + heads) * SPLITS + split
            tl.store(po_ptr + at[:, None] * D + d[None, :], acc, mask=hm)
            tl.store(pm_ptr + at, m_i, mask=gm)
            tl.store(pl_ptr + at, l_i, mask=gm)

    @triton.jit
    def _merge_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, stride_on, stride_oh,
                      H: tl.constexpr, SPLITS: tl.constexpr, S_P2: tl.constexpr,
                      D: tl.constexpr, D_P2: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, S_P2)
        d = tl.arange(0, D_P2)
        sm = s < SPLITS
        dm = d < D
        at = (row * H + h) * SPLITS + s
        m = tl.load(pm_ptr + at, mask=sm, other=float("-inf"))
        w = tl.exp(m - tl.max(m, axis=0))     # an empty split (max -inf) weighs 0
        l_sum = tl.sum(w * tl.load(pl_ptr + at, mask=sm, other=0.0), axis=0)
        o = tl.load(po_ptr + at[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :],
                    other=0.0)
        o = tl.sum(w[:, None] * o, axis=0) / l_sum
        tl.store(out_ptr + row * stride_on + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
                 mask=dm)

    return triton, _store_kv_kernel, _decode_kernel, _merge_kernel


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Triton version of :func:`kvlab.engine.kv_cache.write_kv` (same arguments, in place)."""
    _, store, _, _ = _kernels()
    n = k.shape[0]
    if n == 0:
        return
    kv_heads, dim = k_cache.shape[-2:]
    if k.stride(-1) != 1 or k.stride(-2) != dim or v.stride(-1) != 1 or v.stride(-2) != dim:
        k, v = k.contiguous(), v.contiguous()
    row = kv_heads * dim
    store[(n,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                ROW=row, ROW_P2=_p2(row))


#: split a row's context over at most this many programs
MAX_SPLITS = 32


@functools.cache
def _processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (16 stands in under the interpreter)."""
    if device.type != "cuda":
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(rows: int, kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """How many programs share one (row, KV head)'s context: about enough to give every
    multiprocessor two programs, at most :data:`MAX_SPLITS` and one per block, rounded down
    to a power of two (each count is a compiled variant of the kernel)."""
    want = min(-(-2 * _processors(device) // (rows * kv_heads)), MAX_SPLITS, max_blocks)
    return 1 << (max(want, 1).bit_length() - 1)   # a power of two: few kernel variants


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, positions: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, splits: int | None = None
                     ) -> torch.Tensor:
    """Attention of ``q: [B, H, D]`` (one token per row, at ``positions[i]``) over the paged
    cache through ``block_table: [B, max_blocks]``; returns ``[B, H, D]`` (``out`` if given).
    Each row's context is cut into ``splits`` parts (default :func:`num_splits`, fixed by the
    shapes, so a captured graph replays it), attended in parallel and merged by log-sum-exp."""
    _, _, decode, merge = _kernels()
    b, heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(b, heads, dim, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    table = block_table.contiguous()
    if splits is None:
        splits = num_splits(b, kv_heads, table.shape[1], q.device)
    po = pm = pl = out   # one split: the kernel writes ``out`` and no partials
    if splits > 1:
        po = torch.empty(b, heads, splits, dim, dtype=torch.float32, device=q.device)
        pm, pl = torch.empty(2, b, heads, splits, dtype=torch.float32, device=q.device)
    decode[(b, kv_heads, splits)](
        q, k_cache, v_cache, out, po, pm, pl, table, positions.contiguous(), scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.shape[1],
        KV=kv_heads, G=group, G_P2=max(16, _p2(group)), D=dim, D_P2=max(16, _p2(dim)), BS=bs,
        BS_P2=_p2(bs), PAGES=max(1, 32 // _p2(bs)), SPLITS=splits,
        F32=q.dtype == torch.float32 or interpreting())
    if splits > 1:
        merge[(b, heads)](po, pm, pl, out, out.stride(0), out.stride(1), H=heads,
                          SPLITS=splits, S_P2=_p2(splits), D=dim, D_P2=_p2(dim))
    return out


def row_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                  scale: float) -> None:
    """:func:`decode_attention` in the form of the engine's backends
    (``AttentionBackend.attend_rows``): row ``r`` attends ``lens[r]`` positions, into ``out``."""
    decode_attention(q, k_cache, v_cache, tables, lens - 1, scale, out=out)
