"""The decode-path shortcuts change nothing observable.

``KVCacheManager``'s O(1) shortcuts (the no-op test in ``grow``; ``needs_commit`` letting the
scheduler skip ``commit`` between block boundaries; ``commit`` inserting only the new blocks
below the locked node) and ``RuntimeRequest.token_slice`` must behave exactly like the general
code they bypass. Differential tests: the same random workload runs on a manager (or scheduler)
and on :class:`GeneralPath`, a test-only subclass with every shortcut replaced by the general
computation, and every return value, exception and state snapshot must agree step by step.
"""

from __future__ import annotations

import random

import pytest

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.labs.invariants import check_kv_manager, check_scheduler
from kvlab.labs.kv_snapshot import snapshot_of
from kvlab.labs.recovery.event_log import EventLog
from kvlab.sim.tokens import drive

SHARED = tuple(range(900, 940))


class GeneralPath(KVCacheManager):
    """The manager with its shortcuts replaced by the general code (for differential tests)."""

    def _grow_is_noop(self, table, num_tokens, write_from):
        return False

    def needs_commit(self, request_id, num_tokens):
        self.block_table(request_id)   # KeyError for an unknown id, like the real one
        return self.prefix_cache is not None

    def _insert(self, request_id, token_ids, table, done, full):
        return self.prefix_cache.insert(self.scope_of(request_id), token_ids, table[:full])


def _outcome(fn):
    """``("ok", value)`` or ``("error", exception type)``."""
    try:
        return ("ok", fn())
    except (OutOfBlocks, ValueError, KeyError) as e:
        return ("error", type(e))


def _state(kv: KVCacheManager):
    return kv.state_tuple(), snapshot_of(kv)


def _both(managers, method: str, *args):
    """Call ``method(*args)`` on each manager; their outcomes."""
    return [_outcome(lambda kv=kv: getattr(kv, method)(*args)) for kv in managers]


# ---------------------------------------------------------------- KV manager, random operations
@pytest.mark.parametrize("seed", range(40))
def test_manager_fast_paths_match_the_general_path(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(4, 40)
    caching = rng.random() < 0.8
    fast = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    slow = GeneralPath(num_blocks, block_size, enable_prefix_caching=caching)
    pair = (fast, slow) if seed % 2 else (slow, fast)
    tokens: dict[str, list[int]] = {}   # request -> tokens whose KV is written (or being written)
    pending: list[tuple[int, int]] = []
    counter = 0
    for _ in range(300):
        live = sorted(tokens)
        op = rng.choice(["admit", "decode", "decode", "decode", "decode", "chunk", "rewrite",
                         "fork", "complete", "free", "bad"])
        if op == "admit" or not live:
            rid = f"r{counter}"
            counter += 1
            prompt = list(SHARED[: rng.choice([0, 3, 8, 16])])
            prompt += [rng.randint(1, 50) for _ in range(rng.randint(1, 10))]
            res = _both(pair, "admit", rid, ("s",), prompt, len(prompt))
            if res[0][0] == "ok":
                tokens[rid] = prompt
        elif op in ("decode", "chunk", "rewrite"):
            rid = rng.choice(live)
            n = len(tokens[rid])
            if op == "decode":
                end, start = n + 1, n
            elif op == "chunk":
                end, start = n + rng.randint(1, 3 * block_size), n
            else:  # write again inside what the table holds (e.g. recompute after a fork)
                end = rng.randint(0, fast.num_slots(rid))
                start = rng.randint(0, end)
            res = _both(pair, "grow", rid, end, start)
            if res[0][0] == "ok":
                pending += res[0][1]
                tokens[rid] += [rng.randint(1, 50) for _ in range(max(0, end - n))]
                # the scheduler's commit after the step: skipped when the fast path says so
                if fast.needs_commit(rid, len(tokens[rid])):
                    fast.commit(rid, tokens[rid])
                if caching:
                    slow.commit(rid, tokens[rid])
        elif op == "fork" and not pending:
            # as in a scheduler step: copies done, the parent commits, forks, the child commits
            parent = rng.choice(live)
            child = f"r{counter}"
            counter += 1
            if caching:
                for kv in pair:
                    kv.commit(parent, tokens[parent])
            res = _both(pair, "fork", parent, child)
            if res[0][0] == "ok":
                tokens[child] = list(tokens[parent])
                if caching:
                    for kv in pair:
                        kv.commit(child, tokens[child])
        elif op == "complete" and pending:
            done = rng.sample(pending, rng.randint(1, len(pending)))
            for c in done:
                pending.remove(c)
            res = _both(pair, "complete_copies", done)
        elif op == "free":
            rid = rng.choice(live)
            del tokens[rid]
            res = _both(pair, "free", rid)
        elif op == "bad":  # invalid calls fail the same way and change nothing
            rid = rng.choice([*live, "nobody"])
            end = rng.randint(-1, 3)
            res = _both(pair, "grow", rid, end, end + 1)
        else:
            continue
        assert res[0] == res[1], op
        assert _state(fast) == _state(slow), op
        check_kv_manager(fast)


def test_grow_noop_test_is_exact_on_the_cases_it_accepts():
    kv = KVCacheManager(8, 4)
    kv.admit("a", (), [1, 2, 3], 3)                 # one block, 4 slots
    assert kv._grow_is_noop(kv._table("a"), 4, 3)   # decode into its own block
    assert kv._grow_is_noop(kv._table("a"), 2, 2)   # nothing to write
    assert not kv._grow_is_noop(kv._table("a"), 5, 4)   # needs a second block
    assert kv._grow_is_noop(kv._table("a"), 4, 0)   # a rewrite inside its own block
    kv.fork("a", "b")                               # the block is shared now
    assert not kv._grow_is_noop(kv._table("b"), 4, 3)
    assert kv.grow("b", 4, 3) == [(0, 1)]           # ... and the general path copies it


def test_needs_commit_only_at_block_boundaries():
    kv = KVCacheManager(8, 4)
    kv.admit("a", (), [1, 2, 3], 3)
    assert not kv.needs_commit("a", 3)
    kv.grow("a", 4, 3)
    assert kv.needs_commit("a", 4)
    kv.commit("a", [1, 2, 3, 4])
    assert not kv.needs_commit("a", 4)
    with pytest.raises(KeyError):
        kv.needs_commit("nobody", 4)
    off = KVCacheManager(8, 4, enable_prefix_caching=False)
    off.admit("a", (), [1, 2, 3], 3)
    off.grow("a", 4, 3)
    assert not off.needs_commit("a", 4)


# ---------------------------------------------------------------- whole schedulers
def _workload(rng: random.Random):
    """Random arrivals; one in five is an n > 1 request, fanned out as the engine does."""
    arrivals: dict[int, list[RuntimeRequest]] = {}
    for i in range(rng.randint(1, 14)):
        prompt = SHARED[: rng.choice([0, 5, 16, 33])] + tuple(
            rng.randint(1, 300) for _ in range(rng.randint(1, 20)))
        max_tokens = rng.randint(1, 24)
        step = arrivals.setdefault(rng.randint(1, 12), [])
        step.append(RuntimeRequest(f"r{i}", prompt, max_tokens, priority=rng.randint(0, 1)))
        if rng.random() < 0.2:
            step += [RuntimeRequest(f"r{i}#{k}", prompt, max_tokens)
                     for k in range(1, rng.randint(2, 3))]
    return arrivals


def _trace(cls, manager_cls, seed: int):
    rng = random.Random(seed)
    arrivals = _workload(rng)
    kv = manager_cls(rng.randint(12, 60), rng.choice([2, 4, 8]),
                     enable_prefix_caching=rng.random() < 0.85)
    seqs = rng.randint(1, 8)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=rng.randint(seqs, 40),
                          prefill_chunk=rng.randint(1, 16),
                          admission=rng.choice(["reserve", "watermark"]))
    sched = cls(kv, cfg, log=EventLog())
    steps = []
    drive(sched, arrivals=arrivals, check=check_scheduler, max_steps=5000,
          on_step=lambda out: steps.append((out, kv.state_tuple())))
    requests = [(r.request_id, r.status, tuple(r.output_token_ids), r.num_preemptions)
                for r in sched.requests()]
    return steps, requests, list(sched.log)


