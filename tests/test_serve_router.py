"""kvlab behind vLLM's router: two ``kvlab serve`` replicas behind ``vllm-router --policy
cache_aware`` answer completions, streamed completions and chat.

vllm-router (PyPI ``vllm-router``, a Rust load balancer in a wheel, in the ``dev`` extra) adds
fields of its own to what it forwards (``no_stop_trim``, ``return_hidden_states``,
``separate_reasoning``, ...), probes ``/v1/completions/render`` (vLLM answers 403 unless
started with ``--enable-scale-out``, kvlab 404) and falls back to ``/tokenize`` for the token ids
its cache-aware policy routes by. Every answer through the router must equal the replica's own
answer, and every request must reach exactly one replica.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_serve import free_port, wait_healthy

from kvlab.entrypoints.cluster import router_binary
from kvlab.entrypoints.prometheus import parse_metrics

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvlab-tiny"


@pytest.fixture(scope="module")
def cluster():
    router = router_binary()
    if router is None:
        pytest.skip("the vllm-router binary is not installed (pip install vllm-router; it is "
                    "in the dev extra, a manylinux x86_64 wheel)")
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        workers = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvlab", "serve", "--port", str(port),
                 "--max-model-len", "512"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
            workers.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(workers, procs, strict=True):
            wait_healthy(url, proc)
        port = free_port()
        procs.append(subprocess.Popen(
            [router, "--worker-urls", *workers, "--policy", "cache_aware", "--port", str(port),
             "--host", "127.0.0.1", "--log-level", "warning"], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        front = f"http://127.0.0.1:{port}"
        wait_healthy(front, procs[-1], "/v1/models")
        yield front, workers
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _finished(workers: list[str]) -> float:
    total = 0.0
    for url in workers:
        for (name, _), value in parse_metrics(httpx.get(url + "/metrics").text).items():
            if name == "vllm:request_success_total":
                total += value
    return total


def test_completions_streams_and_chat_through_the_router(cluster):
    front, workers = cluster
    before = _finished(workers)
    sent = 0
    prompts = ["The lamplighter of Vale", "Once upon a time the shepherd",
               "The lamplighter of Vale lit"]
    for prompt in prompts:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        routed = httpx.post(front + "/v1/completions", json=body, timeout=300)
        assert routed.status_code == 200, routed.text
        direct = httpx.post(workers[0] + "/v1/completions", json=body, timeout=300).json()
        text = routed.json()["choices"][0]["text"]
        assert text == direct["choices"][0]["text"] and text
        with httpx.stream("POST", front + "/v1/completions", json={**body, "stream": True},
                          timeout=300) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        assert "".join(json.loads(line[5:])["choices"][0]["text"] for line in lines[:-1]) \
            == text
        sent += 3
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Who lit the lamps of Vale?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
    routed = httpx.post(front + "/v1/chat/completions", json=body, timeout=300)
    assert routed.status_code == 200, routed.text
    direct = httpx.post(workers[1] + "/v1/chat/completions", json=body, timeout=300).json()
    assert routed.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    with httpx.stream("POST", front + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as resp:
        chunks = [json.loads(line[5:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        direct["choices"][0]["message"]["content"]
    sent += 3
    # each request ran on exactly one replica (the router answered none itself)
    assert _finished(workers) - before == sent
