"""Attention of speculative-verification chunks: one padded call per group vs one per chunk.

A verification step feeds each of ``--requests`` running requests a chunk of ``k + 1`` tokens
after a cached context (spec rule: the drafts plus the last sampled token). Until now every such
chunk was attended alone (a gather and an SDPA call per request and layer); grouped, chunks of
equal length run as one padded call per group (:func:`kvlab.engine.attention.group_prefills`).
Both paths run here on the same metadata, interleaved, one torch thread; medians of the rounds
with their spread, and the largest output difference. Writes
``benchmarks/results/verify_attention.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

import kvlab.engine.attention as attention  # noqa: E402
from kvlab.engine.attention import ChunkSpec, build_metadata, paged_attention  # noqa: E402
from kvlab.engine.llm import LLM  # noqa: E402
from kvlab.engine.sampler import SamplingParams  # noqa: E402

#: (query heads, KV heads, head dim) of kvlab-tiny and of the ~25M random Llama
SHAPES = {"kvlab-tiny": (6, 2, 32), "25M": (8, 2, 64)}


def _time(f, n: int) -> float:
    f()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def bench(shape: str, k: int, requests: int, rounds: int, seed: int = 0) -> dict:
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
    kc = torch.randn(len(perm), bs, kv_heads, dim)
    vc = torch.randn(len(perm), bs, kv_heads, dim)
    meta = build_metadata([ChunkSpec([0] * (k + 1), s, t)
                           for s, t in zip(starts, tables, strict=True)], bs)
    n = meta.num_tokens
    q = torch.randn(n, heads, dim)
    kn, vn = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    scale = dim ** -0.5

    def grouped():
        return paged_attention(q, kn, vn, kc, vc, meta, scale)

    def alone():
        return paged_attention(q, kn, vn, kc, vc, meta, scale, batch_prefills=False)

    diff = float((grouped() - alone()).abs().max())
    t_g, t_a = [], []
    for _ in range(rounds):   # interleaved A/B rounds, each the best of a few calls
        t_a.append(_time(alone, 5))
        t_g.append(_time(grouped, 5))
    ratios = [a / g for a, g in zip(t_a, t_g, strict=True)]
    return {"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "k": k,
            "requests": requests, "per_chunk_ms": 1e3 * statistics.median(t_a),
            "grouped_ms": 1e3 * statistics.median(t_g),
            "speedup_median": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios),
            "max_abs_diff": diff}


def engine_ab(k: int, requests: int, rounds: int, max_tokens: int = 48) -> dict:
    """The engine with speculative decoding (shipped draft model, ``k`` drafts, greedy):
    target-model time per verification step and tokens/s, grouping on vs off (interleaved
    rounds, fresh engine each), and whether the two generate the same tokens."""
    from bench_speculative import PROMPTS

    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(requests)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    cfg = {"method": "draft_model", "model": "kvlab-tiny-draft", "num_speculative_tokens": k}
    res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    outs: dict[bool, list] = {}
    for _ in range(rounds):
        for on in (False, True):
            attention.BATCH_PREFILLS = on
            try:
                llm = LLM("kvlab-tiny", num_blocks=2048, max_num_seqs=requests,
                          speculative_config=cfg, seed=0)
                llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
                m = llm.engine.speculator.metrics
                m.reset()
                steps0 = llm.engine.stats.steps
                t0 = time.perf_counter()
                got = llm.generate(prompts, sp, use_tqdm=False)
                wall = time.perf_counter() - t0
            finally:
                attention.BATCH_PREFILLS = True
            tokens = sum(len(o.outputs[0].token_ids) for o in got)
            steps = llm.engine.stats.steps - steps0
            res[on].append((m.target_time_s / steps, tokens / wall))
            outs[on] = [o.outputs[0].token_ids for o in got]
    target = {on: [a for a, _ in r] for on, r in res.items()}
    tps = {on: [b for _, b in r] for on, r in res.items()}
    ratio = [a / b for a, b in zip(target[False], target[True], strict=True)]
    return {"k": k, "requests": requests, "rounds": rounds,
            "target_ms_per_step_alone": 1e3 * statistics.median(target[False]),
            "target_ms_per_step_grouped": 1e3 * statistics.median(target[True]),
            "target_speedup_median": statistics.median(ratio),
            "target_speedup_min": min(ratio), "target_speedup_max": max(ratio),
            "tokens_per_s_alone": statistics.median(tps[False]),
            "tokens_per_s_grouped": statistics.median(tps[True]),
            "identical_outputs": outs[True] == outs[False]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine-rounds", type=int, default=3,
                    help="interleaved engine A/B rounds with speculative decoding (0: skip)")
    ap.add_argument("--engine-requests", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'shape':11s} {'k':>2s} {'per chunk ms':>12s} {'grouped ms':>10s} "
          f"{'speedup (min-max)':>20s} {'max diff':>9s}   torch threads {args.threads}")
    for shape in SHAPES:
        for k in (1, 4, 8):
            r = bench(shape, k, args.requests, args.rounds)
            rows.append(r)
            print(f"{shape:11s} {k:2d} {r['per_chunk_ms']:12.2f} {r['grouped_ms']:10.2f} "
                  f"{r['speedup_median']:8.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
                  f" {r['max_abs_diff']:9.1e}")
    engine = []
    if args.engine_rounds:
        sys.path.insert(0, str(REPO / "benchmarks"))
        print("\nengine, shipped draft model, greedy, "
              f"{args.engine_requests} requests (target-model ms per step, tokens/s)")
        for k in (2, 4):
            e = engine_ab(k, args.engine_requests, args.engine_rounds)
            engine.append(e)
            print(f"k={k}: target {e['target_ms_per_step_alone']:.2f} -> "
                  f"{e['target_ms_per_step_grouped']:.2f} ms/step "
                  f"({e['target_speedup_median']:.2f}x, {e['target_speedup_min']:.2f}-"
                  f"{e['target_speedup_max']:.2f}); tokens/s {e['tokens_per_s_alone']:.0f} -> "
                  f"{e['tokens_per_s_grouped']:.0f}; identical outputs "
                  f"{e['identical_outputs']}")
    result = {"benchmark": "verify_attention", "torch_threads": args.threads,
              "torch": torch.__version__, "rows": rows, "engine": engine}
    write_results("verify_attention", result)
    return result


if __name__ == "__main__":
    main()
