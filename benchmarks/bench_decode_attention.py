"""Decode attention over gathered paged K/V: the grouped formulation vs the block-diagonal one.

Both gather a bucket's K/V blocks into ``[B, T, KV, D]`` workspace buffers first (identical in
both; timed separately). Then:

- **block-diagonal** (kvlab before this change): every query head is placed in the columns of
  its KV head in a zero ``[B, H, KV * D]`` query, so one ``bmm`` against ``[B, KV * D, T]``
  scores all heads; ``KV`` times the QK^T and PV work that is needed.
- **grouped** (kvlab now for groups of 2+ query heads per KV head): heads grouped by KV head,
  one ``bmm`` pair per KV head on strided views of the gathered buffers (no copy). For
  multi-head attention (group 1) it degenerates into matrix-vector products and loses, so the
  engine keeps the block-diagonal form there (``engine`` column: what the engine runs).
- **grouped, permuted** (the earlier attempt): K/V transposed to ``[B, KV, T, D]`` (a copy)
  and one 4-d ``matmul`` over all heads.
- **compiled**: the C++ kernel of :mod:`kvlab.kernels.cpu`, which reads K/V straight from
  the paged cache with no gather (what the engine runs on CPU where it builds; ``compiled x`` is
  its speedup over the torch path, ``engine``).

Every formulation's output is compared with the block-diagonal one (max abs difference) and the
ratio printed. Writes ``benchmarks/results/decode_attention.json``. Timings are best-of-N on one
torch thread; on a shared machine run it twice.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

from kvlab.engine.attention import ChunkSpec, Workspace, build_metadata  # noqa: E402
from kvlab.engine.bucket_attention import attend_bucket as engine_path  # noqa: E402
from kvlab.engine.bucket_attention import (  # noqa: E402
    attend_bucket_block_diagonal as block_diagonal,
)
from kvlab.engine.bucket_attention import gather_bucket  # noqa: E402
from kvlab.kernels import cpu as cpu_kernels  # noqa: E402


def grouped(q, k_cache, v_cache, b, scale, ws):
    """The grouped formulation for every group size (the engine uses it for groups >= 2)."""
    _, bs, kv_heads, dim = k_cache.shape
    heads = q.shape[1]
    t = b.max_blocks * bs
    gk, gv = gather_bucket(k_cache, v_cache, b, ws)
    k4 = gk.view(b.size, t, kv_heads, dim)
    v4 = gv.view(b.size, t, kv_heads, dim)
    qg = q.view(b.size, kv_heads, heads // kv_heads, dim)
    mask = b.mask.to(q.dtype).expand(b.size, heads // kv_heads, t)
    outs = [torch.bmm(torch.baddbmm(mask, qg[:, j], k4[:, :, j].transpose(1, 2),
                                    alpha=scale).softmax(-1), v4[:, :, j])
            for j in range(kv_heads)]
    return torch.stack(outs, 1).view(b.size, heads, dim)


def grouped_permuted(q, k_cache, v_cache, b, scale, ws):
    """The earlier grouped attempt: transpose the gathered K/V (a copy), one 4-d matmul."""
    _, bs, kv_heads, dim = k_cache.shape
    heads = q.shape[1]
    t = b.max_blocks * bs
    gk, gv = gather_bucket(k_cache, v_cache, b, ws)
    k = gk.view(b.size, t, kv_heads, dim).transpose(1, 2)
    v = gv.view(b.size, t, kv_heads, dim).transpose(1, 2)
    qg = q.reshape(b.size, kv_heads, heads // kv_heads, dim)
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale + b.mask.to(q.dtype)[:, None]
    return torch.matmul(s.softmax(-1), v).reshape(b.size, heads, dim)


def gather_only(q, k_cache, v_cache, b, scale, ws):
    gather_bucket(k_cache, v_cache, b, ws)


def compiled(q, k_cache, v_cache, b, scale, ws):
    lens = (b.mask[:, 0] == 0).sum(-1)  # each row's context: the unmasked key positions
    return cpu_kernels.decode_attention(q, k_cache, v_cache, b.block_index.view(b.size, -1),
                                        lens, scale)


def case(batch: int, heads: int, kv_heads: int, dim: int, context: int, block_size: int,
         repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    nb = -(-context // block_size)
    num_blocks = batch * nb + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks = [ChunkSpec([0], context - 1, perm[i * nb:(i + 1) * nb]) for i in range(batch)]
    meta = build_metadata(chunks, block_size)
    (b,) = meta.buckets
    q = torch.randn(batch, heads, dim, generator=gen)
    ws = Workspace()
    scale = dim ** -0.5
    fns = {"block_diagonal": block_diagonal, "grouped": grouped, "engine": engine_path,
           "grouped_permuted": grouped_permuted, "gather_only": gather_only}
    if cpu_kernels.available():
        fns["compiled"] = compiled
    ref = block_diagonal(q, k_cache, v_cache, b, scale, ws).clone()
    diff = {n: float((f(q, k_cache, v_cache, b, scale, ws) - ref).abs().max())
            for n, f in fns.items() if n != "gather_only"}
    best = dict.fromkeys(fns, float("inf"))
    inner = 5
    for _ in range(repeats):  # interleaved, best of `repeats`
        for n, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f(q, k_cache, v_cache, b, scale, ws)
            best[n] = min(best[n], (time.perf_counter() - t0) / inner)
    ms = {n: 1e3 * v for n, v in best.items()}
    return {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
            "context": context, "block_size": block_size, "ms_per_call": ms,
            "max_abs_diff_vs_block_diagonal": diff,
            "grouped_speedup": ms["block_diagonal"] / ms["grouped"],
            "engine_speedup": ms["block_diagonal"] / ms["engine"],
            "compiled_speedup_vs_torch_path":
                ms["engine"] / ms["compiled"] if "compiled" in ms else None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [  # (batch, heads, kv_heads, head_dim, context, block_size)
        (64, 4, 2, 32, 192, 16),     # kvlab-tiny, 64 decoding
        (64, 8, 2, 64, 192, 16),     # the ~25M-parameter random Llama of bench_engine_vs_hf
        (64, 8, 8, 64, 192, 16),     # multi-head (group 1): block-diagonal does 8x the work
        (16, 14, 2, 64, 640, 16),    # Qwen2-0.5B-like heads, longer context
    ]
    cases = [case(*s, repeats=args.repeats) for s in shapes]
    print(f"torch threads {torch.get_num_threads()} | ms per call (best of {args.repeats})")
    print(f"{'B':>3s} {'H':>3s} {'KV':>3s} {'D':>3s} {'T':>4s} {'gather':>7s} {'blockdiag':>9s} "
          f"{'grouped':>8s} {'permuted':>8s} {'speedup':>7s} {'engine x':>8s} {'max|diff|':>9s} "
          f"{'compiled':>8s} {'compiled x':>10s} {'max|diff|':>9s}")
    for c in cases:
        m = c["ms_per_call"]
        print(f"{c['batch']:3d} {c['heads']:3d} {c['kv_heads']:3d} {c['head_dim']:3d} "
              f"{c['context']:4d} {m['gather_only']:7.3f} {m['block_diagonal']:9.3f} "
              f"{m['grouped']:8.3f} {m['grouped_permuted']:8.3f} {c['grouped_speedup']:7.2f} "
              f"{c['engine_speedup']:8.2f} "
              f"{c['max_abs_diff_vs_block_diagonal']['grouped']:9.1e} "
              + (f"{m['compiled']:8.3f} {c['compiled_speedup_vs_torch_path']:10.2f} "
                 f"{c['max_abs_diff_vs_block_diagonal']['compiled']:9.1e}"
                 if "compiled" in m else "unavailable"))
    result = {"benchmark": "decode_attention", "torch_threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "compiled_kernel": cpu_kernels.available(), "cases": cases}
    write_results("decode_attention", result)
    return result


if __name__ == "__main__":
    main()
