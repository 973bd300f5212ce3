"""Inter-token latencies from simulated step records: hand-built and on a real simulation."""

from __future__ import annotations

import pytest

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.sim.costmodel import RooflineCostModel
from kvlab.sim.executor import RequestRecord, SimResult, StepRecord, simulate
from kvlab.sim.itl import inter_token_latencies, percentile, token_times
from kvlab.sim.workload import make_workload, uniform


def test_token_times_by_hand():
    a = RequestRecord("a", 0.0, 4, 3, first_token=0.5)
    b = RequestRecord("b", 0.0, 5, 2, first_token=0.75)
    steps = [StepRecord(1, 0.0, 0.5, (("a", 4, True), ("b", 3, True)), (), (), ()),
             StepRecord(2, 0.5, 0.25, (("a", 1, False), ("b", 2, True)), (), (), ()),
             StepRecord(3, 0.75, 0.25, (("a", 1, False), ("b", 1, False)), (), (), ())]
    result = SimResult(requests=[a, b], steps=steps, makespan=1.0, num_steps=3)
    assert token_times(result) == {"a": [0.5, 0.75, 1.0], "b": [0.75, 1.0]}
    assert inter_token_latencies(result) == [0.25, 0.25, 0.25]
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="record_steps"):
        token_times(SimResult(requests=[], steps=[], makespan=1.0, num_steps=3))


def test_chunk_size_bounds_inter_token_latency():
    """Sarathi-Serve's point on the simulator: a smaller token budget per step caps the step
    time a decoding request waits behind a prefill."""
    cm = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM")
    workload = make_workload(40, 12, uniform(1024, 4096), uniform(16, 64), seed=1)
    worst = {}
    for chunk in (256, 4096):
        cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=chunk, prefill_chunk=chunk)
        result = simulate(BaselineScheduler(KVCacheManager(20000, 16), cfg), workload, cm)
        gaps = inter_token_latencies(result)
        assert len(gaps) == sum(r.output_tokens - 1 for r in result.requests)
        worst[chunk] = gaps[-1]
        # no gap can be shorter than the cheapest step, nor longer than the costliest
        durations = [s.duration for s in result.steps]
        assert min(durations) <= gaps[0] and gaps[-1] <= sum(sorted(durations)[-2:])
    assert worst[256] < worst[4096] / 4
