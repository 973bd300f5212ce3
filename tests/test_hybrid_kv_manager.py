"""The hybrid KV cache manager (kvlab/core/hybrid_kv_cache_manager.py): groups cut as vLLM cuts
them, a window group's blocks bounded by its window, prefix hits by each group's rule, and the
per-group invariants (refcounts, copy-on-write, all-or-nothing, idempotent release) under a
random workload and under the chaos run."""

from __future__ import annotations

import random
from functools import partial

import pytest

from kvlab.core.block_pool import CACHE_OWNER, OutOfBlocks
from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvlab.core.kv_cache_groups import group_layers, window_blocks
from kvlab.labs.capacity.hf_config import shipped_layout
from kvlab.labs.capacity.hybrid_plan import plan_layout
from kvlab.labs.chaos.soak import ChaosConfig, run_chaos
from kvlab.labs.invariants import check_kv_manager

S = ("model-w", "tenant-1")


def unchanged(mgr: HybridKVCacheManager, fn, exc) -> None:
    before = mgr.state_tuple()
    with pytest.raises(exc):
        fn()
    assert mgr.state_tuple() == before
    check_kv_manager(mgr)


# ----------------------------------------------------------------------------- groups
@pytest.mark.parametrize("name", ["gemma-3-27b-it", "gpt-oss-120b", "mistral-7b-v0.1"])
def test_groups_are_the_planners_which_are_vllms(name):
    """The engine's groups equal the planner's (whose groups a test compares with vLLM's own
    objects, tests/test_kv_layouts.py), up to order: full attention first here."""
    layout = shipped_layout(name)
    windows = [layer.window or 0 for layer in layout.layers]
    plan = plan_layout(layout, 80 * 2**30, weight_bytes=0)
    ours = group_layers(windows)
    assert sorted((g.window, g.layers) for g in ours) == sorted(
        (g.window or 0, g.layers) for g in plan.groups)
    assert ours[0].window == min(windows)
    assert max(len(g.layers) for g in ours) == plan.groups[0].slots


def test_group_sizes_and_padding():
    assert [(g.window, g.layers) for g in group_layers([0, 8, 8, 8])] == [
        (0, (0,)), (8, (1,)), (8, (2,)), (8, (3,))]          # Qwen2, max_window_layers=1
    assert group_layers([4] * 5) == group_layers((4,) * 5)
    assert [g.layers for g in group_layers([4] * 5)] == [(0, 1, 2, 3, 4)]
    twelve_thirteen = group_layers([16] * 12 + [0] * 13)   # under 1.5x: one padding slot
    assert [len(g.layers) for g in twelve_thirteen] == [13, 12]
    for bad in ([], [0, -1], [0.5], None):
        with pytest.raises((ValueError, TypeError)):
            group_layers(bad)


# ----------------------------------------------------------------------------- the window
def _run(mgr: HybridKVCacheManager, rid: str, tokens: list[int], chunk: int,
         on_step=None) -> None:
    """Admit ``rid`` and compute ``tokens`` ``chunk`` at a time, committing as the scheduler
    does after every step."""
    mgr.admit(rid, S, tokens, min(chunk, len(tokens)))
    done = min(chunk, len(tokens))
    mgr.commit(rid, tokens[:done])
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        mgr.grow(rid, done + n, write_from=done)
        done += n
        if mgr.needs_commit(rid, done):
            mgr.commit(rid, tokens[:done])
        if on_step is not None:
            on_step(done)


@pytest.mark.parametrize(("window", "bs", "chunk"), [(8, 4, 1), (8, 4, 6), (37, 16, 64),
                                                      (1, 4, 3), (1024, 16, 512)])
