"""kvlab replicas behind vLLM's router (kvlab/entrypoints/cluster.py): vllm-router's kv_aware
reads kvlab's KV events and sends each request to the replica that holds its prefix; the
multi-tenant workload of ``kvlab bench --dataset-name prefix_repetition``.

The router test needs the ``vllm-router`` wheel (dev extra; manylinux x86_64) and is skipped
with the reason where it is missing.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvlab.entrypoints.cluster import Cluster, kvlab_replica, main, router_binary
from kvlab.entrypoints.load_client import WORDS, prefix_repetition
from kvlab.entrypoints.prometheus import parse_metrics


def _served(url: str) -> float:
    return sum(v for (name, _), v in parse_metrics(httpx.get(url + "/metrics").text).items()
               if name == "vllm:request_success_total")


@pytest.mark.skipif(router_binary() is None, reason="vllm-router is not installed (pip install "
                    "vllm-router; in the dev extra, a manylinux x86_64 wheel)")
def test_kv_aware_router_sends_each_prefix_to_the_replica_whose_events_hold_it(tmp_path):
    prefixes = [" ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(150)) for i in (1, 2)]
    with Cluster(kvlab_replica("kvlab-tiny", ["--max-model-len", "512", "--threads", "1"]), 2,
                 log_dir=tmp_path) as cluster:
        members = cluster.start_replicas()
        url = cluster.start_router("kv_aware", block_size=16, model="kvlab-tiny")
        time.sleep(2.0)   # the router's subscribers connect before anything is published
        # prefix 0 warmed on replica 1, prefix 1 on replica 0: no fixed tie-break matches both
        for prefix, member in zip(prefixes, reversed(members), strict=True):
            body = {"model": "kvlab-tiny", "prompt": prefix + " the end", "max_tokens": 2}
            httpx.post(member.url + "/v1/completions", json=body, timeout=120).raise_for_status()
        time.sleep(1.0)
        before = [_served(m.url) for m in members]
        for i in range(3):
            for prefix in prefixes:
                body = {"model": "kvlab-tiny", "prompt": f"{prefix} question {i}",
                        "max_tokens": 2}
                resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
                assert resp.status_code == 200, resp.text
        after = [_served(m.url) for m in members]
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3]


def test_prefix_repetition_is_vllms_shape():
    rows = prefix_repetition(72, 256, 24, 24, 16, seed=0)
    assert len(rows) == 72
    by_tenant: dict[int, list[str]] = {}
    for row in rows:
        assert row["output_len"] == 16
        by_tenant.setdefault(row["tenant"], []).append(row["prompt"])
    assert sorted(by_tenant) == list(range(24))
    for prompts in by_tenant.values():
        assert len(prompts) == 3
        heads = {" ".join(p.split()[:256]) for p in prompts}
        assert len(heads) == 1 and all(len(p.split()) == 280 for p in prompts)
    assert len({" ".join(p.split()[:256]) for p in (r["prompt"] for r in rows)}) == 24
    assert [r["tenant"] for r in rows] != sorted(r["tenant"] for r in rows)   # shuffled
    assert rows == prefix_repetition(72, 256, 24, 24, 16, seed=0)
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_repetition(10, 8, 8, 24, 4)


def test_cluster_refuses_bad_arguments(capsys):
    with pytest.raises(ValueError, match="replicas"):
        Cluster(kvlab_replica("kvlab-tiny"), 0)
    with pytest.raises(ValueError, match="policy"):
        Cluster(kvlab_replica("kvlab-tiny"), 1).start_router("sticky")
    with pytest.raises(SystemExit):
        main(["--replicas", "0"])
    assert "--replicas must be >= 1" in capsys.readouterr().err
