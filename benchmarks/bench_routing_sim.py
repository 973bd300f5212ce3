"""Routing at scale in the cluster simulator, checked against the live run first.

1. Validation: the live run's own requests (``benchmarks/results/routing.json``, two kvlab
   replicas behind vllm-router) replayed through the simulator's round_robin, approx_tree and
   precise_index policies: hit rate and requests per replica beside the live ones.
2. Scale: 8 to 64 replicas of Llama-3-8B on an H100 (the roofline cost model), the load per
   replica held fixed (40 requests, 8 tenants and 40 requests/s per replica; 1,024-token prompts
   of which 896 are the tenant's system prompt; 64 output tokens; tenants' popularity Zipf 1.2;
   600 KV blocks of 16 tokens per replica, so a replica holds ten tenants' prompts), every policy
   of :mod:`kvlab.sim.routers`: hit rate, TTFT p50/p99, goodput under TTFT <= 200 ms, hot spot.
3. The load term: Dynamo's cost with its overlap weight swept at 32 replicas.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_routing_sim.py

Writes ``benchmarks/results/routing_sim.json`` (about 10 minutes on one core).
"""

from __future__ import annotations

import sys
import time

from _results import write_results

from kvlab.labs.routing import load_live, run_policy, scale_study, tenant_workload, validate
from kvlab.sim.costmodel import RooflineCostModel
from kvlab.sim.routers import POLICIES

SCALE = {"replica_counts": [8, 16, 32, 64], "requests_per_replica": 40,
         "tenants_per_replica": 8, "rate_per_replica": 40.0, "prompt_len": 1024,
         "shared_prefix": 896, "output_len": 64, "num_blocks": 600, "block_size": 16,
         "zipf": 1.2, "ttft_slo_s": 0.2, "seed": 0}
MODEL, GPU = "Llama-3-8B", "H100-80GB SXM"
WEIGHTS = [0.0, 0.5, 1.0, 2.0, 4.0, 8.0]
SWEEP_REPLICAS = 32


def main() -> int:
    t0 = time.monotonic()
    live = load_live()
    result = {"validation": {rate: validate(live, "kvlab", rate)
                             for rate in live["engines"]["kvlab"]},
              "scale": {**SCALE, "model": MODEL, "gpu": GPU}, "rows": [], "weight_sweep": []}
    for rate, rows in result["validation"].items():
        for row in rows:
            print(f"validation {rate}/s {row['live_policy']:12s} live {row['live_hit_rate']:.3f}"
                  f" {row['live_requests']} sim {row['sim_hit_rate']:.3f} {row['sim_requests']}",
                  flush=True)
    cost = RooflineCostModel.named(MODEL, GPU)
    args = {k: v for k, v in SCALE.items() if k != "replica_counts"}
    for n in SCALE["replica_counts"]:
        rows = scale_study([n], POLICIES, cost=cost, **args)
        for row in rows:
            print(f"N={n:2d} {row['policy']:14s} hit {row['hit_rate']:.3f} hot "
                  f"{row['hot_spot']:.2f} TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms p99 "
                  f"{row['ttft_p99_s'] * 1e3:.0f} ms goodput {row['goodput_rps']:.0f}/s "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
        result["rows"] += rows
    n = SWEEP_REPLICAS
    specs = tenant_workload(SCALE["requests_per_replica"] * n, SCALE["tenants_per_replica"] * n,
                            SCALE["rate_per_replica"] * n, SCALE["prompt_len"],
                            SCALE["output_len"], zipf=SCALE["zipf"], seed=SCALE["seed"])
    for weight in WEIGHTS:
        row = run_policy(specs, "dynamo_cost", replicas=n, num_blocks=SCALE["num_blocks"],
                         block_size=SCALE["block_size"], shared_prefix=SCALE["shared_prefix"],
                         cost=cost, ttft_slo_s=SCALE["ttft_slo_s"], overlap_weight=weight)
        row["overlap_weight"] = weight
        result["weight_sweep"].append(row)
        print(f"weight {weight:3g}: hit {row['hit_rate']:.3f} hot {row['hot_spot']:.2f} TTFT "
              f"p99 {row['ttft_p99_s'] * 1e3:.0f} ms", flush=True)
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_results("routing_sim", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