@pytest.mark.parametrize("cls", [BaselineScheduler, ProductionScheduler])
@pytest.mark.parametrize("seed", range(25))
def test_schedulers_step_identically_with_and_without_fast_paths(cls, seed):
    assert _trace(cls, KVCacheManager, seed) == _trace(cls, GeneralPath, seed)


# ---------------------------------------------------------------- token slices
def test_token_slice_equals_slicing_all_token_ids():
    r = RuntimeRequest("r", (5, 6, 7), max_tokens=8)
    for outputs in ([], [8], [8, 9, 10]):
        r.output_token_ids = list(outputs)
        n = r.num_tokens
        for start in range(n + 3):
            for end in range(start, n + 3):
                assert r.token_slice(start, end) == r.all_token_ids[start:end], (start, end)
    with pytest.raises(ValueError):
        r.token_slice(-1, 2)
    with pytest.raises(ValueError):
        r.token_slice(3, 2)


# ---------------------------------------------------------------- radix insert below a node
def test_insert_below_a_node_equals_inserting_the_whole_path():
    from kvlab.core.radix_cache import RadixCache

    tokens = list(range(1, 13))
    whole, below = RadixCache(2), RadixCache(2)
    for cache in (whole, below):
        cache.insert(("s",), [1, 2, 7, 7], [10, 11])          # a sibling branch
    first = below.insert(("s",), tokens[:4], [0, 1])
    whole.insert(("s",), tokens[:4], [0, 1])
    a = whole.insert(("s",), tokens, [0, 1, 2, 3, 4, 5])
    b = below.insert(("s",), tokens[4:], [2, 3, 4, 5], below=first.node)
    assert a.new_blocks == b.new_blocks == (2, 3, 4, 5)
    assert a.node.node_id == b.node.node_id
    assert whole.state_tuple() == below.state_tuple()
    before = below.state_tuple()
    with pytest.raises(ValueError):
        below.insert(("other",), tokens[4:], [2, 3], below=first.node)
    assert below.state_tuple() == before
