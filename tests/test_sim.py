"""Simulator: cost model numbers, workloads, the simulated-clock executor, static batching."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import ScheduledChunk
from kvlab.sim.costmodel import (
    RooflineCostModel,
    speculative_memory,
    speculative_step_cost,
)
from kvlab.sim.executor import SimClock, simulate
from kvlab.sim.static_batching import StaticBatchScheduler
from kvlab.sim.workload import (
    RequestSpec,
    fixed,
    lognormal,
    make_workload,
    poisson_arrivals,
    to_request,
    uniform,
)

CM = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM")


def test_core_and_sim_do_not_import_torch():
    code = ("import sys, kvlab.core.scheduler, kvlab.labs.recovery, kvlab.sim.executor, "
            "kvlab.sim.static_batching; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_single_decode_is_memory_bound_and_reads_the_weights():
    cost = CM.cost([(1, 99, True)])
    assert cost.bound == "memory"
    weights = 8_030_261_248 * 2
    kv = 2 * 32 * 8 * 128 * 2 * (100 + 1)        # read 100 tokens of context, write 1
    assert cost.bytes == pytest.approx(weights + kv)
    assert cost.seconds == pytest.approx((weights + kv) / 3350e9 + 0.5e-3)


def test_long_prefill_is_compute_bound():
    n = 8192
    cost = CM.cost([(n, 0, True)])
    assert cost.bound == "compute"
    dense = 8_030_261_248 - 2 * 128256 * 4096
    attn = 4 * 32 * 32 * 128 * (n * (n + 1) // 2)
    lm_head = 2 * 4096 * 128256
    assert cost.flops == pytest.approx(2 * dense * n + attn + lm_head)
    assert cost.compute_s == pytest.approx(cost.flops / 989.5e12)


def test_batching_decodes_amortises_the_weights():
    one = CM.cost([(1, 500, True)]).seconds
    many = CM.cost([(1, 500, True)] * 64).seconds
    assert many < 2 * one            # 64 decodes cost less than two single ones


def test_cost_model_validates():
    with pytest.raises(ValueError):
        CM.cost([(0, 0, False)])
    with pytest.raises(ValueError):
        RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM", compute_efficiency=0)
    with pytest.raises(KeyError):
        RooflineCostModel.named("nope", "H100-80GB SXM")
    assert CM.cost([]).seconds == 0.0
    assert CM.kv_blocks(16) == int((round(79.11 * 2**30) * 0.9 - 8_030_261_248 * 2)
                                   // (131072 * 16))
    with pytest.raises(ValueError):
        RooflineCostModel.named("Llama-3.1-405B", "H100-80GB SXM").kv_blocks(16)
    chunk = ScheduledChunk("a", (1, 2, 3), 5, (0,), True, True)
    assert CM.step_cost([chunk], [(1, 9)]).flops == CM.cost([(3, 5, True), (1, 9, False)]).flops


def test_step_cost_prices_lookahead_tokens():
    """A decode chunk with k lookahead slots is verified in the same forward: k + 1 query
    tokens, k + 1 LM-head rows and k + 1 KV writes, not the single token it feeds."""
    k, start = 4, 700
    plain = ScheduledChunk("a", (7,), start, (0,), True, False)
    spec = ScheduledChunk("a", (7,), start, (0,), True, False, num_lookahead=k)
    got, base = CM.step_cost([spec]), CM.step_cost([plain])
    assert got == CM.cost([(k + 1, start, k + 1)])
    m = CM.model
    dense = 2.0 * CM.dense_params * k
    lm_head = 2.0 * m.hidden * m.vocab * k
    attn = 4.0 * m.layers * m.heads * m.head_dim * sum(p + 1 for p in range(start + 1,
                                                                             start + k + 1))
    assert got.flops - base.flops == pytest.approx(dense + lm_head + attn)
    assert got.bytes - base.bytes == pytest.approx(2 * k * CM.kv_bytes_per_token)
    batch = [ScheduledChunk(str(i), (7,), start, (0,), True, False, num_lookahead=k)
             for i in range(256)]
    assert CM.step_cost(batch).bound == "compute"       # 1,280 verified tokens
    assert CM.step_cost([plain] * 256).bound == "memory"
    with pytest.raises(ValueError, match="sampled positions"):
        CM.cost([(2, 0, 3)])


def test_speculative_step_cost_is_priced_from_step_cost():
    target = RooflineCostModel.named("Llama-3-70B", "H100-80GB SXM", tp=4)
    draft = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM", tp=4)
    one = speculative_step_cost(target, draft, batch=1, k=4, alpha=0.6, context=1024)
    assert one.expected_tokens == pytest.approx((1 - 0.6 ** 5) / (1 - 0.6))
    chunk = ScheduledChunk("r", (0,), 1024, (), True, False, num_lookahead=4)
    assert one.verify_s == target.step_cost([chunk]).seconds == target.cost(
        [(5, 1024, 5)]).seconds
    assert one.decode_s == target.cost([(1, 1024, True)]).seconds
    assert one.draft_forwards == 5
    vllm_like = speculative_step_cost(target, draft, batch=1, k=4, alpha=0.6, context=1024,
                                      draft_forwards=4)
    assert one.draft_s - vllm_like.draft_s == pytest.approx(
        draft.cost([(1, 1028, False)]).seconds)      # the forward that only writes KV
    assert one.speedup == pytest.approx(one.expected_tokens * one.decode_s
                                        / (one.verify_s + one.draft_s))
    speedups = [speculative_step_cost(target, draft, batch=b, k=4, alpha=0.6,
                                      context=1024).speedup for b in (1, 16, 128, 512)]
    assert speedups == sorted(speedups, reverse=True)   # batching eats the free tokens
    assert speedups[0] > 1 > speedups[-1]
    big = speculative_step_cost(target, draft, batch=512, k=4, alpha=0.6, context=1024)
    assert big.verify_bound == "compute" and one.verify_bound == "memory"
    assert speculative_step_cost(target, draft, batch=2, k=3, alpha=1.0,
                                 context=0).expected_tokens == 4
    for bad in ({"batch": 0}, {"k": 0}, {"alpha": 1.5}, {"context": -1},
                {"draft_forwards": 3}):
        kw = {"batch": 1, "k": 4, "alpha": 0.5, "context": 10} | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            speculative_step_cost(target, draft, **kw)


def test_speculative_memory_is_both_models_weights_and_kv_in_whole_blocks():
    """The scenario's memory identity: weights + batch x (target + draft KV per token) x the
    request's tokens in whole blocks, against tp x CUDA's total x 0.9."""
    target = RooflineCostModel.named("Llama-3-70B", "H100-80GB SXM", tp=4)
    draft = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM", tp=4)
    mem = speculative_memory(target, draft, context=1024, k=4)
    per_token = 2 * 80 * 8 * 128 * 2 + 2 * 32 * 8 * 128 * 2       # 70B and 8B, bf16
    assert mem.per_request == 65 * 16 * per_token                   # 1,029 tokens -> 65 blocks
    assert mem.weights == target.weight_bytes + draft.weight_bytes
    assert mem.capacity == 4 * target.gpu.engine_memory_bytes * 0.9
    b = mem.max_batch
    assert mem.needed(b) <= mem.capacity < mem.needed(b + 1)
    fits = speculative_step_cost(target, draft, batch=b, k=4, alpha=0.6, context=1024)
    over = speculative_step_cost(target, draft, batch=b + 1, k=4, alpha=0.6, context=1024)
    assert fits.fits and not over.fits and over.memory_bytes == mem.needed(b + 1)
    # batch 16 at 32k tokens needs about 398 GB: more than four H100s hold
    long = speculative_step_cost(target, draft, batch=16, k=4, alpha=0.6, context=32768)
    assert not long.fits and long.memory_bytes > 395e9 > long.memory_capacity
    assert speculative_memory(target, draft, context=32768, k=4).max_batch == 9
    other = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM", tp=2)
    with pytest.raises(ValueError, match="share the target's GPUs"):
        speculative_memory(target, other, context=1024, k=4)
    with pytest.raises(ValueError, match="share the target's GPUs"):
        speculative_step_cost(target, other, batch=1, k=4, alpha=0.5, context=10)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        speculative_memory(target, draft, context=10, k=1, gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="block_size"):
        speculative_memory(target, draft, context=10, k=1, block_size=0)


def test_workload_generators():
    rng = random.Random(0)
    times = poisson_arrivals(10.0, 5000, rng)
    assert times == sorted(times)
    assert times[-1] / 5000 == pytest.approx(0.1, rel=0.05)
    assert poisson_arrivals(math.inf, 3, rng) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(0, 1, rng)
    a = make_workload(50, 5.0, uniform(4, 9), lognormal(20, 0.5, 2, 40), seed=3, prefix_groups=2)
    assert a == make_workload(50, 5.0, uniform(4, 9), lognormal(20, 0.5, 2, 40), seed=3,
                              prefix_groups=2)
    assert all(4 <= s.prompt_len <= 9 and 2 <= s.output_len <= 40 for s in a)
    with pytest.raises(ValueError):
        uniform(5, 4)
    with pytest.raises(ValueError):
        fixed(0)
    s1 = RequestSpec("x", 0.0, 10, 3, prefix_group=1)
    s2 = RequestSpec("y", 0.0, 12, 3, prefix_group=1)
    r1, r2 = to_request(s1, shared_prefix=6), to_request(s2, shared_prefix=6)
    assert len(r1.prompt_token_ids) == 10 and len(r2.prompt_token_ids) == 12
    assert r1.prompt_token_ids[:6] == r2.prompt_token_ids[:6]        # the group's prefix
    assert r1.prompt_token_ids[6:10] != r2.prompt_token_ids[6:10]    # private suffixes differ
    lone = to_request(RequestSpec("x", 0.0, 10, 3), shared_prefix=6)  # no group: no sharing
    assert lone.prompt_token_ids[:6] != r1.prompt_token_ids[:6]
    assert r1.max_tokens == 3 and r1.ignore_eos


def ks_statistic_exponential(xs: list[float], rate: float) -> float:
    """Exact one-sample Kolmogorov-Smirnov statistic sup_x |F_n(x) - F(x)| against Exp(rate):
    the supremum is reached at a sample point, just before or at its step of the ECDF."""
    xs = sorted(xs)
    n = len(xs)
    cdf = [1.0 - math.exp(-rate * x) for x in xs]
    return max(max((i + 1) / n - f, f - i / n) for i, f in enumerate(cdf))


def test_poisson_inter_arrival_times_are_exponential():
    """KS test of the gaps against Exp(rate) at alpha = 0.001 (asymptotic critical value
    sqrt(ln(2/alpha)/2)/sqrt(n) = 0.0276 for n = 5000). Power, by simulation over 200 seeds:
    0.985 against Exp(1.1 rate), 0.995 against Exp(0.9 rate), 1.0 against Gamma(2) gaps or
    uniform gaps of the same mean (a "Poisson" process with regular spacing)."""
    rate, n = 10.0, 5000
    times = poisson_arrivals(rate, n, random.Random(0), start=2.0)
    assert times[0] > 2.0
    gaps = [b - a for a, b in zip([2.0, *times[:-1]], times, strict=True)]
    critical = math.sqrt(math.log(2 / 0.001) / 2) / math.sqrt(n)
    assert ks_statistic_exponential(gaps, rate) < critical
    # the statistic itself is right and has teeth
    assert ks_statistic_exponential([math.log(2) / rate], rate) == pytest.approx(0.5)
    rng = random.Random(1)
    assert ks_statistic_exponential([rng.uniform(0, 2 / rate) for _ in range(n)], rate) > critical
    assert ks_statistic_exponential(gaps, 1.1 * rate) > critical


def test_clock_only_moves_forward():
    clock = SimClock()
    clock.advance(1.5)
    with pytest.raises(ValueError):
        clock.advance(-1)
    with pytest.raises(ValueError):
        clock.jump_to(1.0)
    assert clock() == 1.5


def small(cls, n=60, rate=20.0, seqs=8, budget=256, num_blocks=400, seed=1):
    wl = make_workload(n, rate, uniform(8, 64), uniform(4, 48), seed=seed)
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=False)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, prefill_chunk=128)
    if cls is StaticBatchScheduler:
        cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=seqs * 64)
    return simulate(cls(kv, cfg), wl, CM), wl


@pytest.mark.parametrize("cls", [BaselineScheduler, ProductionScheduler, StaticBatchScheduler])
def test_simulation_finishes_every_request_consistently(cls):
    result, wl = small(cls)
    assert len(result.requests) == len(wl)
    for spec, rec in zip(wl, result.requests, strict=True):
        assert rec.status == "finished" and rec.output_tokens == spec.output_len
        assert spec.arrival_time <= rec.first_token <= rec.finish <= result.makespan
    starts = [s.start for s in result.steps]
    assert starts == sorted(starts)
    assert all(s.duration > 0 for s in result.steps if s.chunks)
    assert result.summary()["finished"] == len(wl)


def test_static_batch_admits_only_when_the_batch_is_done():
    result, _ = small(StaticBatchScheduler)
    running: set[str] = set()
    batches = 0
    for step in result.steps:
        if step.admitted:
            assert not running, "a request joined a running static batch"
            running = set(step.admitted)
            batches += 1
        running -= set(step.finished)
    assert batches > 3
    assert any(s.padding_tokens for s in result.steps)


def test_iteration_level_beats_request_level():
    """Orca's finding at small scale: higher throughput under load, lower latency."""
    loaded_static, _ = small(StaticBatchScheduler, rate=200.0)
    loaded_iter, _ = small(BaselineScheduler, rate=200.0)
    assert (loaded_iter.summary()["throughput_tok_s"]
            > 1.2 * loaded_static.summary()["throughput_tok_s"])
    light_static, _ = small(StaticBatchScheduler, rate=5.0)
    light_iter, _ = small(BaselineScheduler, rate=5.0)
    assert (light_iter.summary()["norm_latency_p50_s"]
            < light_static.summary()["norm_latency_p50_s"])


