"""Contiguous pre-reservation vs paged KV allocation, side by side (chapter 2).

Part 1 — memory: for several workload seeds, serve the same ShareGPT-like workload with the
three contiguous policies (buddy and first-fit arenas) and with paging (block size 16), and
report the share of the arena holding token states, the waste, and the steps to finish; ratios
are paged / contiguous. Part 2 — page-table cost: compute the slot mapping of a large batch
with the vectorised ``slot_mapping`` and with a Python loop over the reference
``physical_slot``, and report the speed ratio.

Run: ``python benchmarks/bench_fragmentation.py``. Writes
``benchmarks/results/fragmentation.json``. Takes about a minute on two cores.
"""

from __future__ import annotations

import platform
import statistics
import time

import numpy as np
from _results import write_results

from kvlab.labs.fragmentation import compare_policies, sharegpt_like_workload
from kvlab.labs.paging import slot_mapping
from kvlab.reference import physical_slot

ARENA_TOKENS = 16384
NUM_REQUESTS = 1000
SEEDS = (0, 1, 2)
CONTIGUOUS = ("max", "pow2", "oracle")


def memory_part() -> dict:
    rows = {}
    for arena in ("buddy", "first_fit"):
        per_policy: dict[str, list] = {p: [] for p in (*CONTIGUOUS, "paged")}
        for seed in SEEDS:
            workload = sharegpt_like_workload(NUM_REQUESTS, seed=seed)
            reports = compare_policies(workload, ARENA_TOKENS, arena=arena)
            for name, rep in reports.items():
                per_policy[name].append({"token_states": rep.token_states, "waste": rep.waste,
                                         "steps": rep.steps, "preemptions": rep.preemptions,
                                         "mean_running": rep.mean_running})
        rows[arena] = per_policy
    return rows


def print_memory(rows: dict) -> None:
    print(f"== KV memory: {NUM_REQUESTS} requests x {len(SEEDS)} seeds, arena {ARENA_TOKENS:,} "
          "slots, paged block size 16")
    print(f"{'arena':<10}{'policy':<8}{'token states':>14}{'waste':>9}{'mean batch':>12}"
          f"{'steps':>9}{'paged/this: batch':>19}{'this/paged: steps':>19}")
    for arena, per_policy in rows.items():
        paged = per_policy["paged"]
        for name, runs in per_policy.items():
            mean = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
            batch_ratio = statistics.mean(p["mean_running"] for p in paged) / mean["mean_running"]
            steps_ratio = mean["steps"] / statistics.mean(p["steps"] for p in paged)
            print(f"{arena:<10}{name:<8}{100 * mean['token_states']:>13.1f}%"
                  f"{100 * mean['waste']:>8.1f}%{mean['mean_running']:>12.1f}"
                  f"{mean['steps']:>9,.0f}{batch_ratio:>18.2f}x{steps_ratio:>18.2f}x")


def slot_mapping_part(requests: int = 256, tokens: int = 2048, block_size: int = 16) -> dict:
    rng = np.random.default_rng(0)
    blocks_per = tokens // block_size
    perm = rng.permutation(requests * blocks_per)
    tables = [perm[i * blocks_per:(i + 1) * blocks_per].tolist() for i in range(requests)]
    positions = [np.arange(tokens)] * requests

    def best_of(fn, repeats: int = 3):
        times, value = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            value = fn()
            times.append(time.perf_counter() - start)
        return min(times), value

    vectorised, fast = best_of(lambda: slot_mapping(tables, block_size, positions))
    loop, slow = best_of(lambda: [physical_slot(t, block_size, int(p))
                                  for t, ps in zip(tables, positions, strict=True) for p in ps])
    assert fast.tolist() == slow
    result = {"tokens": requests * tokens, "vectorised_s": vectorised, "reference_loop_s": loop,
              "speedup": loop / vectorised}
    print(f"\n== slot mapping of {requests} requests x {tokens} positions "
          f"({requests * tokens:,} slots)")
    print(f"{'implementation (best of 3)':<30}{'seconds':>10}{'ratio':>9}")
    print(f"{'reference physical_slot loop':<30}{loop:>10.3f}{1.0:>8.2f}x")
    print(f"{'vectorised slot_mapping':<30}{vectorised:>10.3f}{result['speedup']:>8.2f}x")
    return result


def main() -> None:
    rows = memory_part()
    print_memory(rows)
    mapping = slot_mapping_part()
    print()
    write_results("fragmentation", {
        "arena_tokens": ARENA_TOKENS, "num_requests": NUM_REQUESTS, "seeds": list(SEEDS),
        "memory": rows, "slot_mapping": mapping,
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
    })


if __name__ == "__main__":
    main()
