"""The OpenAI-compatible server and the load client, end to end on 127.0.0.1.

The client's counts and latencies are checked against the server's own /metrics; an abort
mid-stream, a timeout and admission rejects are checked to free the KV and to be counted by
kind on both sides; malformed requests get OpenAI's error object and the server keeps serving.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.entrypoints import bench
from kvlab.entrypoints.async_engine import AsyncEngine
from kvlab.entrypoints.cluster import free_port, wait_ready
from kvlab.entrypoints.load_client import LoadConfig, PlannedRequest, plan_requests, run_load
from kvlab.entrypoints.prometheus import Histogram, MetricFamily, parse_metrics, render
from kvlab.entrypoints.serve import build_app
from kvlab.entrypoints.uvicorn_server import ServerThread
from kvlab.labs.invariants import check_engine
from kvlab.labs.slo import SLO, evaluate_slo
from kvlab.sim.workload import fixed, uniform

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvlab-tiny"


def metric(text: str, name: str, **labels: str) -> float:
    want = tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items()))
    return parse_metrics(text)[(name, want)]


def wait_until(cond, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=256, max_num_seqs=16))
    aeng = AsyncEngine(engine, model_name=MODEL)
    with ServerThread(build_app(aeng, MODEL)) as srv:
        srv.engine = engine
        yield srv


def idle(engine: LLMEngine) -> bool:
    with engine.core.lock:
        return (not engine.has_unfinished_requests() and not engine.kv.requests()
                and engine.kv.num_allocatable_blocks() == engine.num_blocks)


# ---------------------------------------------------------------- end to end, CLI subprocess

def wait_healthy(url: str, proc: subprocess.Popen, path: str = "/health",
                 seconds: float = 900) -> None:
    """Return once ``url + path`` answers 200 (kvlab.entrypoints.cluster.wait_ready); fail with
    the process's output if it exits first, or after ``seconds`` (generous: a first CPU-kernel
    build on a loaded machine)."""
    try:
        wait_ready(url, proc, path=path, timeout=seconds)
    except RuntimeError as err:
        raise AssertionError(f"{err}:\n{proc.stdout.read()[-3000:]}") from None


def test_bench_cli_against_serve_cli_agrees_with_server_metrics(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "kvlab", "serve", "--port", str(port),
                             "--max-model-len", "256"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        before = httpx.get(url + "/metrics").text
        out = tmp_path / "bench.json"
        rc = bench.main(["--base-url", url, "--model", MODEL, "--num-prompts", "16",
                         "--request-rate", "20", "--input-len", "uniform:8,40",
                         "--output-len", "fixed:12", "--slo-ttft-ms", "5000",
                         "--scrape-metrics", "--result-json", str(out), "--no-progress"])
        assert rc == 0
        after = httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    res = json.loads(out.read_text())
    reqs = res["requests"]
    assert len(reqs) == 16 and all(r["status"] == "finished" for r in reqs)
    assert all(r["output_tokens"] == 12 for r in reqs)          # ignore_eos + max_tokens
    rep = res["report"]
    assert rep["finished"] == 16 and rep["failures"] == {k: 0 for k in rep["failures"]}

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 16
    assert delta("vllm:generation_tokens_total") == 16 * 12
    assert delta("vllm:prompt_tokens_total") == sum(r["prompt_tokens"] for r in reqs)
    assert delta("vllm:time_to_first_token_seconds_count") == 16
    assert delta("vllm:e2e_request_latency_seconds_count") == 16
    assert delta("vllm:inter_token_latency_seconds_count") == 16 * 11
    # the client sees the server's latencies plus HTTP/SSE overhead: never less (an ordering,
    # true at any speed; how much more depends on the machine's load, so it is not asserted)
    server_ttft = delta("vllm:time_to_first_token_seconds_sum")
    client_ttft = sum(r["ttft"] for r in reqs)
    server_e2e = delta("vllm:e2e_request_latency_seconds_sum")
    client_e2e = sum(r["e2e"] for r in reqs)
    assert 0 < server_ttft <= client_ttft and 0 < server_e2e <= client_e2e
    assert server_ttft < server_e2e and client_ttft < client_e2e
    assert metric(after, "kvlab:requests_holding_kv") == 0
    assert metric(after, "vllm:num_requests_running") == 0


# ---------------------------------------------------------------- abort, timeout, rejects

def test_disconnect_mid_stream_aborts_and_frees_kv(server) -> None:
    engine = server.engine
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    before = httpx.get(server.url + "/metrics").text
    with httpx.Client(base_url=server.url, timeout=30) as client, \
            client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data:"):
                seen += 1
            if seen == 3:
                with engine.core.lock:
                    assert engine.kv.requests(), "the request should hold KV mid-stream"
                break
    wait_until(lambda: idle(engine))     # aborted, KV released
    check_engine(engine)
    after = httpx.get(server.url + "/metrics").text
    assert metric(after, "vllm:request_success_total", finished_reason="abort") \
        - metric(before, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(after, "vllm:request_success_total", finished_reason="length") \
        == metric(before, "vllm:request_success_total", finished_reason="length")


def test_client_timeouts_and_abandons_are_counted_by_kind_and_free_kv(server,
                                                                      monkeypatch) -> None:
    """Independent of the machine's speed: abandons drop the stream after its first chunk
    (whenever that comes); timeouts meet a server whose steps are held until they expired."""
    abandon = [PlannedRequest(f"a{i}", 0.0, [5 + i] * 10, 200) for i in range(3)]
    recs, _ = run_load(LoadConfig(server.url, MODEL, request_timeout=600,
                                  abandon_fraction=1.0, abandon_after_chunks=1, seed=3), abandon)
    assert [r.status for r in recs] == ["cancelled"] * 3
    executor = server.engine.core.executor
    real, gate = executor.execute, threading.Event()

    def held(output):                  # no step ends before every client gave up
        gate.wait(600)
        return real(output)

    monkeypatch.setattr(executor, "execute", held)
    late = [PlannedRequest(f"t{i}", 0.0, [9 + i] * 10, 200) for i in range(3)]
    try:
        more, _ = run_load(LoadConfig(server.url, MODEL, request_timeout=0.3, seed=3), late)
    finally:
        gate.set()
    assert [r.status for r in more] == ["timeout"] * 3
    recs += more
    assert all(not r.finished for r in recs)
    rep = evaluate_slo(recs, SLO(), window_s=1)
    assert rep.failures["timeout"] == 3 and rep.failures["cancelled"] == 3
    assert rep.latency["e2e"]["mean"] != rep.latency["e2e"]["mean"]   # NaN: no latency folded
    wait_until(lambda: idle(server.engine), timeout=120)
    check_engine(server.engine)


def test_admission_rejects_are_503_and_counted_as_rejects() -> None:
    import dataclasses

    from kvlab.core.production_scheduler import ProductionScheduler

    def one_waiting(kv, cfg):
        return ProductionScheduler(kv, dataclasses.replace(cfg, max_waiting=1))

    engine = LLMEngine(EngineArgs(MODEL, max_model_len=128, max_num_seqs=2,
                                  scheduler=one_waiting))
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        plan = plan_requests(12, float("inf"), fixed(8), fixed(24), seed=1)
        recs, _ = run_load(LoadConfig(srv.url, MODEL), plan)
        text = httpx.get(srv.url + "/metrics").text
        wait_until(lambda: idle(engine))
    rejected = sum(r.status == "rejected" for r in recs)
    finished = sum(r.finished for r in recs)
    assert rejected >= 1 and finished >= 1 and rejected + finished == 12
    assert metric(text, "vllm:request_success_total", finished_reason="rejected") == rejected
    assert metric(text, "kvlab:http_errors_total", code="503") == rejected
    assert all("HTTP 503" in r.error for r in recs if r.status == "rejected")


# ---------------------------------------------------------------- errors keep the server serving

BAD = [
    (b"{not json", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    (json.dumps({"prompt": "hi"}).encode(), 400, "missing_required_parameter", "model"),
    (json.dumps({"model": "gpt-9", "prompt": "hi"}).encode(), 404, "model_not_found", "model"),
    (json.dumps({"model": MODEL, "prompt": "word " * 400}).encode(), 400,
     "context_length_exceeded", "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400,
     "invalid_value", "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "top_p": 2}).encode(), 400, "invalid_value",
     "top_p"),
    (json.dumps({"model": MODEL, "prompt": [5, 99999]}).encode(), 400, "invalid_value",
     "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stop": 5}).encode(), 400,
     "invalid_value", "stop"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stop": ["ok", ""]}).encode(), 400,
     "invalid_value", "stop"),
    # above the context length itself (less is clamped to what fits, as in vLLM)
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 300}).encode(), 400,
     "invalid_value", "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 3}}).encode(), 400,
     "unsupported_parameter", "logit_bias"),
    (json.dumps({"model": MODEL, "prompt": "hi", "best_of": 3}).encode(), 400,
     "unsupported_parameter", "best_of"),
    (json.dumps({"model": MODEL, "prompt": "hi", "guided_regex": "(ab"}).encode(), 400,
     "invalid_value", "guided_regex"),
    (json.dumps({"model": MODEL, "prompt": "hi", "guided_json": {"type": "nonsense"}}).encode(),
     400, "invalid_value", "guided_json"),
    (json.dumps({"model": MODEL, "prompt": "hi", "guided_choice": "yes"}).encode(), 400,
     "invalid_value", "guided_choice"),
    (json.dumps({"model": MODEL, "prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}
                ).encode(), 400, "invalid_value", "guided_choice"),
    (json.dumps({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema"}}
                ).encode(), 400, "invalid_value", "response_format"),
    (json.dumps({"model": MODEL, "prompt": "hi", "structured_outputs": {"yaml": "x"}}).encode(),
     400, "invalid_value", "structured_outputs"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 0}).encode(), 400, "invalid_value", "n"),
    (json.dumps({"model": MODEL, "prompt": []}).encode(), 400, "invalid_value", "prompt"),
    (b'{"model": "kvlab-tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "invalid_json", None),
    (json.dumps({"model": MODEL, "prompt": "word " * 600_000}).encode(), 413,
     "request_too_large", None),
    (json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}).encode(), 400,
     "invalid_type", "stream"),
    (json.dumps({"model": MODEL, "prompt": 7}).encode(), 400, "invalid_value", "prompt"),
    # a lone surrogate is valid JSON text but not UTF-8: quoted back in the message, it must
    # not turn the 4xx into a 500
    (b'{"model": "\\ud800", "prompt": "a"}', 404, "model_not_found", "model"),
    (b'{"model": "kvlab-tiny", "prompt": "a\\ud800b"}', 400, "invalid_value", "prompt"),
    (b'{"model": "kvlab-tiny", "prompt": ["ok", "\\udfff"]}', 400, "invalid_value", "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stream": True,
                 "stream_options": {"include_usage": "no"}}).encode(), 400, "invalid_type",
     "stream_options"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stop_token_ids": [99999]}).encode(), 400,
     "invalid_value", "stop_token_ids"),
    (json.dumps({"model": MODEL, "prompt": "hi", "user": 5}).encode(), 400, "invalid_type",
     "user"),
]


@pytest.mark.parametrize(("body", "status", "code", "param"), BAD)
def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, body, status, code,
                                                                 param) -> None:
    resp = httpx.post(server.url + "/v1/completions", content=body,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param and err["message"]
    ok = httpx.post(server.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "The town", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert idle(server.engine) or wait_until(lambda: idle(server.engine)) is None


def test_an_error_is_counted_once_and_a_body_cut_short_is_no_server_error(server) -> None:
    def errors(code: str) -> float:
        key = ("kvlab:http_errors_total", (("code", code), ("engine", "0"), ("model_name", MODEL)))
        return parse_metrics(httpx.get(server.url + "/metrics").text).get(key, 0.0)

    before = {code: errors(code) for code in ("404", "500")}
    resp = httpx.post(server.url + "/v1/completions", content=b'{"model": "\\ud800"}',
                      headers={"content-type": "application/json"})
    assert resp.status_code == 404 and resp.json()["error"]["message"].count("\ud800") == 1
    for _ in range(3):   # a client that announces 1,000 bytes, sends 22 and hangs up
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: 1000\r\n\r\n"
                         b'{"model": "kvlab-tiny"')
    ok = httpx.post(server.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "The town", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    assert errors("404") - before["404"] == 1 and errors("500") == before["500"]


def test_slow_headers_and_slow_bodies_hit_their_deadlines() -> None:
    """A connection that sends nothing, a header line at a time too slowly (slow-loris), or a
    second keep-alive request that stalls is closed at the header deadline; a body that stalls
    is a 408 at the body deadline; a request whose headers arrive in pieces within the deadline
    is served. No bound on how fast: only that each connection ends and how."""
    aeng = AsyncEngine(LLMEngine(EngineArgs(MODEL, max_model_len=256)), model_name=MODEL)
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
               b"\r\ncontent-length: %d\r\n\r\n")
    body = json.dumps({"model": MODEL, "prompt": "The town", "max_tokens": 2}).encode()

    def read_all(sock: socket.socket) -> bytes:
        sock.settimeout(60)
        parts = []
        while chunk := sock.recv(65536):
            parts.append(chunk)
        return b"".join(parts)     # returns only once the server closes the connection

    with ServerThread(build_app(aeng, MODEL, body_timeout=1.0), header_timeout=1.0) as srv:
        with socket.create_connection((srv.host, srv.port)) as silent:
            assert read_all(silent) == b""
        with socket.create_connection((srv.host, srv.port)) as loris:
            loris.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            for i in range(40):            # one header line every 0.1 s, never the blank line
                try:
                    loris.sendall(b"x-%d: y\r\n" % i)
                except OSError:            # the server closed the connection
                    break
                time.sleep(0.1)
            assert read_all(loris) == b""
        with socket.create_connection((srv.host, srv.port)) as reuse:
            reuse.sendall(request % len(body) + body)
            reuse.settimeout(60)
            first = b""
            while b'"usage"' not in first:
                first += reuse.recv(65536)
            assert first.startswith(b"HTTP/1.1 200")
            reuse.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            assert read_all(reuse) == b""
        with socket.create_connection((srv.host, srv.port)) as stalled:
            stalled.sendall(request % 100 + b'{"model": ')
            answer = read_all(stalled)
            assert answer.startswith(b"HTTP/1.1 408")
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == \
                "request_timeout"
        with socket.create_connection((srv.host, srv.port)) as pieces:
            head = request % len(body)
            pieces.sendall(head[:20])
            time.sleep(0.2)
            pieces.sendall(head[20:] + body)
            pieces.settimeout(60)
            answer = b""
            while b'"usage"' not in answer:
                answer += pieces.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
        errors = parse_metrics(httpx.get(srv.url + "/metrics").text)
        assert errors[("kvlab:http_errors_total",
                       (("code", "408"), ("engine", "0"), ("model_name", MODEL)))] == 1


def test_serve_cli_refuses_deadlines_that_are_not_positive() -> None:
    for flag in ("--header-timeout", "--body-timeout"):
        done = subprocess.run([sys.executable, "-m", "kvlab", "serve", flag, "0"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and f"{flag} must be > 0, got 0.0" in done.stderr


def test_chat_errors_and_routes(server) -> None:
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    named = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x", "name": 5}]})
    err = named.json()["error"]
    assert named.status_code == 400 and err["param"] == "messages" and "name" in err["message"]
    for path, method, status, code in (("/v1/nothing", "GET", 404, "not_found"),
                                       ("/v1/completions", "GET", 405, "method_not_allowed")):
        resp = httpx.request(method, server.url + path)
        assert resp.status_code == status and resp.json()["error"]["code"] == code
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_and_completion_answers_match_the_engine(server) -> None:
    """Greedy text through HTTP (streamed and not) equals the engine's own generation."""
    from kvlab.core.sampling_params import SamplingParams

    prompt = "Trern Thyvet was a generous shepherd who lived in"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    text = plain["choices"][0]["text"]
    streamed = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                streamed.append(json.loads(line[5:])["choices"][0]["text"])
    assert "".join(streamed) == text
    ref = LLMEngine(EngineArgs(MODEL, max_model_len=256))
    ref.add_request("r", prompt, SamplingParams(max_tokens=10, temperature=0))
    while ref.has_unfinished_requests():
        outs = ref.step()
    assert outs[0].outputs[0].text == text
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
        timeout=30).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] <= 4


