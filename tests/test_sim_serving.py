"""Simulator at scale: tensor parallelism in the roofline, colocated vs disaggregated serving,
the null event log (identical decisions), SLO capacity search."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import ScheduledChunk
from kvlab.labs.recovery.event_log import EventLog
from kvlab.labs.serving import (
    InstalledPrefillCost,
    chunk_sweep,
    rate_at_attainment,
    records_from_sim,
    run_colocated,
    run_disaggregated,
)
from kvlab.labs.slo import SLO, evaluate_slo
from kvlab.sim import RooflineCostModel, fixed, make_workload, simulate, uniform
from kvlab.sim.workload import RequestSpec

CM = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM")
CFG = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, prefill_chunk=512)


def test_tp_scales_both_roofs_and_adds_allreduce() -> None:
    m70 = RooflineCostModel.named("Llama-3-70B", "H100-80GB SXM")
    tp8 = dataclasses.replace(m70, tp=8)
    work = [(1, 1000, True)] * 32 + [(512, 0, True)]
    one, eight = m70.cost(work), tp8.cost(work)
    assert eight.flops == one.flops and eight.bytes == one.bytes
    assert eight.compute_s == pytest.approx(one.compute_s / 8)
    assert eight.memory_s == pytest.approx(one.memory_s / 8)
    tokens = 32 + 512
    per_ar = tokens * 8192 * 2 * 2 * 7 / 8 / 450e9 + 8e-6
    assert eight.comm_s == pytest.approx(2 * 80 * per_ar)
    assert one.comm_s == 0
    assert eight.seconds == pytest.approx(max(eight.compute_s, eight.memory_s) + eight.comm_s
                                          + 0.5e-3)
    # eight GPUs of memory hold the 141 GB of weights; one does not
    # CUDA's total on an H100 (79.11 GiB), as vLLM sizes its cache, not the label's 80e9 B
    assert tp8.kv_blocks(16) == int((8 * round(79.11 * 2**30) * 0.9 - m70.weight_bytes)
                                    // (m70.kv_bytes_per_token * 16))
    with pytest.raises(ValueError, match="do not fit"):
        m70.kv_blocks(16)
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="tp"):
            dataclasses.replace(m70, tp=bad)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cls", [BaselineScheduler, ProductionScheduler])
def test_the_event_log_never_changes_a_decision(seed: int, cls) -> None:
    """The write-ahead log is opt-in: a scheduler decides exactly the same with or without."""
    rng = random.Random(seed)
    wl = make_workload(60, rng.uniform(5, 200), uniform(8, 300), uniform(1, 80), seed=seed)
    runs = []
    for log in (None, EventLog()):
        sched = cls(KVCacheManager(120, 16), CFG, log=log)
        res = simulate(sched, wl, CM)
        runs.append(([(r.request_id, r.first_token, r.finish, r.status, r.num_preemptions)
                      for r in res.requests],
                     [(s.chunks, s.preempted, s.duration) for s in res.steps]))
    assert runs[0] == runs[1]


def test_records_from_sim_maps_statuses() -> None:
    wl = make_workload(40, 1000.0, fixed(64), uniform(1, 60), seed=1)
    sched = BaselineScheduler(KVCacheManager(400, 16), CFG)
    recs = records_from_sim(simulate(sched, wl, CM, until=0.2))
    assert {r.status for r in recs} == {"finished", "timeout"}
    big = [RequestSpec("huge", 0.0, 5000, 10)]
    rej = records_from_sim(simulate(BaselineScheduler(KVCacheManager(8, 16), CFG), big, CM))
    assert rej[0].status == "rejected"


def test_colocated_single_replica_is_plain_simulate() -> None:
    wl = make_workload(50, 30.0, uniform(16, 400), uniform(2, 60), seed=3)
    recs = run_colocated(wl, CM, CFG)
    direct = records_from_sim(simulate(BaselineScheduler(
        KVCacheManager(CM.kv_blocks(16), 16, enable_prefix_caching=False), CFG), wl, CM))
    assert recs == direct
    two = run_colocated(wl, CM, CFG, replicas=2)
    assert sorted(r.request_id for r in two) == sorted(r.request_id for r in wl)


def test_installed_prefill_costs_one_token() -> None:
    cost = InstalledPrefillCost(CM)
    last = ScheduledChunk("a", (5,) * 300, 0, (), sample=True, is_prefill=True)
    mid = ScheduledChunk("b", (5,) * 300, 0, (), sample=False, is_prefill=True)
    dec = ScheduledChunk("c", (5,), 500, (), sample=True, is_prefill=False)
    assert cost.step_cost([last, dec]).seconds == CM.cost([(1, 299, True), (1, 500, True)]).seconds
    assert cost.step_cost([mid]).seconds == 0.0


def test_disaggregated_single_request_pays_exactly_the_transfer() -> None:
    spec = [RequestSpec("r", 0.0, 1000, 20)]
    fast = run_disaggregated(spec, CM, CM, CFG, CFG, transfer_bandwidth=1e18,
                             transfer_latency_s=0.0)[0]
    slow = run_disaggregated(spec, CM, CM, CFG, CFG, transfer_bandwidth=1e9,
                             transfer_latency_s=0.0)[0]
    assert fast.ttft == slow.ttft
    transfer = 1000 * CM.kv_bytes_per_token / 1e9
    assert slow.e2e - fast.e2e == pytest.approx(transfer, rel=1e-6)  # float sums
    assert slow.output_tokens == 20
    assert slow.tpot == pytest.approx((slow.e2e - slow.ttft) / 19)
    # prefill chunking on the prefill instance: TTFT equals the colocated TTFT of a lone request
    colo = run_colocated(spec, CM, CFG)[0]
    assert fast.ttft == pytest.approx(colo.ttft)
    one = run_disaggregated([RequestSpec("s", 0.0, 100, 1)], CM, CM, CFG, CFG)[0]
    assert one.e2e == one.ttft and one.output_tokens == 1


def test_disaggregation_removes_prefill_interference_from_tpot() -> None:
    """Long prompts arriving while others decode: colocated decodes stall behind prefill
    chunks, a dedicated decode pool's do not (DistServe's observation)."""
    wl = make_workload(80, 8.0, fixed(2000), fixed(100), seed=2)
    big = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, prefill_chunk=2048)
    colo = evaluate_slo(run_colocated(wl, CM, big), SLO())
    dis = evaluate_slo(run_disaggregated(wl, CM, CM, big, big), SLO())
    assert colo.finished == dis.finished == 80
    assert dis.latency["tpot"]["p99"] < colo.latency["tpot"]["p99"]


def test_rate_at_attainment() -> None:
    assert rate_at_attainment([1, 2, 3], [1.0, 0.95, 0.85]) == pytest.approx(2.5)
    assert rate_at_attainment([1, 2], [0.5, 0.1]) == 0.0
    assert rate_at_attainment([1, 2, 4], [1.0, 0.99, 0.95]) == 4
    assert rate_at_attainment([1, 2, 3], [0.95, 0.95, 0.5]) == pytest.approx(2 + 0.05 / 0.45)
    with pytest.raises(ValueError):
        rate_at_attainment([2, 1], [1, 1])
    with pytest.raises(ValueError):
        rate_at_attainment([], [])


def test_chunk_sweep_trades_tpot_for_throughput() -> None:
    wl = make_workload(120, 40.0, uniform(500, 1500), uniform(20, 80), seed=4)
    rows = chunk_sweep(wl, CM, [128, 2048])
    small, large = rows
    assert small["finished"] == large["finished"] == 120
    assert small["tpot_p99_s"] < large["tpot_p99_s"]
    assert small["throughput_tok_s"] < large["throughput_tok_s"]
    assert all(not math.isnan(r["ttft_p99_s"]) for r in rows)


def test_memoised_runs_equal_fresh_ones_and_return_copies() -> None:
    from kvlab.labs import serving

    wl = make_workload(40, 30.0, uniform(16, 400), uniform(2, 40), seed=5)
    serving._colocated_instance.cache_clear()
    first = run_colocated(wl, CM, CFG, replicas=2)
    assert serving._colocated_instance.cache_info().misses == 2
    first.append("not a record")                       # the caller's list is its own
    again = run_colocated(list(wl), CM, CFG, replicas=2)
    assert serving._colocated_instance.cache_info().hits == 2
    fresh = []
    for part in serving._deal(wl, 2):
        fresh += records_from_sim(simulate(BaselineScheduler(
            KVCacheManager(CM.kv_blocks(16), 16, enable_prefix_caching=False), CFG), part, CM,
            record_steps=False))
    assert again == fresh == first[:-1]
    # another input is another simulation, not a stale hit
    other = run_colocated(wl[:-1], CM, CFG, replicas=2)
    assert len(other) == len(wl) - 1
    rows = chunk_sweep(wl, CM, [128, 256])
    rows[0]["chunk"] = -1                              # a returned row is a copy
    assert [r["chunk"] for r in chunk_sweep(wl, CM, [128, 256])] == [128, 256]


def test_unhashable_inputs_bypass_the_memo() -> None:
    from kvlab.labs import serving

    calls = []

    def factory(kv, cfg, _seen=calls):                # a plain function is hashable: memoised
        calls.append(1)
        return BaselineScheduler(kv, cfg)

    wl = make_workload(10, 30.0, uniform(16, 64), uniform(2, 8), seed=6)
    run_colocated(wl, CM, CFG, scheduler=factory)
    run_colocated(wl, CM, CFG, scheduler=factory)
    assert len(calls) == 1

    class Unhashable:
        __hash__ = None

        def __call__(self, kv, cfg):
            calls.append(2)
            return BaselineScheduler(kv, cfg)

    fn = Unhashable()
    assert run_colocated(wl, CM, CFG, scheduler=fn) == run_colocated(wl, CM, CFG, scheduler=fn)
    assert calls.count(2) == 2
    assert serving.MEMO_SIZE >= 64
