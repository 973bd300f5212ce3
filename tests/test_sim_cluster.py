"""The cluster simulator (kvlab/sim/cluster.py) and its router policies (kvlab/sim/routers.py)."""

from __future__ import annotations

import random

import pytest

from kvlab.sim.cluster import BlockIndex, LinearStepCost, block_keys, simulate_cluster
from kvlab.sim.routers import POLICIES, ApproxTree, DynamoCost, make_policy
from kvlab.sim.workload import RequestSpec


def tenants_workload(n: int, tenants: int, rate: float, prompt: int, out: int, *,
                     seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        specs.append(RequestSpec(f"r{i}", t, prompt, out, prefix_group=rng.randrange(tenants)))
    return specs


def _paths(cache, block_size):
    keys = set()
    for _, root in cache.roots():
        stack = [(root, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                tokens = path + child.chunk
                keys.add(block_keys(tokens, block_size)[-1])
                stack.append((child, tokens))
    return keys


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_once_and_counters_add_up(policy):
    specs = tenants_workload(60, 6, 40.0, 120, 8)
    result = simulate_cluster(specs, make_policy(policy), replicas=3, num_blocks=40,
                              block_size=16, shared_prefix=100)
    assert [r.request_id for r in result.records] == [s.request_id for s in specs]
    assert all(r.finish is not None and r.first_token is not None for r in result.records)
    assert all(r.first_token >= r.arrival and r.finish >= r.first_token for r in result.records)
    assert sum(result.requests_per_replica()) == 60
    for i, stats in enumerate(result.replicas):
        mine = [r for r in result.records if r.replica == i]
        assert stats.requests == len(mine)
        assert stats.hit_tokens == sum(r.hit_tokens for r in mine)   # one admission each here
        assert stats.prompt_tokens == sum(r.prompt_len for r in mine)
    assert 0.0 <= result.hit_rate < 1.0


def test_block_index_follows_each_radix_cache_with_evictions():
    """40 blocks per replica and 12 tenants of 7-block prefixes: evictions happen; each
    replica's index (fed by its cache's events) names exactly the prefixes its tree holds."""
    specs = tenants_workload(120, 12, 30.0, 120, 4, seed=3)
    result = simulate_cluster(specs, make_policy("round_robin"), replicas=2, num_blocks=40,
                              block_size=16, shared_prefix=112)
    assert result.hit_rate > 0
    # rerun keeping the replicas to inspect them
    from kvlab.sim import cluster as c

    seen = []
    original = c.Replica.__init__

    def spy(self, *a, **k):
        original(self, *a, **k)
        seen.append(self)

    c.Replica.__init__ = spy
    try:
        simulate_cluster(specs, make_policy("round_robin"), replicas=2, num_blocks=40,
                         block_size=16, shared_prefix=112)
    finally:
        c.Replica.__init__ = original
    for replica in seen:
        assert replica.index.keys == _paths(replica.kv.prefix_cache, 16)
        assert len(replica.index.keys) == replica.kv.prefix_cache.num_cached_blocks()


def test_round_robin_splits_evenly_and_precise_keeps_a_tenant_together():
    specs = tenants_workload(40, 4, 10.0, 200, 4, seed=1)
    rr = simulate_cluster(specs, make_policy("round_robin"), replicas=4, num_blocks=200,
                          block_size=16, shared_prefix=180)
    assert rr.requests_per_replica() == [10, 10, 10, 10]
    precise = simulate_cluster(specs, make_policy("precise_index"), replicas=4, num_blocks=200,
                               block_size=16, shared_prefix=180)
    # after its first request, every request of a tenant finds the tenant's prefix somewhere
    first = {}
    for rec in precise.records:
        if rec.tenant in first:
            assert rec.hit_tokens >= 176   # 11 full blocks of the 180 shared tokens
        first.setdefault(rec.tenant, rec)
    assert precise.hit_rate > rr.hit_rate


def test_dynamo_cost_is_the_documented_logit():
    """One replica holds the prompt's prefix; the logit 2*overlap - usage - waiting/max decides
    between it and an idle one exactly as written."""
    from kvlab.core.scheduler_config import SchedulerConfig
    from kvlab.sim.cluster import Replica
    from kvlab.sim.workload import to_request

    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, prefill_chunk=512)
    replicas = [Replica(i, 64, 16, LinearStepCost(), cfg) for i in range(2)]
    spec = RequestSpec("a", 0.0, 160, 4, prefix_group=0)
    warm = to_request(spec, shared_prefix=160)
    replicas[1].core.add_request(warm)
    while replicas[1].core.has_unfinished_requests():
        replicas[1].core.step()
    request = to_request(RequestSpec("b", 0.0, 160, 4, prefix_group=0), shared_prefix=160)
    keys = block_keys(request.prompt_token_ids[:-1], 16)
    assert replicas[1].index.overlap(keys) == 9 and replicas[0].index.overlap(keys) == 0
    assert DynamoCost().choose(request, keys, replicas) == 1
    # 2 * 144/160 = 1.8 against 0: the cached replica wins unless its load costs more than 1.8
    assert DynamoCost(overlap_weight=0.5).choose(request, keys, replicas) == 1
    assert ApproxTree().choose(request, keys, replicas) in (0, 1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="replicas"):
        simulate_cluster([], make_policy("round_robin"), replicas=0, num_blocks=8)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("sticky")
    with pytest.raises(ValueError, match="cache_threshold"):
        ApproxTree(cache_threshold=1.5)


def test_deterministic():
    specs = tenants_workload(50, 5, 20.0, 100, 6, seed=7)
    runs = [simulate_cluster(specs, make_policy("dynamo_cost"), replicas=3, num_blocks=60,
                             block_size=16, shared_prefix=80) for _ in range(2)]
    assert [(r.replica, r.first_token) for r in runs[0].records] == \
        [(r.replica, r.first_token) for r in runs[1].records]


def test_block_index_is_a_cache_listener():
    from kvlab.core.radix_cache import RadixCache

    cache = RadixCache(block_size=2)
    cache.listener = index = BlockIndex()
    cache.insert(("s",), [1, 2, 3, 4], [0, 1])
    assert index.overlap(block_keys([1, 2, 3, 4, 5], 2)) == 2
    cache.evict(1)
    assert index.overlap(block_keys([1, 2, 3, 4], 2)) == 1
    cache.clear()
    assert index.overlap(block_keys([1, 2], 2)) == 0 and not index.keys
