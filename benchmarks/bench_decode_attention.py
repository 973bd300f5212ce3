"""Decode attention, one call: the compiled CPU op vs the torch path vs the old bucketed gather.

Every case is a batch of single-token rows (one decoding request each) with its context in a
paged cache ``[num_blocks, block_size, KV, D]`` under shuffled block tables, laid out by the
engine's own :func:`kvlab.engine.attention_metadata.build_metadata`. Three ways to attend it:

- **compiled**: ``CpuAttention.attend_rows`` (:mod:`kvlab.engine.attention_cpu`), the C++ op the
  engine runs on
  CPU; it walks each row's table through the cache, no gather.
- **torch** (:func:`kvlab.engine.attention.attend_rows`): the engine's torch path; it gathers
  every row's blocks into one padded ``[R, KV, W*bs, D]`` (``W``: the widest table of the step)
  and runs one masked SDPA.
- **buckets** (the torch path kvlab had before the flat metadata, re-implemented here as the
  comparison): rows sorted by context, cut into at most 6 contiguous buckets of at least 8 rows,
  each bucket gathered (into buffers reused across calls, as the old ``Workspace``) only as
  wide as its own longest row, then one pair of batched matmuls per KV head over its
  query-head group (``bmm`` on strided views, an additive length mask).
  ``buckets_fresh``: the same with fresh gather tensors every call, as ``attend_rows`` has,
  which separates the cost of allocating from that of the formulation.
  The old engine used a block-diagonal query for multi-head attention (group 1) instead; here
  the grouped form runs for every group, so the 8/8 case is that formulation's worst.

Ragged contexts are where buckets pay: the padded torch path scores ``W*bs`` positions for
every row, a bucket only its own span. Every output is compared with a float64 run of the torch
path (max abs difference printed; an AssertionError past ``TOLERANCE``). Timings are best-of-N
of interleaved calls on one torch thread, in CPU time of the process (``ms_per_call``, and the
ratios: other processes on a shared machine stretch wall time, not this) with wall time beside
it (``wall_ms_per_call``); never asserted. Writes ``benchmarks/results/decode_attention.json``.
On a shared machine run it twice.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

from kvlab.engine.attention import attend_rows  # noqa: E402
from kvlab.engine.attention_cpu import CpuAttention  # noqa: E402
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata  # noqa: E402

#: float32 outputs must lie this close to the float64 reference
TOLERANCE = 1e-4

#: (name, batch, heads, kv_heads, head_dim, contexts (lo, hi), block_size); lo == hi: uniform
CASES = [
    ("4/2 x32 (old 'kvlab-tiny' row)", 64, 4, 2, 32, (192, 192), 16),
    ("kvlab-tiny 6/2 x32", 64, 6, 2, 32, (192, 192), 16),
    ("25M 8/2 x64", 64, 8, 2, 64, (192, 192), 16),
    ("multi-head 8/8 x64", 64, 8, 8, 64, (192, 192), 16),
    ("Qwen2-0.5B-like 14/2 x64", 16, 14, 2, 64, (640, 640), 16),
    ("kvlab-tiny 6/2 x32, ragged", 64, 6, 2, 32, (16, 768), 16),
    ("25M 8/2 x64, ragged", 64, 8, 2, 64, (16, 768), 16),
]


def bucket_plan(lens: torch.Tensor, tables: torch.Tensor, block_size: int,
                min_size: int = 8, max_buckets: int = 6) -> list[tuple]:
    """The old decode buckets: rows sorted by context length, split into ``k`` contiguous
    groups of equal count (``k <= max_buckets``, each ``>= min_size`` rows; one group when all
    lengths are equal). Each entry: ``(rows, flat block ids, additive mask [b, 1, T])`` with
    ``T`` the bucket's longest context rounded up to whole blocks."""
    order = torch.argsort(lens, stable=True)
    n = order.numel()
    k = 1 if int(lens.min()) == int(lens.max()) else max(1, min(max_buckets, n // min_size))
    bounds = [round(i * n / k) for i in range(k + 1)]
    plan = []
    for lo, hi in itertools.pairwise(bounds):
        if hi == lo:
            continue
        rows = order[lo:hi]
        blocks = -(-int(lens[rows].max()) // block_size)
        span = torch.arange(blocks * block_size)
        mask = torch.zeros(hi - lo, 1, span.numel()).masked_fill_(
            span[None, None, :] >= lens[rows][:, None, None], float("-inf"))
        plan.append((rows, tables[rows, :blocks].reshape(-1).contiguous(), mask))
    return plan


def workspace(plan: list[tuple], k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two gather buffers for the largest bucket of ``plan``, allocated once and reused by
    every call, as the old engine's ``Workspace`` did (a fresh multi-megabyte tensor per call
    page-faults on every step)."""
    rows = max(blocks.numel() for _, blocks, _ in plan)
    row = k_cache[0].numel()
    return torch.empty(rows, row, dtype=k_cache.dtype), torch.empty(rows, row, dtype=k_cache.dtype)


def attend_buckets(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: list[tuple], scale: float,
                   ws: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Each bucket: gather its blocks into the workspace ``ws`` (None: fresh tensors) as
    ``[b, T, KV, D]`` (rows of ``block_size*KV*D``), then for KV head ``j`` score its
    ``G = H // KV`` query heads with one ``baddbmm`` against the strided view ``K[:, :, j]``
    and weight ``V[:, :, j]`` with one ``bmm``."""
    num_blocks, bs, kv_heads, dim = k_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads
    flat_k, flat_v = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
    out = torch.empty_like(q)
    for rows, blocks, mask in plan:
        b, n, t = rows.numel(), blocks.numel(), blocks.numel() // rows.numel() * bs
        if ws is None:
            gk, gv = flat_k.index_select(0, blocks), flat_v.index_select(0, blocks)
        else:
            gk = torch.index_select(flat_k, 0, blocks, out=ws[0][:n])
            gv = torch.index_select(flat_v, 0, blocks, out=ws[1][:n])
        k4, v4 = gk.view(b, t, kv_heads, dim), gv.view(b, t, kv_heads, dim)
        qg = q.index_select(0, rows).view(b, kv_heads, group, dim)
        m = mask.expand(b, group, t)
        outs = [torch.bmm(torch.baddbmm(m, qg[:, j], k4[:, :, j].transpose(1, 2),
                                        alpha=scale).softmax(-1), v4[:, :, j])
                for j in range(kv_heads)]
        out.index_copy_(0, rows, torch.stack(outs, 1).view(b, heads, dim))
    return out


def case(name: str, batch: int, heads: int, kv_heads: int, dim: int, contexts: tuple[int, int],
         block_size: int, repeats: int, seed: int = 0) -> dict:
    """Time the three paths on one shape; raise AssertionError when an output is off."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ctx = [rng.randint(*contexts) for _ in range(batch)]
    need = [-(-c // block_size) for c in ctx]
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    starts = [sum(need[:i]) for i in range(batch)]
    meta = build_metadata([ChunkSpec([0], c - 1, perm[s:s + n])
                           for c, s, n in zip(ctx, starts, need, strict=True)], block_size)
    assert meta.paged_rows.numel() == batch and not meta.dense, "every decode row is paged"
    tables, lens = meta.paged_tables, meta.paged_lens
    q = torch.randn(batch, heads, dim, generator=gen)
    scale = dim ** -0.5
    plan = bucket_plan(lens, tables, block_size)
    ws = workspace(plan, k_cache)
    op = CpuAttention.create(torch.float32)

    def compiled() -> torch.Tensor:
        out = torch.empty_like(q)
        op.attend_rows(out, q, k_cache, v_cache, tables, lens, scale)
        return out

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "torch": lambda: attend_rows(q, k_cache, v_cache, tables, lens, scale),
        "buckets": lambda: attend_buckets(q, k_cache, v_cache, plan, scale, ws),
        "buckets_fresh": lambda: attend_buckets(q, k_cache, v_cache, plan, scale, None)}
    if op is not None:
        fns["compiled"] = compiled
    ref = attend_rows(q.double(), k_cache.double(), v_cache.double(), tables, lens, scale)
    diff = {n: float((f().double() - ref).abs().max()) for n, f in fns.items()}
    bad = {n: d for n, d in diff.items() if not d <= TOLERANCE}
    assert not bad, f"{name}: outputs differ from the float64 reference by {bad}"
    wall = dict.fromkeys(fns, float("inf"))
    cpu = dict.fromkeys(fns, float("inf"))
    inner = 5
    for _ in range(repeats):  # interleaved, best of `repeats`, on both clocks
        for n, f in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                f()
            wall[n] = min(wall[n], (time.perf_counter() - t0) / inner)
            cpu[n] = min(cpu[n], (time.process_time() - c0) / inner)
    ms = {n: 1e3 * v for n, v in cpu.items()}
    width = tables.shape[1] * block_size
    return {"name": name, "batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
            "context_min": min(ctx), "context_max": max(ctx), "block_size": block_size,
            "buckets": len(plan),
            "padded_positions": {"torch": batch * width,
                                 "buckets": sum(m.shape[0] * m.shape[-1] for _, _, m in plan),
                                 "context": sum(ctx)},
            "ms_per_call": ms, "wall_ms_per_call": {n: 1e3 * v for n, v in wall.items()},
            "max_abs_diff_vs_float64": diff,
            "compiled_vs_torch": ms["torch"] / ms["compiled"] if op else None,
            "compiled_vs_buckets": ms["buckets"] / ms["compiled"] if op else None,
            "buckets_vs_torch": ms["torch"] / ms["buckets"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        ap.error("--threads and --repeats must be at least 1")
    torch.set_num_threads(args.threads)
    compiled_ok = CpuAttention.create(torch.float32) is not None
    cases = [case(*c, repeats=args.repeats) for c in CASES]
    print(f"torch threads {torch.get_num_threads()} | CPU ms per call (best of {args.repeats}) | "
          f"x: speedup of the first over the second | diff: max |out - float64|")
    print(f"{'case':31s} {'B':>3s} {'T':>8s} {'bkts':>4s} {'compiled':>8s} {'torch':>7s} "
          f"{'buckets':>7s} {'fresh':>7s} {'cmp/torch':>9s} {'cmp/bkts':>8s} {'bkts/torch':>10s} "
          f"{'diff':>8s}")
    for c in cases:
        m = c["ms_per_call"]
        t = (f"{c['context_min']}" if c["context_min"] == c["context_max"]
             else f"{c['context_min']}-{c['context_max']}")
        cmp = (f"{m['compiled']:8.3f}" if compiled_ok else f"{'n/a':>8s}")
        ratios = (f"{c['compiled_vs_torch']:9.2f} {c['compiled_vs_buckets']:8.2f}"
                  if compiled_ok else f"{'n/a':>9s} {'n/a':>8s}")
        print(f"{c['name']:31s} {c['batch']:3d} {t:>8s} {c['buckets']:4d} {cmp} "
              f"{m['torch']:7.3f} {m['buckets']:7.3f} {m['buckets_fresh']:7.3f} {ratios} "
              f"{c['buckets_vs_torch']:10.2f} "
              f"{max(c['max_abs_diff_vs_float64'].values()):8.1e}")
    result = {"benchmark": "decode_attention", "torch_threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "repeats": args.repeats, "tolerance": TOLERANCE, "compiled_kernel": compiled_ok,
              "cases": cases}
    write_results("decode_attention", result)
    return result


if __name__ == "__main__":
    main()