# ---------------------------------------------------------------- pieces

def test_prometheus_round_trip_and_histogram() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    text = render([MetricFamily("x:lat_seconds", "histogram", "h").add(h, m='a"b'),
                   MetricFamily("x:n_total", "counter", "c").add(7)])
    got = parse_metrics(text)
    assert got[("x:lat_seconds_bucket", (("le", "0.1"), ("m", 'a\\"b')))] == 2   # le inclusive
    assert got[("x:lat_seconds_bucket", (("le", "1"), ("m", 'a\\"b')))] == 3
    assert got[("x:lat_seconds_bucket", (("le", "+Inf"), ("m", 'a\\"b')))] == 4
    assert got[("x:lat_seconds_count", (("m", 'a\\"b'),))] == 4
    assert got[("x:lat_seconds_sum", (("m", 'a\\"b'),))] == pytest.approx(3.65)
    assert got[("x:n_total", ())] == 7
    with pytest.raises(ValueError):
        parse_metrics("not a sample line at all {")
    with pytest.raises(ValueError):
        h.observe(-1)


def test_plan_is_open_loop_and_seeded() -> None:
    import statistics

    a = plan_requests(4000, 10.0, uniform(5, 9), fixed(3), seed=5)
    b = plan_requests(4000, 10.0, uniform(5, 9), fixed(3), seed=5)
    assert a == b
    gaps = [y.arrival - x.arrival for x, y in itertools.pairwise(a)]
    # exponential gaps: mean 1/rate, coefficient of variation 1 (4000 gaps: 5 sigma ~ 8%)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.08)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)
    bursty = plan_requests(4000, 10.0, fixed(5), fixed(3), seed=5, burstiness=0.25)
    g2 = [y.arrival - x.arrival for x, y in itertools.pairwise(bursty)]
    assert statistics.stdev(g2) / statistics.mean(g2) == pytest.approx(2.0, rel=0.15)  # 1/sqrt(k)
    assert all(5 <= len(r.prompt) <= 9 and r.output_len == 3 for r in a)
    with pytest.raises(ValueError):
        plan_requests(0, 1.0, fixed(1), fixed(1))
    with pytest.raises(ValueError):
        bench.length_dist("poisson:3")


