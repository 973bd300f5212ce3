"""Scheduler overhead per step vs queue sizes: BaselineScheduler beside ProductionScheduler.

For N in 100 .. 10,000 it measures the wall time of one step of the engine core
(:class:`~kvlab.core.engine_core.EngineCore`) with a model-free executor: ``schedule()`` +
``update_from_output()``, the scheduler's whole share of an engine step, KV bookkeeping and
prefix-cache commits included, plus the core's own bookkeeping, in three situations:

* ``running``: N requests decoding (one token each per step);
* ``waiting``: 8 requests decoding and N waiting, no sequence slot free (the batch is full):
  each step only has to notice that nothing can be admitted;
* ``kv-bound``: 8 short requests decoding and N long-prompt requests waiting with free
  sequence slots but too little KV: the baseline (FIFO, admits when the first chunk fits) stops
  at the head of its queue, over-admits and preempts; the production scheduler orders the queue
  (priority, deadline, cache affinity within a window) and tries up to ``admission_scan_limit``
  candidates per step (its KV reservation admits none of them).

It prints microseconds per step and per request, the production/baseline ratio, and for scale
the modelled GPU time of the same step for Llama-3-8B on an H100 (roofline, kvlab.sim), then
writes benchmarks/results/scheduler.json. Runs in well under 2 minutes on 2 cores.
"""

from __future__ import annotations

import platform
import random
import time

from _results import write_results

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.engine_core import EngineCore
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.labs.invariants import check_scheduler
from kvlab.sim.costmodel import RooflineCostModel
from kvlab.sim.executor import CostModelExecutor, sim_token

SIZES = (100, 1000, 10_000)
PROMPT = 15
MAX_TOKENS = 200
BLOCK = 16
CONTEXT_FOR_SCALE = 512
COST = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM")


def make_requests(n: int, seed: int, prompt: int, prefix: str) -> list[RuntimeRequest]:
    rng = random.Random(seed)
    return [RuntimeRequest(f"{prefix}{i}", tuple(rng.randrange(3, 30000) for _ in range(prompt)),
                           max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(n)]


def one_step(core: EngineCore) -> float:
    t0 = time.perf_counter()
    core.step()
    return time.perf_counter() - t0


def setup(cls, scenario: str, n: int):
    running = n if scenario == "running" else 8
    blocks_each = -(-(PROMPT + MAX_TOKENS) // BLOCK)
    if scenario == "running":
        kv = KVCacheManager(running * blocks_each + 16, BLOCK)
        seqs, chunk, waiting_prompt = running, BLOCK, PROMPT
    elif scenario == "waiting":
        kv = KVCacheManager((running + n) * blocks_each + 16, BLOCK)
        seqs, chunk, waiting_prompt = running, BLOCK, PROMPT
    else:
        kv = KVCacheManager(running * blocks_each + 2, BLOCK)
        seqs, chunk, waiting_prompt = running + n, 128, 100
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=max(seqs, running * chunk),
                          prefill_chunk=chunk, max_wait_steps=10_000)
    sched = cls(kv, cfg)
    core = EngineCore(sched, CostModelExecutor(sched.get_request, sim_token))
    for r in make_requests(running, seed=n, prompt=PROMPT, prefix="run"):
        core.add_request(r)
    one_step(core)                 # prefill: every admitted request is decoding afterwards
    while scenario == "running" and sched.waiting:
        one_step(core)             # the production scheduler admits <= admission_scan_limit/step
    assert len(sched.running) == running, "setup did not reach the intended running set"
    if scenario != "running":
        for r in make_requests(n, seed=n + 1, prompt=waiting_prompt, prefix="wait"):
            core.add_request(r)
        one_step(core)
    return core


def measure(cls, scenario: str, n: int) -> float:
    """Median of per-step times (robust to other processes sharing the CPUs)."""
    core = setup(cls, scenario, n)
    steps = max(7, min(40, 40_000 // n))
    times = sorted(one_step(core) for _ in range(steps))
    check_scheduler(core.scheduler)
    return times[len(times) // 2]


def main() -> dict:
    rows = []
    for scenario in ("running", "waiting", "kv-bound"):
        for n in SIZES:
            base = measure(BaselineScheduler, scenario, n)
            prod = measure(ProductionScheduler, scenario, n)
            decodes = n if scenario == "running" else 8
            gpu = COST.cost([(1, CONTEXT_FOR_SCALE, True)] * decodes).seconds
            rows.append({
                "scenario": scenario, "n": n,
                "baseline_us_per_step": base * 1e6, "production_us_per_step": prod * 1e6,
                "baseline_us_per_request": base * 1e6 / n,
                "production_us_per_request": prod * 1e6 / n,
                "production_over_baseline": prod / base,
                "model_step_ms_llama3_8b_h100": gpu * 1e3,
                "production_share_of_step": prod / (prod + gpu),
            })
    print(f"{'scenario':8} {'N':>6} | {'baseline':>10} {'production':>10} {'ratio':>6} | "
          f"{'base/req':>9} {'prod/req':>9} | {'model step':>10} {'prod share':>10}")
    print(f"{'':8} {'':>6} | {'µs/step':>10} {'µs/step':>10} {'':>6} | {'µs':>9} {'µs':>9} | "
          f"{'ms (roof)':>10} {'':>10}")
    for r in rows:
        print(f"{r['scenario']:8} {r['n']:>6} | {r['baseline_us_per_step']:>10.0f} "
              f"{r['production_us_per_step']:>10.0f} {r['production_over_baseline']:>6.2f} | "
              f"{r['baseline_us_per_request']:>9.2f} {r['production_us_per_request']:>9.2f} | "
              f"{r['model_step_ms_llama3_8b_h100']:>10.2f} {r['production_share_of_step']:>10.1%}")
    print(f"model step: Llama-3-8B bf16 on H100-80GB SXM, one decode token per running request "
          f"at context {CONTEXT_FOR_SCALE}, roofline + 0.5 ms overhead (kvlab.sim.costmodel)")
    result = {"python": platform.python_version(), "machine": platform.machine(), "rows": rows}
    write_results("scheduler", result)
    return result


if __name__ == "__main__":
    main()
