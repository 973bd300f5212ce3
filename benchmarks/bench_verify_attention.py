"""Attention of speculative-verification chunks: paged rows vs one SDPA call per request.

A verification step feeds each of ``--requests`` running requests a chunk of ``k + 1`` tokens
behind its cached context (the drafts plus the last sampled token). The engine's flat metadata
(:func:`kvlab.engine.attention_metadata.build_metadata`) of a runner with a row op makes every such
token a *paged row* (a chunk of at most ``PAGED_MAX_TOKENS`` behind a prefix): query token ``i``
of a chunk at ``start`` attends ``start + i + 1`` positions through the chunk's table, all rows
of the step in one call; without an op the engine keeps them as per-request SDPA calls. Per
layer:

- **compiled**: the compiled CPU backend (:class:`~kvlab.engine.attention_cpu.CpuAttention`),
  whose row op walks each row's table through the cache;
- **torch**: the same rows through the torch path :func:`~kvlab.engine.attention.attend_rows`
  (every row's blocks gathered into one padded batch, one masked SDPA), which is why the engine
  does not make them rows without an op;
- **per request**: what the engine runs without an op, written here: for each request gather
  its context and run one causal SDPA of its ``k + 1`` queries.

Outputs are checked against a float64 run of the per-request path (AssertionError past
``TOLERANCE``); interleaved rounds, each the best of a few calls, one torch thread; medians with
the spread of the ratios, in process CPU time (other processes on a shared machine stretch wall
time, which is kept beside it). Then the engine end to end with the shipped draft model (greedy):
``KVLAB_CPU_ATTENTION=1`` vs ``0`` (the op or the torch path, for target and draft), identical
tokens asserted. Timings are never asserted. Writes ``benchmarks/results/verify_attention.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.engine.attention_cpu import CpuAttention  # noqa: E402
from kvlab.engine.attention_metadata import (  # noqa: E402
    AttentionMetadata,
    ChunkSpec,
    build_metadata,
)
from kvlab.engine.attention_torch import TorchAttention  # noqa: E402

#: (query heads, KV heads, head dim) of kvlab-tiny and of the ~25M random Llama
SHAPES = {"kvlab-tiny": (6, 2, 32), "25M": (8, 2, 64)}

#: float32 outputs must lie this close to the float64 reference
TOLERANCE = 1e-4


def per_request(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One causal SDPA per chunk over its context gathered through its table: query ``i`` of a
    chunk at ``start`` sees positions ``0 .. start + i``."""
    heads, dim = q.shape[1:]
    _, bs, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    for s, start in enumerate(meta.start_pos):
        lo, hi = meta.query_start[s], meta.query_start[s + 1]
        end = start + hi - lo
        blocks = meta.block_tables[s, :-(-end // bs)]
        kc = k_cache.index_select(0, blocks).view(-1, kv_heads, dim)[:end]
        vc = v_cache.index_select(0, blocks).view(-1, kv_heads, dim)[:end]
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def _best(f: Callable[[], object], n: int) -> tuple[float, float]:
    """The least wall time and the least process CPU time of ``n`` calls of ``f``."""
    wall = cpu = float("inf")
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        f()
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    return wall, cpu


def bench(shape: str, k: int, requests: int, rounds: int, seed: int = 0) -> dict:
    """One layer's attention of a verification step on ``shape``; AssertionError when an
    output is off the float64 reference."""
    heads, kv_heads, dim = SHAPES[shape]
    bs = 16
    rng = random.Random(seed)
    starts = [rng.randint(100, 300) for _ in range(requests)]
    need = [-(-(s + k + 1) // bs) for s in starts]
    perm = list(range(sum(need) + 1))
    rng.shuffle(perm)
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(len(perm), bs, kv_heads, dim, generator=gen)
    vc = torch.randn(len(perm), bs, kv_heads, dim, generator=gen)
    op = CpuAttention.create(torch.float32)
    # the layout the compiled backend gets: every verified token a paged row (the torch
    # backend keeps these chunks as SDPA calls, what ``per_request`` times)
    meta = build_metadata([ChunkSpec([0] * (k + 1), s, t)
                           for s, t in zip(starts, tables, strict=True)], bs,
                          paged_max_tokens=CpuAttention.paged_max_tokens)
    n = meta.num_tokens
    assert meta.paged_rows.numel() == n and not meta.dense, "verification rows are paged"
    q = torch.randn(n, heads, dim, generator=gen)
    # the new K/V were written to the cache before attention (write_kv); the paged rows read
    # them from there, so these are only the call's arguments
    kn = torch.randn(n, kv_heads, dim, generator=gen)
    vn = torch.randn(n, kv_heads, dim, generator=gen)
    scale = dim ** -0.5
    fns: dict[str, Callable[[], torch.Tensor]] = {   # "torch": the same rows, gathered
        "per_request": lambda: per_request(q, kc, vc, meta, scale),
        "torch": lambda: TorchAttention().attend(q, kn, vn, kc, vc, meta, scale)}
    if op is not None:
        fns["compiled"] = lambda: op.attend(q, kn, vn, kc, vc, meta, scale)
    ref = per_request(q.double(), kc.double(), vc.double(), meta, scale)
    diff = {name: float((f().double() - ref).abs().max()) for name, f in fns.items()}
    bad = {name: d for name, d in diff.items() if not d <= TOLERANCE}
    assert not bad, f"{shape} k={k}: outputs differ from the float64 reference by {bad}"
    times: dict[str, list[float]] = {name: [] for name in fns}   # CPU time
    walls: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):   # interleaved rounds, each the best of a few calls
        for name, f in fns.items():
            w, c = _best(f, 5)
            walls[name].append(w)
            times[name].append(c)

    def ratio(slow: str, fast: str) -> dict[str, float] | None:
        if fast not in times:
            return None
        r = [a / b for a, b in zip(times[slow], times[fast], strict=True)]
        return {"median": statistics.median(r), "min": min(r), "max": max(r)}

    return {"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "k": k,
            "requests": requests, "rows": n,
            "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
            "wall_ms": {name: 1e3 * statistics.median(t) for name, t in walls.items()},
            "max_abs_diff_vs_float64": diff,
            "compiled_vs_per_request": ratio("per_request", "compiled"),
            "torch_vs_per_request": ratio("per_request", "torch"),
            "compiled_vs_torch": ratio("torch", "compiled")}


def engine_ab(k: int, requests: int, rounds: int, max_tokens: int = 48) -> dict:
    """The engine with speculative decoding (shipped draft model, ``k`` drafts, greedy):
    target-model wall time per step, tokens/s and tokens per CPU-second of the process with
    ``KVLAB_CPU_ATTENTION=1`` (the op) vs ``0``
    (the torch path), interleaved rounds with a fresh engine each; AssertionError unless both
    generate the same tokens."""
    from bench_speculative import PROMPTS

    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(requests)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    cfg = {"method": "draft_model", "model": "kvlab-tiny-draft", "num_speculative_tokens": k}
    res: dict[str, list[tuple[float, float, float]]] = {"0": [], "1": []}
    outs: dict[str, list] = {}
    saved = os.environ.get("KVLAB_CPU_ATTENTION")
    for _ in range(rounds):
        for flag in ("0", "1"):
            os.environ["KVLAB_CPU_ATTENTION"] = flag   # read when the runners are built
            try:
                llm = LLM("kvlab-tiny", num_blocks=2048, max_num_seqs=requests,
                          speculative_config=cfg, seed=0)
            finally:
                if saved is None:
                    os.environ.pop("KVLAB_CPU_ATTENTION", None)
                else:
                    os.environ["KVLAB_CPU_ATTENTION"] = saved
            compiled = isinstance(llm.engine.executor.kernels.attention, CpuAttention)
            assert compiled == (flag == "1" and CpuAttention.create(torch.float32) is not None), \
                f"KVLAB_CPU_ATTENTION={flag} not honoured"
            llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
            m = llm.engine.speculator.metrics
            m.reset()
            steps0 = llm.engine.stats.steps
            t0, c0 = time.perf_counter(), time.process_time()
            got = llm.generate(prompts, sp, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(len(o.outputs[0].token_ids) for o in got)
            res[flag].append((m.target_time_s / (llm.engine.stats.steps - steps0), tokens / wall,
                              tokens / cpu))
            outs[flag] = [o.outputs[0].token_ids for o in got]
    assert outs["0"] == outs["1"], f"k={k}: the op and the torch path generated different tokens"
    target = {f: [a for a, _, _ in r] for f, r in res.items()}
    tps = {f: [b for _, b, _ in r] for f, r in res.items()}
    tpc = {f: [c for _, _, c in r] for f, r in res.items()}
    ratio = [a / b for a, b in zip(target["0"], target["1"], strict=True)]
    cpu_ratio = [b / a for a, b in zip(tpc["0"], tpc["1"], strict=True)]
    return {"k": k, "requests": requests, "rounds": rounds, "max_tokens": max_tokens,
            "target_ms_per_step_torch": 1e3 * statistics.median(target["0"]),
            "target_ms_per_step_compiled": 1e3 * statistics.median(target["1"]),
            "target_speedup_median": statistics.median(ratio),
            "target_speedup_min": min(ratio), "target_speedup_max": max(ratio),
            "tokens_per_s_torch": statistics.median(tps["0"]),
            "tokens_per_s_compiled": statistics.median(tps["1"]),
            "tokens_per_cpu_s_torch": statistics.median(tpc["0"]),
            "tokens_per_cpu_s_compiled": statistics.median(tpc["1"]),
            "tokens_per_cpu_s_speedup_median": statistics.median(cpu_ratio),
            "tokens_per_cpu_s_speedup_min": min(cpu_ratio),
            "tokens_per_cpu_s_speedup_max": max(cpu_ratio),
            "identical_outputs": True}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine-rounds", type=int, default=3,
                    help="interleaved engine A/B rounds with speculative decoding (0: skip)")
    ap.add_argument("--engine-requests", type=int, default=16)
    args = ap.parse_args(argv)
    if min(args.requests, args.rounds, args.threads, args.engine_requests) < 1 \
            or args.engine_rounds < 0:
        ap.error("--requests, --rounds, --threads, --engine-requests must be at least 1 and "
                 "--engine-rounds at least 0")
    torch.set_num_threads(args.threads)
    compiled_ok = CpuAttention.create(torch.float32) is not None
    rows = []
    print(f"torch threads {args.threads} | {args.requests} requests x (k+1) tokens, one layer, "
          f"CPU ms (median of {args.rounds} rounds) | x: per-request time over each (min-max)")
    print(f"{'shape':11s} {'k':>2s} {'per req':>8s} {'torch':>7s} {'compiled':>8s} "
          f"{'torch x':>17s} {'compiled x':>17s} {'cmp/torch':>9s} {'max diff':>9s}")
    for shape in SHAPES:
        for k in (1, 4, 8):
            r = bench(shape, k, args.requests, args.rounds)
            rows.append(r)
            ms = r["ms"]

            def x(key: str, r: dict = r) -> str:
                v = r[key]
                return f"{v['median']:6.2f} ({v['min']:.2f}-{v['max']:.2f})" if v else "n/a"

            cmp = f"{ms['compiled']:8.2f}" if compiled_ok else f"{'n/a':>8s}"
            ct = r["compiled_vs_torch"]
            print(f"{shape:11s} {k:2d} {ms['per_request']:8.2f} {ms['torch']:7.2f} {cmp} "
                  f"{x('torch_vs_per_request'):>17s} {x('compiled_vs_per_request'):>17s} "
                  f"{ct['median'] if ct else float('nan'):9.2f} "
                  f"{max(r['max_abs_diff_vs_float64'].values()):9.1e}")
    engine = []
    if args.engine_rounds:
        sys.path.insert(0, str(REPO / "benchmarks"))
        print("\nengine, shipped draft model, greedy, "
              f"{args.engine_requests} requests: KVLAB_CPU_ATTENTION=0 -> 1 "
              "(target-model ms per step, tokens/s)")
        for k in (3,):
            e = engine_ab(k, args.engine_requests, args.engine_rounds)
            engine.append(e)
            print(f"k={k}: target {e['target_ms_per_step_torch']:.2f} -> "
                  f"{e['target_ms_per_step_compiled']:.2f} ms/step "
                  f"({e['target_speedup_median']:.2f}x, {e['target_speedup_min']:.2f}-"
                  f"{e['target_speedup_max']:.2f}); tokens/s {e['tokens_per_s_torch']:.0f} -> "
                  f"{e['tokens_per_s_compiled']:.0f}; tokens per CPU-s "
                  f"{e['tokens_per_cpu_s_torch']:.0f} -> {e['tokens_per_cpu_s_compiled']:.0f} "
                  f"({e['tokens_per_cpu_s_speedup_median']:.2f}x, "
                  f"{e['tokens_per_cpu_s_speedup_min']:.2f}-"
                  f"{e['tokens_per_cpu_s_speedup_max']:.2f}); identical outputs "
                  f"{e['identical_outputs']}")
    result = {"benchmark": "verify_attention", "torch_threads": args.threads,
              "torch": torch.__version__, "compiled_kernel": compiled_ok,
              "tolerance": TOLERANCE, "rows": rows, "engine": engine}
    write_results("verify_attention", result)
    return result


if __name__ == "__main__":
    main()
