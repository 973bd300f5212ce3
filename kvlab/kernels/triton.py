"""Triton kernels for the CUDA path: paged decode attention and the KV store.

Both read the metadata :func:`kvlab.engine.attention.flat_metadata` builds, unchanged:

- :func:`store_kv` writes ``k, v: [N, KV, D]`` at flat slots ``slot_mapping: [N]`` (what
  :func:`~kvlab.engine.attention.write_kv` does with ``index_copy_``): one program per token.
- :func:`decode_attention` attends rows of one query token each through their block tables
  (``meta.paged_tables``); each row's context length is its position + 1. One program per
  (row, KV head) walks the row's blocks straight from the cache (no gather), scores the
  ``G = H // KV`` query heads of that KV head against each block and keeps an online softmax
  (running max, running sum, rescaled accumulator) in float32; the output is in the query
  dtype.

:func:`available` says whether Triton can run here; :mod:`kvlab.engine.attention` selects
these kernels automatically for CUDA tensors and keeps its torch code everywhere else. The
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
    def _decode_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, table_ptr, pos_ptr, scale,
                       stride_qn, stride_qh, stride_on, stride_oh, max_blocks,
                       KV: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                       D: tl.constexpr, D_P2: tl.constexpr,
                       BS: tl.constexpr, BS_P2: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        g = tl.arange(0, G_P2)
        d = tl.arange(0, D_P2)
        t = tl.arange(0, BS_P2)
        gm = g < G
        dm = d < D
        heads = kvh * G + g
        q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        ctx = tl.load(pos_ptr + row).to(tl.int32) + 1
        num_blocks = (ctx + BS - 1) // BS
        m_i = tl.full([G_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([G_P2], tl.float32)
        acc = tl.zeros([G_P2, D_P2], tl.float32)
        for j in range(0, num_blocks):
            blk = tl.load(table_ptr + row * max_blocks + j).to(tl.int64)
            valid = (t < BS) & (j * BS + t < ctx)
            base = ((blk * BS + t) * KV + kvh) * D
            kvm = valid[:, None] & dm[None, :]
            k = tl.load(kc_ptr + base[:, None] + d[None, :], mask=kvm, other=0.0).to(tl.float32)
            v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=kvm, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale   # [G_P2, BS_P2]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_on + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])

    return triton, _store_kv_kernel, _decode_kernel


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Triton version of :func:`kvlab.engine.attention.write_kv` (same arguments, in place)."""
    _, store, _ = _kernels()
    n = k.shape[0]
    if n == 0:
        return
    kv_heads, dim = k_cache.shape[-2:]
    if k.stride(-1) != 1 or k.stride(-2) != dim or v.stride(-1) != 1 or v.stride(-2) != dim:
        k, v = k.contiguous(), v.contiguous()
    row = kv_heads * dim
    store[(n,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                ROW=row, ROW_P2=_p2(row))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, positions: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q: [B, H, D]`` (one token per row, at ``positions[i]``) over the paged
    cache through ``block_table: [B, max_blocks]``; returns ``[B, H, D]`` (``out`` if given)."""
    _, _, decode = _kernels()
    b, heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(b, heads, dim, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    table = block_table.contiguous()
    decode[(b, kv_heads)](q, k_cache, v_cache, out, table, positions.contiguous(), scale,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                          table.shape[1], KV=kv_heads, G=group, G_P2=_p2(group),
                          D=dim, D_P2=_p2(dim), BS=bs, BS_P2=_p2(bs))
    return out


def row_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                  scale: float) -> None:
    """:func:`decode_attention` in the engine's row-kernel form
    (:data:`kvlab.engine.attention.RowKernel`): row ``r`` attends ``lens[r]`` positions."""
    decode_attention(q, k_cache, v_cache, tables, lens - 1, scale, out=out)