def test_simulate_until_stops_early():
    wl = make_workload(40, 5.0, fixed(16), fixed(30), seed=0)
    kv = KVCacheManager(100, 16)
    result = simulate(BaselineScheduler(kv, SchedulerConfig()), wl, CM, until=1.0)
    assert 1.0 <= result.makespan < 1.2
    assert any(r.status != "finished" for r in result.requests)


@pytest.mark.parametrize("lo, hi", [(3, 32000), (0, 1), (0, 2), (0, 3), (5, 6), (-10, 10),
                                    (0, 65536), (0, 65537), (0, 2**31 + 1), (0, 2**32),
                                    (1, 2**32 + 5)])
def test_randrange_list_draws_what_randrange_draws(lo: int, hi: int) -> None:
    import random

    from kvlab.sim.workload import _randrange_list

    for n in (0, 1, 7, 3000):
        for seed in ("tokens:r1", 3):
            a, b = random.Random(seed), random.Random(seed)
            want = [a.randrange(lo, hi) for _ in range(n)]
            got = _randrange_list(b, lo, hi, n)
            assert got == want and all(type(x) is int for x in got)


def test_randrange_list_refuses_an_empty_range() -> None:
    import random

    from kvlab.sim.workload import _randrange_list

    with pytest.raises(ValueError, match="empty range"):
        _randrange_list(random.Random(0), 5, 5, 3)
