"""Triton kernels vs the torch path on random paged caches (used by tests and gpu_check).

:func:`compare` builds a paged cache with shuffled block tables and ragged context lengths,
stores K/V with both :func:`~kvlab.kernels.triton.store_kv` and the torch
``index_copy_`` path, and attends the decode rows with both
:func:`~kvlab.kernels.triton.decode_attention` and the torch decode path, on the metadata
of :func:`~kvlab.engine.attention_metadata.build_metadata`. Run ``python -m
kvlab.labs.parity.triton``
(with ``TRITON_INTERPRET=1`` on a CPU) to print the cases as JSON.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import torch

from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.attention_torch import attend_rows
from kvlab.kernels import triton as triton_kernels

__all__ = ["CASES", "Case", "compare", "scattered_tables"]


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    lengths: tuple[int, ...]
    dtype: str = "float32"
    splits: int | None = None   # the decode kernel's context splits (None: its own choice)


CASES: dict[str, Case] = {
    "mha_bs16": Case(4, 4, 32, 16, (1, 16, 17, 40)),
    "gqa_bs16": Case(8, 2, 32, 16, (3, 33, 1, 70, 16)),
    "gqa_odd_group_bs4": Case(6, 2, 16, 4, (1, 2, 5, 9, 13)),      # group 3 (padded to 4)
    "mqa_bs1": Case(4, 1, 16, 1, (1, 4, 7)),                         # one token per block
    "gqa_bs8_dim24": Case(4, 2, 24, 8, (8, 9, 23)),                  # head_dim not a power of 2
    "gqa_bs16_bf16": Case(8, 2, 32, 16, (5, 31, 48), "bfloat16"),
    "mha_bs32_bf16": Case(2, 2, 64, 32, (1, 64, 65), "bfloat16"),
    "gqa_bs16_one_split": Case(8, 2, 32, 16, (3, 33, 70), splits=1),   # writes out directly
    "gqa_bs4_5_splits": Case(4, 2, 32, 4, (1, 2, 9, 61, 200), splits=5),  # some splits empty
    "gqa_bs16_32_splits_bf16": Case(14, 2, 64, 16, (1, 300, 520), "bfloat16", splits=32),
}


def scattered_tables(lengths: list[int] | tuple[int, ...], block_size: int, spare: int,
                     generator: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables covering ``lengths`` tokens each, cut in order from one shuffle of
    ``sum(blocks needed) + spare`` block ids (so tables are scattered, never shared); returns
    the tables and that number of blocks."""
    need = [-(-t // block_size) for t in lengths]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    return tables, num_blocks


def compare(case: Case, device: str | torch.device = "cpu", seed: int = 0) -> dict:
    """Max abs differences Triton vs torch for one case (``store_exact`` must be True)."""
    if not triton_kernels.available():
        raise RuntimeError("triton is not installed")
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(seed)
    bs, kvh, dim = case.block_size, case.kv_heads, case.head_dim
    tables, num_blocks = scattered_tables(case.lengths, bs, 5, gen)
    shape = (num_blocks, bs, kvh, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    # decode step: every sequence's last token; its new K/V are stored by both kernels
    chunks = [ChunkSpec([0], t - 1, table) for t, table in zip(case.lengths, tables, strict=True)]
    meta = build_metadata(chunks, bs, device)
    n = len(chunks)
    k_new = torch.randn(n, kvh, dim, generator=gen).to(dtype).to(device)
    v_new = torch.randn(n, kvh, dim, generator=gen).to(dtype).to(device)
    kc_t, vc_t = k_cache.clone(), v_cache.clone()
    triton_kernels.store_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    kc_t.view(-1, kvh, dim).index_copy_(0, meta.slot_mapping, k_new)
    vc_t.view(-1, kvh, dim).index_copy_(0, meta.slot_mapping, v_new)
    store_exact = bool(torch.equal(k_cache, kc_t) and torch.equal(v_cache, vc_t))
    q = torch.randn(n, case.heads, dim, generator=gen).to(dtype).to(device)
    scale = dim ** -0.5
    tables_t, lens = meta.paged_tables, meta.paged_lens
    got = q.new_empty(q.shape)
    triton_kernels.decode_attention(q, k_cache, v_cache, tables_t, lens - 1, scale, out=got,
                                    splits=case.splits)
    want = attend_rows(q, kc_t, vc_t, tables_t, lens, scale).float()
    # float32 reference on the same (rounded) inputs: the kernel accumulates in float32
    ref = attend_rows(q.float(), kc_t.float(), vc_t.float(), tables_t, lens, scale)
    worst_torch = float((got.float() - want).abs().max())
    worst_ref = float((got.float() - ref).abs().max())
    return {"case": asdict(case), "store_exact": store_exact,
            "max_abs_diff_vs_torch_path": worst_torch,
            "max_abs_diff_vs_float32_reference": worst_ref, "rows": n}


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(json.dumps({name: compare(c, device) for name, c in CASES.items()}))


if __name__ == "__main__":
    main()
