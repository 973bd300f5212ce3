"""Routing by prefix (chapter 13): the live run's stored figures, the cluster simulator checked
against them, and the simulator at scale.

- :func:`live_rows` reads ``benchmarks/results/routing.json`` (``benchmarks/bench_routing.py``:
  two kvlab and two vLLM replicas behind vllm-router) into one row per engine, rate and policy.
- :func:`replay_live` turns a live run's requests (tenant, arrival, prompt tokens) into the
  simulator's workload, and :func:`validate` runs the simulator's policies on it beside the
  live figures (``round_robin`` -> :class:`~kvlab.sim.routers.RoundRobin`, ``cache_aware`` ->
  :class:`~kvlab.sim.routers.ApproxTree`, ``kv_aware`` ->
  :class:`~kvlab.sim.routers.PreciseIndex`).
- :func:`tenant_workload` (tenants with Zipf popularity) and :func:`run_policy` /
  :func:`scale_study` measure hit rate, TTFT percentiles, goodput and hot spots on 8 to 64
  replicas.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvlab.sim.cluster import ClusterResult, LinearStepCost, simulate_cluster
from kvlab.sim.costmodel import RooflineCostModel
from kvlab.sim.routers import make_policy
from kvlab.sim.workload import RequestSpec

__all__ = ["LIVE_TO_SIM", "ROUTING_JSON", "live_rows", "load_live", "percentile", "replay_live",
           "run_policy", "scale_study", "summarize", "tenant_workload", "validate"]

ROUTING_JSON = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "routing.json"

#: the simulator's policy for each vllm-router policy of the live run
LIVE_TO_SIM = {"round_robin": "round_robin", "cache_aware": "approx_tree",
               "kv_aware": "precise_index"}


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100], numpy's default); NaN if empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def load_live(path: str | Path = ROUTING_JSON) -> dict:
    return json.loads(Path(path).read_text())


def live_rows(live: dict) -> list[dict]:
    """One row per engine, rate and policy of a stored live run."""
    rows = []
    for engine, rates in live["engines"].items():
        for rate, runs in rates.items():
            for policy, r in runs.items():
                rows.append({"engine": engine, "rate": float(rate), "policy": policy,
                             "hit_rate": r["hit_rate"],
                             "requests": r["requests_per_replica"],
                             "replica_hit_rates": [x["hit_rate"] for x in r["replicas"]],
                             "ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"],
                             "goodput_rps": r["goodput_rps"], "failed": r["failed"]})
    return rows


def replay_live(run: dict, shared_prefix: int, output_len: int) -> list[RequestSpec]:
    """The live run's requests as simulator specs: same tenants, arrivals and prompt lengths;
    a tenant's requests share their first ``shared_prefix`` tokens."""
    return [RequestSpec(f"r{i}", r["arrival"], r["prompt_tokens"], output_len,
                        prefix_group=r["tenant"])
            for i, r in enumerate(run["requests"])]


def summarize(result: ClusterResult, ttft_slo_s: float | None = None) -> dict:
    """Hit rate, TTFT p50/p99 (seconds), hot spot (busiest replica over the mean), requests per
    replica and, with ``ttft_slo_s``, attainment and goodput (requests within it per second of
    the arrival window)."""
    ttfts = result.ttfts()
    row = {"policy": result.policy, "hit_rate": result.hit_rate,
           "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
           "hot_spot": result.hot_spot(), "requests": result.requests_per_replica()}
    if ttft_slo_s is not None:
        arrivals = [r.arrival for r in result.records]
        window = max(arrivals) - min(arrivals) or math.nan
        good = sum(1 for t in ttfts if t <= ttft_slo_s)
        row["attainment"] = good / len(result.records)
        row["goodput_rps"] = good / window
    return row


def validate(live: dict, engine: str = "kvlab", rate: str = "8", *,
             cost: LinearStepCost | None = None) -> list[dict]:
    """The simulator's policies on the live run's own requests (``engine`` at ``rate``), beside
    what the live run measured: ``{"live_policy", "sim_policy", "live_hit_rate",
    "sim_hit_rate", "live_requests", "sim_requests"}`` rows."""
    runs = live["engines"][engine][rate]
    work = live["workload"]
    shared = round(work["prefix_tokens_mean"])
    rows = []
    for live_policy, sim_policy in LIVE_TO_SIM.items():
        run = runs[live_policy]
        specs = replay_live(run, shared, work["output_len"])
        result = simulate_cluster(specs, make_policy(sim_policy), replicas=live["replicas"],
                                  num_blocks=live["num_blocks_per_replica"],
                                  block_size=live["block_size"], cost=cost,
                                  shared_prefix=shared)
        rows.append({"live_policy": live_policy, "sim_policy": sim_policy,
                     "live_hit_rate": run["hit_rate"], "sim_hit_rate": result.hit_rate,
                     "live_requests": run["requests_per_replica"],
                     "sim_requests": result.requests_per_replica()})
    return rows


def tenant_workload(n: int, tenants: int, rate: float, prompt_len: int, output_len: int, *,
                    zipf: float = 0.0, seed: int = 0) -> list[RequestSpec]:
    """``n`` Poisson arrivals at ``rate``/s, each from one of ``tenants`` tenants drawn with
    Zipf weights ``1 / k**zipf`` (0: uniform; about 1: a few tenants dominate)."""
    if n < 1 or tenants < 1 or not rate > 0:
        raise ValueError(f"need n >= 1, tenants >= 1 and rate > 0, got {n}, {tenants}, {rate}")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(tenants)]
    t, specs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tenant = rng.choices(range(tenants), weights)[0]
        specs.append(RequestSpec(f"r{i}", t, prompt_len, output_len, prefix_group=tenant))
    return specs


def run_policy(specs: Sequence[RequestSpec], policy: str, *, replicas: int, num_blocks: int,
               block_size: int, shared_prefix: int,
               cost: RooflineCostModel | LinearStepCost | None = None,
               ttft_slo_s: float | None = None, **policy_args) -> dict:
    """One simulated cluster run, summarized (:func:`summarize`) with the replica count."""
    result = simulate_cluster(specs, make_policy(policy, **policy_args), replicas=replicas,
                              num_blocks=num_blocks, block_size=block_size, cost=cost,
                              shared_prefix=shared_prefix)
    return {"replicas": replicas, **summarize(result, ttft_slo_s)}


def scale_study(replica_counts: Sequence[int], policies: Sequence[str], *,
                requests_per_replica: int, tenants_per_replica: int, rate_per_replica: float,
                prompt_len: int, shared_prefix: int, output_len: int, num_blocks: int,
                block_size: int, zipf: float, cost: RooflineCostModel | LinearStepCost,
                ttft_slo_s: float, seed: int = 0) -> list[dict]:
    """Every policy at every replica count, the load per replica held fixed (requests, tenants
    and rate all scale with the count)."""
    rows = []
    for n in replica_counts:
        specs = tenant_workload(requests_per_replica * n, tenants_per_replica * n,
                                rate_per_replica * n, prompt_len, output_len, zipf=zipf,
                                seed=seed)
        for policy in policies:
            rows.append(run_policy(specs, policy, replicas=n, num_blocks=num_blocks,
                                   block_size=block_size, shared_prefix=shared_prefix,
                                   cost=cost, ttft_slo_s=ttft_slo_s))
    return rows
