"""Allocator and prefix-cache throughput on a realistic trace, with and without prefix caching.

Part 1 — trace. 1,500 requests, each one of 4 shared system prompts (512 tokens) plus a user
turn (32-256 tokens), generating 32-160 tokens; block size 16, 2,048 blocks (32k token slots),
at most 64 running. A small continuous-batching loop drives :class:`KVCacheManager` exactly as
the scheduler does: ``blocks_needed`` + ``admit`` (one chunk of prefill), ``grow`` + ``commit``
per decoded token, ``free`` at the end, preemption by recompute when a ``grow`` runs out of
blocks. It reports metadata operations per second, the prefix hit rate, and prefill tokens
computed, with caching on and off. (No model runs: this times the bookkeeping only.)

Part 2 — pool primitives: the owner-tracked :class:`BlockPool` against the reference
:class:`BlockAllocator` on allocate/release and fork/copy-on-write loops (the price of owner
tracking, fences and all-or-nothing validation).

Run: ``python benchmarks/bench_allocator.py``. Writes ``benchmarks/results/allocator.json``.
"""

from __future__ import annotations

import platform
import random
import time
from collections import deque

from _results import write_results

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.labs.invariants import check_kv_manager
from kvlab.labs.kv_snapshot import snapshot_of
from kvlab.reference import BlockAllocator

NUM_REQUESTS = 1_500
NUM_BLOCKS = 2_048
BLOCK_SIZE = 16
MAX_RUNNING = 64
SYSTEM_TOKENS = 512
VOCAB = 32_000


def make_trace(seed: int = 0):
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)] for _ in range(4)]
    trace = []
    for i in range(NUM_REQUESTS):
        turn = [rng.randrange(VOCAB) for _ in range(rng.randint(32, 256))]
        outputs = [rng.randrange(VOCAB) for _ in range(rng.randint(32, 160))]  # popped from the end
        trace.append((f"r{i}", systems[i % 4] + turn, outputs))
    return trace


def run_trace(enable_prefix_caching: bool) -> dict:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    scope = ("llama-3-8b", "v1", "tenant-a")
    waiting = deque(make_trace())
    running: dict[str, list] = {}  # rid -> [tokens so far, remaining outputs]
    ops = prefill_computed = prompt_tokens = preemptions = 0
    start = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < MAX_RUNNING:
            rid, tokens, outputs = waiting[0]
            need = kv.blocks_needed(None, len(tokens), scope, tokens)
            ops += 1
            if need > kv.num_allocatable_blocks():
                break
            waiting.popleft()
            cached = kv.admit(rid, scope, tokens, len(tokens))
            kv.commit(rid, tokens)
            ops += 2
            prefill_computed += len(tokens) - cached
            prompt_tokens += len(tokens)
            running[rid] = [list(tokens), list(outputs)]
        for rid in list(running):
            if rid not in running:  # preempted earlier in this step
                continue
            tokens, outputs = running[rid]
            if not outputs:
                kv.free(rid)
                ops += 1
                del running[rid]
                continue
            try:
                kv.grow(rid, len(tokens) + 1, len(tokens))
            except MemoryError:  # preempt the newest request and recompute it later
                victim = next(reversed(running))
                vt, vo = running.pop(victim)
                kv.free(victim)
                waiting.appendleft((victim, vt, vo))
                preemptions += 1
                ops += 2
                continue
            tokens.append(outputs.pop())
            kv.commit(rid, tokens)
            ops += 2
    elapsed = time.perf_counter() - start
    check_kv_manager(kv)
    snap = snapshot_of(kv)
    return {
        "prefix_caching": enable_prefix_caching,
        "ops": ops,
        "seconds": elapsed,
        "ops_per_s": ops / elapsed,
        "prompt_tokens_admitted": prompt_tokens,
        "prefill_tokens_computed": prefill_computed,
        "hit_rate": snap.hit_rate,
        "preemptions": preemptions,
    }


def pool_primitives(iterations: int = 200_000) -> dict:
    pool, ref = BlockPool(1024), BlockAllocator(1024)
    t0 = time.perf_counter()
    for _ in range(iterations):
        b = pool.allocate(1, "r")
        pool.release(b, "r")
    pool_alloc = (time.perf_counter() - t0) / iterations * 1e9
    t0 = time.perf_counter()
    for _ in range(iterations):
        b = ref.allocate()
        ref.release([b])
    ref_alloc = (time.perf_counter() - t0) / iterations * 1e9
    n = iterations // 10
    table = pool.allocate(8, "p")
    t0 = time.perf_counter()
    for _ in range(n):
        pool.fork(table, "p", "c")
        copies = pool.cow(table[-1:], "c")
        pool.complete_copies(copies)
        pool.release([*table[:-1], copies[0][1]], "c")
    pool_fork = (time.perf_counter() - t0) / n * 1e9
    rtable = [ref.allocate() for _ in range(8)]
    t0 = time.perf_counter()
    for _ in range(n):
        child = ref.share(rtable)
        child, _copy = ref.cow(child, 7)
        ref.release(child)
    ref_fork = (time.perf_counter() - t0) / n * 1e9
    return {
        "allocate_release_ns": {"BlockPool": pool_alloc, "BlockAllocator": ref_alloc},
        "fork_cow_release_8_blocks_ns": {"BlockPool": pool_fork, "BlockAllocator": ref_fork},
    }


def main() -> dict:
    on, off = run_trace(True), run_trace(False)
    print(f"== trace: {NUM_REQUESTS} requests, 4 shared {SYSTEM_TOKENS}-token system prompts, "
          f"{NUM_BLOCKS} blocks x {BLOCK_SIZE}")
    print(f"{'prefix caching':<16}{'ops/s':>10}{'hit rate':>10}{'prefill computed':>18}"
          f"{'preemptions':>13}")
    for r in (on, off):
        print(f"{'on' if r['prefix_caching'] else 'off':<16}{r['ops_per_s']:>10,.0f}"
              f"{r['hit_rate']:>10.1%}{r['prefill_tokens_computed']:>18,}{r['preemptions']:>13}")
    saved = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    print(f"prefill tokens saved by caching: {saved:.1%}; "
          f"bookkeeping speed on/off: {on['ops_per_s'] / off['ops_per_s']:.2f}x")
    prim = pool_primitives()
    print("== pool primitives (ns per operation)")
    print(f"{'operation':<32}{'BlockPool':>12}{'BlockAllocator':>16}{'ratio':>8}")
    for name, row in prim.items():
        print(f"{name:<32}{row['BlockPool']:>12,.0f}{row['BlockAllocator']:>16,.0f}"
              f"{row['BlockPool'] / row['BlockAllocator']:>7.1f}x")
    result = {
        "benchmark": "allocator",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "trace": {"caching_on": on, "caching_off": off, "prefill_saved_fraction": saved},
        "primitives": prim,
    }
    write_results("allocator", result)
    return result


if __name__ == "__main__":
    main()