def test_a_window_group_holds_what_its_window_reaches(window, bs, chunk):
    mgr = HybridKVCacheManager(4096, bs, (0, window), chunk_tokens=chunk)
    tokens = list(range(3000))
    peak = 0

    def step(done: int) -> None:
        nonlocal peak
        full, sliding = mgr.block_tables("a")
        held = sum(b is not None for b in sliding)
        # exactly the blocks from the one holding the first token of the last step's window
        first = max(0, done - chunk_size(done) - window + 1) // bs
        assert held == len(sliding) - first
        assert None not in full and len(full) == -(-done // bs)
        peak = max(peak, held)

    def chunk_size(done: int) -> int:
        return (done - min(chunk, 3000)) % chunk or chunk

    _run(mgr, "a", tokens, chunk, step)
    assert peak <= window_blocks(window, 3000, bs, chunk) <= peak + 1
    assert len(mgr.held_blocks("a")) < 2 * mgr.blocks_for(0) + 2 * -(-3000 // bs)
    check_kv_manager(mgr)
    # what the window released stayed cached: the whole prompt hits again
    mgr.free("a")
    assert mgr.lookup(S, [*tokens, 1]) == 3000 // bs * bs
    check_kv_manager(mgr)


def test_blocks_for_bounds_every_group():
    mgr = HybridKVCacheManager(100, 16, (0, 1024, 1024), chunk_tokens=2048)
    per_window = -(-(1023 + 2048) // 16) + 1
    assert mgr.blocks_for(8192) == 512 + 2 * per_window
    assert mgr.blocks_for(100) == 3 * 7                    # under the window: every block
    assert HybridKVCacheManager(9, 4, (8,)).blocks_for(40) == 10   # no chunk bound: all


# ----------------------------------------------------------------------------- prefix hits
def test_a_window_group_hit_needs_only_the_blocks_in_its_window():
    """vLLM's rule: after the early blocks of the window group are evicted, the prompt still
    hits in full (the first token to compute sees only the last W-1 tokens); with that group
    under full attention the same pressure cuts the hit short."""
    hits = {}
    for windows in ((0, 8), (0, 0)):
        mgr = HybridKVCacheManager(20, 4, windows, chunk_tokens=4)
        prompt = list(range(100, 140))                 # 10 blocks a group: the whole pool
        _run(mgr, "a", prompt, 4)
        mgr.free("a")
        assert mgr.pool.num_free() == 0 and mgr.prefix_cache.evictable_blocks() == 20
        # a stranger's prompt takes 3 blocks per group: the 6 least recently released go,
        # in (0, 8) the first window blocks "a" released while it ran
        mgr.admit("b", ("other",), list(range(12)), 12)
        assert mgr.prefix_cache.num_cached_blocks() == 14
        hit = mgr.find_prefix(S, [*prompt, 7])
        hits[windows] = hit
        check_kv_manager(mgr)
    windowed, full = hits[(0, 8)], hits[(0, 0)]
    assert windowed.cached == 40
    reach = -(-(8 - 1) // 4)                           # the blocks of W - 1 = 7 tokens
    assert windowed.group_blocks[1][:10 - reach] == (None,) * (10 - reach)
    assert None not in windowed.group_blocks[1][10 - reach:]
    assert None not in windowed.group_blocks[0]
    assert full.cached < 40


def _reference_hit(mgr: HybridKVCacheManager, tokens: list[int]) -> int:
    """The rule, written out: the longest whole-block prefix (last token excluded) whose
    blocks every full group holds, and whose last ceil((W-1)/bs) blocks every window group
    holds."""
    path = mgr.prefix_cache.match(S, tokens)
    best = 0
    for h in range(len(path) + 1):
        ok = True
        for g, w in enumerate(mgr.windows):
            need = range(h) if not w else range(max(0, h - -(-(w - 1) // mgr.block_size)), h)
            ok &= all(path[i].blocks[g] is not None for i in need)
        if ok:
            best = h
    return best * mgr.block_size


def _random_workload(seed: int, windows: tuple[int, ...], steps: int = 400) -> None:
    """Random admissions (with hits), chunked growth, commits, forks, copies, rollbacks and
    frees over a small pool: the per-group invariants hold after every operation, a refused
    one changes nothing, and every lookup equals the written-out rule."""
    rng = random.Random(seed)
    bs = rng.choice((2, 4))
    chunk = rng.choice((1, 3, 8))
    mgr = HybridKVCacheManager(rng.choice((12, 24, 40)), bs, windows, chunk_tokens=chunk)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live: dict[str, list[int]] = {}     # request -> its tokens
    done: dict[str, int] = {}           # request -> tokens computed
    pending: list[tuple[int, int]] = []
    serial = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 or not live:
            serial += 1
            rid = f"r{serial}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(12))]
            hit = mgr.find_prefix(S, tokens)
            assert hit.cached == _reference_hit(mgr, tokens)
            n = min(len(tokens), hit.cached + chunk)
            if hit.blocks_needed(n, bs) > mgr.num_allocatable_blocks():
                unchanged(mgr, partial(mgr.admit, rid, S, tokens, n, hit), OutOfBlocks)
                continue
            assert mgr.admit(rid, S, tokens, n, hit) == hit.cached
            live[rid], done[rid] = tokens, n
        elif op < 0.65:
            rid = rng.choice(sorted(live))
            if done[rid] == len(live[rid]):
                live[rid].append(rng.randrange(50))        # a decode step
            start = done[rid]
            n = min(chunk, len(live[rid]) - start)
            need = mgr.blocks_needed(rid, start + n, write_from=start)
            if need > mgr.num_allocatable_blocks():
                unchanged(mgr, partial(mgr.grow, rid, start + n, start), OutOfBlocks)
                continue
            pending += mgr.grow(rid, start + n, write_from=start)
            done[rid] = start + n
            if mgr.needs_commit(rid, done[rid]):
                mgr.commit(rid, live[rid][:done[rid]])
        elif op < 0.72 and pending:
            mgr.complete_copies(pending)
            pending = []
        elif op < 0.78:
            parent = rng.choice(sorted(live))
            serial += 1
            mgr.fork(parent, f"r{serial}")
            live[f"r{serial}"], done[f"r{serial}"] = list(live[parent]), done[parent]
        elif op < 0.84:
            rid = rng.choice(sorted(live))            # a speculative rollback of slots
            mgr.truncate(rid, max(done[rid], mgr.num_slots(rid) - bs))
        else:
            rid = rng.choice(sorted(live))
            assert mgr.free(rid) is True
            assert mgr.free(rid) is False             # idempotent, nothing changes
            del live[rid], done[rid]
        check_kv_manager(mgr)
    mgr.complete_copies(pending)
    for rid in list(live):
        mgr.free(rid)
    check_kv_manager(mgr)
    assert mgr.num_allocatable_blocks() == mgr.num_blocks     # nothing leaked


@pytest.mark.parametrize("windows", [(0, 3), (5,), (0, 4, 4), (2, 0, 9), (1, 0)])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_every_groups_invariants(windows, seed):
    _random_workload(seed, windows)


def test_copy_on_write_in_every_group():
    mgr = HybridKVCacheManager(30, 4, (0, 6))
    prompt = list(range(10))
    mgr.admit("a", S, prompt, 10)
    mgr.fork("a", "b")
    full_a, win_a = mgr.block_tables("a")
    assert mgr.block_tables("b") == (full_a, win_a)
    copies = mgr.grow("b", 11, write_from=10)         # writes into the shared third block
    assert sorted(src for src, _ in copies) == sorted([full_a[2], win_a[2]])
    full_b, win_b = mgr.block_tables("b")
    assert full_b[2] != full_a[2] and win_b[2] != win_a[2]
    assert mgr.pool.owners(full_a[2]) == {"a"}
    unchanged(mgr, lambda: mgr.commit("b", prompt + [1] * 10), ValueError)
    mgr.complete_copies(copies)
    check_kv_manager(mgr)


def test_bad_calls_change_nothing_and_name_the_problem():
    mgr = HybridKVCacheManager(6, 4, (0, 4))
    mgr.admit("a", S, list(range(8)), 8)
    unchanged(mgr, lambda: mgr.admit("a", S, [1], 1), ValueError)
    unchanged(mgr, lambda: mgr.admit("b", S, list(range(40)), 40), OutOfBlocks)
    unchanged(mgr, lambda: mgr.grow("a", 4, write_from=6), ValueError)
    unchanged(mgr, lambda: mgr.grow("zz", 4, write_from=0), KeyError)
    unchanged(mgr, lambda: mgr.grow("a", 40, write_from=8), OutOfBlocks)
    with pytest.raises(ValueError, match="windows"):
        HybridKVCacheManager(6, 4, (0, -1))
    with pytest.raises(ValueError, match="chunk_tokens"):
        HybridKVCacheManager(6, 4, (0,), chunk_tokens=0)


def test_a_full_pool_evicts_what_the_windows_released_first():
    """Cached blocks the window released while the request ran are the least recently used:
    pressure takes them before the full group's, and the tree stays well formed."""
    mgr = HybridKVCacheManager(24, 4, (0, 4), chunk_tokens=24)
    prompt = list(range(40))
    _run(mgr, "a", prompt, 4)
    released = [b for b in mgr.prefix_cache.indexed_blocks()
                if mgr.pool.owners(b) == {CACHE_OWNER}]
    assert released and all(mgr.prefix_cache.group_of(b) == 1 for b in released)
    stranger = list(range(4 * ((mgr.pool.num_free() + len(released)) // 2)))
    mgr.admit("b", ("other",), stranger, len(stranger))     # evicts len(released) blocks
    assert not set(released) & set(mgr.prefix_cache.indexed_blocks())
    # what "a" still holds (its full group, its window's last blocks) stays cached
    assert sorted(mgr.prefix_cache.indexed_blocks()) == sorted(mgr.held_blocks("a"))
    check_kv_manager(mgr)


def test_chaos_run_with_hybrid_managers_keeps_every_invariant():
    """The chaos run (faults, aborts, crashes and recovery, speculation) over hybrid managers:
    the spec's invariants and the per-group set hold every step; outputs equal solo runs."""
    for windows in ((0, 6), (5,), (0, 4, 4)):
        for seed in range(3):
            result = run_chaos(seed, ChaosConfig(steps=60, windows=windows))
            assert not result.mismatches and result.leaked_blocks == 0
            assert result.checks > 0 and result.finished


def test_the_per_group_checks_are_not_vacuous(monkeypatch):
    """A window group that never releases, and a stale evictable count, are each caught and
    named."""
    mgr = HybridKVCacheManager(64, 4, (0, 4), chunk_tokens=4)
    plan = HybridKVCacheManager._plan_grow

    def keep_everything(self, rid, num_tokens, write_from):
        skipped, extra, targets = plan(self, rid, num_tokens, write_from)
        return [[] for _ in skipped], extra, targets

    monkeypatch.setattr(HybridKVCacheManager, "_plan_grow", keep_everything)
    with pytest.raises(AssertionError, match="window groups bounded"):
        _run(mgr, "a", list(range(40)), 4, lambda _: check_kv_manager(mgr))
    monkeypatch.undo()
    mgr = HybridKVCacheManager(64, 4, (0, 4), chunk_tokens=4)
    _run(mgr, "a", list(range(40)), 4)
    check_kv_manager(mgr)
    mgr.prefix_cache.evictable_blocks = lambda: 0                 # a count gone stale
    with pytest.raises(AssertionError, match="evictable accounting exact"):
        check_kv_manager(mgr)


def test_committed_engine_block_counts_are_what_the_manager_holds():
    """benchmarks/results/kv_layouts.json measured the blocks one 8k request held in the real
    engine; the same scheduler and manager driven without a model hold exactly as many (the
    model decides tokens, never tables)."""
    import json
    from pathlib import Path

    from kvlab.core.baseline_scheduler import BaselineScheduler
    from kvlab.core.engine_core import EngineCore
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.request import RuntimeRequest
    from kvlab.core.scheduler_config import SchedulerConfig
    from kvlab.core.step_records import ModelOutput

    stored = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results"
                         / "kv_layouts.json").read_text())["engine"]
    setup = stored["setup"]
    bs, budget = setup["block_size"], setup["max_num_batched_tokens"]
    gen = setup["one_request_generated"]

    class Zeros:                        # every sampling chunk gets token 0
        def execute(self, output):
            return ModelOutput({c.request_id: 0 for c in output.chunks if c.sample})

    for name, row in stored["blocks_held_one_request"].items():
        windows = [g["window"] for g in row["groups"]]
        kv = (KVCacheManager(4096, bs) if not any(windows) else
              HybridKVCacheManager(4096, bs, windows, chunk_tokens=budget))
        sched = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=64,
                                                      max_num_batched_tokens=budget,
                                                      prefill_chunk=budget))
        core = EngineCore(sched, Zeros())
        core.add_request(RuntimeRequest("r", tuple(range(setup["context"] - gen)), gen))
        peak: list[int] = []
        end: list[int] = []
        while core.has_unfinished_requests():
            core.step()
            if kv.has("r"):
                tables = kv.block_tables("r") if any(windows) else (kv.block_table("r"),)
                end = [sum(b is not None for b in t) for t in tables]
                peak = [max(a, b) for a, b in zip(peak or end, end, strict=True)]
        assert (peak, end) == (row["peak_blocks_per_group"], row["end_blocks_per_group"]), name
    held = stored["blocks_held_one_request"]
    assert held["window_every_layer"]["end_blocks"] < held["no_window"]["end_blocks"] / 4


def test_reset_prefix_cache_forgets_every_group_only_when_idle():
    """vLLM's reset_prefix_cache contract, per group: refused (False, nothing changed) while a
    request holds blocks; afterwards every cached block of every group is free and a repeat
    of the prompt hits nothing."""
    mgr = HybridKVCacheManager(64, 4, [0, 8])
    tokens = list(range(40))
    _run(mgr, "a", tokens, 8)
    before = mgr.state_tuple()
    assert mgr.reset_prefix_cache() is False and mgr.state_tuple() == before
    mgr.free("a")
    assert mgr.prefix_cache.num_cached_blocks() > 0
    assert mgr.reset_prefix_cache() is True
    assert mgr.prefix_cache.num_cached_blocks() == 0
    assert mgr.pool.num_free() == 64
    assert mgr.lookup(S, tokens) == 0
    check_kv_manager(mgr)
    assert HybridKVCacheManager(8, 4, [0], enable_prefix_caching=False).reset_prefix_cache()
