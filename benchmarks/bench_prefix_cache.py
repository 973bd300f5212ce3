"""Prefix lookup: the reference linear scan vs the radix tree, at 1k, 10k and 100k cached prefixes.

Workload (chapter 4): every cached prefix is one of 8 "system prompts" (64-256 tokens) followed
by a unique user turn (16-96 tokens), in one of 4 scopes. Queries are a cached prefix plus a
fresh continuation (hits) or an uncached turn after a system prompt (misses, which still match
nothing stored). Both caches get the same ``put`` calls; a sample of queries is checked to give
identical answers. The reference scans every entry per lookup (O(entries x length)); the radix
tree walks only the matched path (O(length of the match)), so its cost stays flat as the cache
grows. The 100k linear scan is slow, so it times fewer lookups and reports cost per lookup.

The radix tree is :class:`~kvlab.labs.token_trie.TokenTrie`, the production twin of the reference.
Also timed: the engine's block tree (``RadixCache.match``, block size 16) on the same prefixes.

Run: ``python benchmarks/bench_prefix_cache.py``. Writes ``benchmarks/results/prefix_cache.json``.
"""

from __future__ import annotations

import platform
import random
import time

from _results import write_results

from kvlab.core.radix_cache import RadixCache
from kvlab.labs.token_trie import TokenTrie
from kvlab.reference import PrefixCache

SIZES = (1_000, 10_000, 100_000)
LINEAR_LOOKUPS = {1_000: 400, 10_000: 60, 100_000: 8}
RADIX_LOOKUPS = 4_000
BLOCK_SIZE = 16
VOCAB = 32_000


def make_workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(VOCAB) for _ in range(rng.randint(64, 256))) for _ in range(8)]
    scopes = [("llama-3-8b", "v1", f"tenant-{i}") for i in range(4)]
    entries = []
    for i in range(n):
        turn = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(16, 96)))
        entries.append((scopes[i % 4], systems[rng.randrange(8)] + turn, (i,)))
    queries = []
    for _ in range(RADIX_LOOKUPS):
        if rng.random() < 0.7:
            scope, tokens, _ = entries[rng.randrange(n)]
            queries.append((scope, tokens + tuple(rng.randrange(VOCAB) for _ in range(8))))
        else:
            turn = tuple(rng.randrange(VOCAB) for _ in range(32))
            queries.append((scopes[rng.randrange(4)], systems[rng.randrange(8)] + turn))
    return entries, queries


def per_lookup_us(fn, queries) -> float:
    start = time.perf_counter()
    for scope, tokens in queries:
        fn(scope, tokens)
    return (time.perf_counter() - start) / len(queries) * 1e6


def run_size(n: int) -> dict:
    entries, queries = make_workload(n)
    ref, radix = PrefixCache(), TokenTrie()
    t0 = time.perf_counter()
    for scope, tokens, table in entries:
        ref.put(scope, tokens, table)
    t_ref_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    for scope, tokens, table in entries:
        radix.put(scope, tokens, table)
    t_radix_put = time.perf_counter() - t0
    # the engine's block tree: index every entry's full blocks (first writer wins on shared
    # system prompts)
    engine = RadixCache(BLOCK_SIZE)
    next_block = 0
    for scope, tokens, _ in entries:
        nb = len(tokens) // BLOCK_SIZE
        engine.insert(scope, tokens, range(next_block, next_block + nb))
        next_block += nb

    lin_q = queries[:LINEAR_LOOKUPS[n]]
    for scope, tokens in lin_q:  # same answers on everything the linear scan is timed on
        assert ref.longest(scope, tokens) == radix.longest(scope, tokens)
    hits = sum(1 for s, t in queries if radix.longest(s, t)[0] > 0) / len(queries)
    lin_us = per_lookup_us(ref.longest, lin_q)
    rad_us = per_lookup_us(radix.longest, queries)
    eng_us = per_lookup_us(engine.match, queries)
    return {
        "cached_prefixes": n,
        "hit_fraction": round(hits, 3),
        "linear_lookups_timed": len(lin_q),
        "radix_lookups_timed": len(queries),
        "linear_us_per_lookup": lin_us,
        "radix_us_per_lookup": rad_us,
        "radix_block_match_us_per_lookup": eng_us,
        "speedup": lin_us / rad_us,
        "linear_put_s": t_ref_put,
        "radix_put_s": t_radix_put,
        "engine_cached_blocks": engine.num_cached_blocks(),
    }


def main() -> dict:
    rows = [run_size(n) for n in SIZES]
    print("== prefix lookup: reference linear scan vs radix tree (per lookup, microseconds)")
    print(f"{'prefixes':>10}{'hit frac':>10}{'linear':>12}{'radix':>10}{'block match':>13}"
          f"{'linear/radix':>14}")
    for r in rows:
        print(f"{r['cached_prefixes']:>10,}{r['hit_fraction']:>10.2f}"
              f"{r['linear_us_per_lookup']:>12,.1f}{r['radix_us_per_lookup']:>10.1f}"
              f"{r['radix_block_match_us_per_lookup']:>13.1f}{r['speedup']:>13,.0f}x")
    growth_lin = rows[-1]["linear_us_per_lookup"] / rows[0]["linear_us_per_lookup"]
    growth_rad = rows[-1]["radix_us_per_lookup"] / rows[0]["radix_us_per_lookup"]
    print(f"cost growth from {SIZES[0]:,} to {SIZES[-1]:,} prefixes: linear {growth_lin:.0f}x, "
          f"radix {growth_rad:.1f}x")
    result = {
        "benchmark": "prefix_cache",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "block_size": BLOCK_SIZE,
        "rows": rows,
        "linear_cost_growth": growth_lin,
        "radix_cost_growth": growth_rad,
    }
    write_results("prefix_cache", result)
    return result


if __name__ == "__main__":
    main()