def test_non_streaming_client_gone_aborts_and_frees_kv(server, monkeypatch) -> None:
    """Independent of the machine's speed: no step ends before the client gave up (a read
    timeout, which starts once the whole request was sent, so the server has it)."""
    executor = server.engine.core.executor
    real, gate = executor.execute, threading.Event()

    def held(output):
        gate.wait(600)
        return real(output)

    monkeypatch.setattr(executor, "execute", held)
    before = httpx.get(server.url + "/metrics").text
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 240, "ignore_eos": True}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body,
                       timeout=httpx.Timeout(600, read=0.5))
    finally:
        gate.set()
    wait_until(lambda: idle(server.engine))
    check_engine(server.engine)
    after = httpx.get(server.url + "/metrics").text
    assert metric(after, "vllm:request_success_total", finished_reason="abort") \
        - metric(before, "vllm:request_success_total", finished_reason="abort") == 1


def test_engine_step_failure_is_a_500_and_the_server_keeps_serving(server, monkeypatch) -> None:
    executor = server.engine.core.executor
    real = executor.execute
    calls = {"n": 0}

    def flaky(output):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(output)

    monkeypatch.setattr(executor, "execute", flaky)
    resp = httpx.post(server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "The town", "max_tokens": 4}, timeout=30)
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_error"
    ok = httpx.post(server.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "The town", "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200
    wait_until(lambda: idle(server.engine))
    check_engine(server.engine)


def test_serve_bounds_the_onednn_caches_unless_the_environment_sets_them(monkeypatch) -> None:
    import argparse

    from kvlab.entrypoints import serve

    ap = argparse.ArgumentParser()
    EngineArgs.add_cli_args(ap)
    serve.add_server_args(ap)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)   # leave the suite's setting
    engine = serve.make_engine(ap.parse_args(["--max-model-len", "64", "--threads", "1"]))
    assert engine.max_model_len == 64
    assert os.environ["LRU_CACHE_CAPACITY"] == serve.ONEDNN_CACHE_CAPACITY == "64"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
