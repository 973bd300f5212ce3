"""Load run of ``kvlab serve`` (issue 21): many concurrent streams and hostile clients at once.

A ``python -m kvlab serve`` child on the shipped kvlab-tiny model (``--max-num-seqs 256``, so
that every stream runs at once), loopback only. First a *baseline* round: the same work with
well-behaved clients only (it also warms the server up); the server's RSS after it is the
starting point. Then ``--rounds`` *adversarial* rounds, each with, at once:

- ``--streams`` concurrent streams (default 128), one in four of which disconnects after a few
  chunks (its request must be aborted and its KV freed);
- two slow readers: raw sockets with a 4 KB receive buffer asking for ``n=32`` samples of 720
  tokens with ``logprobs: 5`` (~9 MB of events, more than the kernel's socket buffers hold on
  loopback, up to ~4 MB) and reading nothing
  until the server has aborted them (it must, once one owes ``--max-stream-backlog`` tokens,
  and never buffer more); in the baseline the same two requests are read as they come;
- one 10 MB request body, sent chunked (no Content-Length, so the server has to read up to its
  limit before it can answer 413);
- four string prompts just under the 2 MiB body limit (two completions, two chat), a second
  into the round: each must be a 400 ``context_length_exceeded`` refused by its length in
  characters before it is tokenized, without stalling the streams (their largest gap between
  chunks is in the JSON) or keeping memory.

Measured: every well-behaved stream's TTFT, E2E, largest gap between chunks and whether it got
all its tokens with ``finish_reason "length"``; the slow readers' and the big body's answers;
the server's RSS (``/proc/<pid>/status``) before, at its peak during and after each round; and
the server's own counters from ``/metrics`` (aborts, KV usage back at 0, nothing running).

Pass criteria (exit status 1 otherwise): every well-behaved stream complete; the slow readers
aborted with the ``client_too_slow`` error event; the big body a 413; the 2 MiB prompts 400s
naming the context length; RSS after the last round
within 10% of the start; and "on time": each adversarial round's p90 E2E of the well-behaved
streams at most 1.5x the baseline's (a shared machine is noisy: the figures are all in the
JSON, ``benchmarks/results/serve_load.json``). Bounded: fixed counts, and every round gives up
after ``--round-timeout`` seconds.

    python benchmarks/bench_serve_load.py [--streams 128] [--rounds 2] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from _results import write_results

from kvlab.entrypoints.prometheus import parse_metrics

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvlab-tiny"
WORDS = ["the", "shepherd", "river", "town", "hill", "market", "bridge", "morning", "sheep",
         "old", "stone", "wall", "clocks", "mended", "generous", "lived", "grass", "slept"]
#: a slow reader's request: 23,040 tokens with 5 logprobs each, ~9 MB of events (the kernel's
#: socket buffers on loopback hold up to ~4 MB; the server's queue must hold the rest back)
SLOW_N, SLOW_TOKENS, SLOW_LOGPROBS = 32, 720, 5


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))


async def stream(client: httpx.AsyncClient, i: int, rng: random.Random, max_tokens: int,
                 drop_after: int | None) -> dict:
    """One streamed completion; ``drop_after``: disconnect after that many chunks."""
    body = {"model": MODEL, "prompt": prompt(rng), "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.8, "seed": i,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    times, finish, tokens = [], None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"i": i, "status": resp.status_code, "ok": False}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    times.append(time.monotonic() - t0)
                    finish = c.get("finish_reason") or finish
                if drop_after is not None and len(times) >= drop_after:
                    return {"i": i, "dropped_after": len(times), "ok": True}
    except httpx.HTTPError as err:
        return {"i": i, "error": repr(err), "ok": False}
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"i": i, "ttft_s": times[0] if times else None, "e2e_s": time.monotonic() - t0,
            "max_gap_s": max(gaps, default=0.0), "tokens": tokens, "finish": finish,
            "ok": finish == "length" and tokens == max_tokens}


async def slow_reader(host: str, port: int, i: int, release: asyncio.Event) -> dict:
    """n=32 long samples on a raw socket with a 4 KB receive buffer, read only after
    ``release`` (set from the start: a prompt reader); reports whether the stream ended with
    the server's ``client_too_slow`` error event."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = json.dumps({"model": MODEL, "prompt": f"Slow reader {i}: the shepherd",
                       "max_tokens": SLOW_TOKENS, "n": SLOW_N, "stream": True,
                       "logprobs": SLOW_LOGPROBS,
                       "ignore_eos": True, "seed": 1000 + i}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    t0 = time.monotonic()
    await release.wait()
    stalled = time.monotonic() - t0
    data = await reader.read()         # everything, until the server closes
    writer.close()
    text = data.decode(errors="replace")
    return {"i": i, "stalled_s": stalled, "bytes_read": len(data),
            "status": text.split(" ", 2)[1] if text.startswith("HTTP/") else None,
            "too_slow_error": "client_too_slow" in text, "done": "data: [DONE]" in text}


async def big_body(client: httpx.AsyncClient, megabytes: int) -> dict:
    """A chunked ``megabytes`` MB body: the server must refuse it with 413 once past its limit."""
    piece = b'{"model": "kvlab-tiny", "prompt": "' + b"x" * (1 << 20)

    async def chunks():
        for _ in range(megabytes):
            yield piece

    t0 = time.monotonic()
    try:
        r = await client.post("/v1/completions", content=chunks(),
                              headers={"Content-Type": "application/json"})
        status, code = r.status_code, r.json().get("error", {}).get("code")
    except httpx.HTTPError as err:     # the server may close while we are still sending
        status, code = None, repr(err)
    return {"status": status, "code": code, "seconds": time.monotonic() - t0}


#: a string prompt just under the 2 MiB body limit (characters; its JSON body stays under)
BIG_PROMPT_CHARS = 2 * 1024 * 1024 - 512


async def big_prompts(client: httpx.AsyncClient, delay: float) -> list[dict]:
    """Four 2 MiB string prompts at once, ``delay`` seconds into the round: two completions,
    two chat. Each must be refused (400) before it is tokenized."""
    await asyncio.sleep(delay)
    text = ("the shepherd mended the old stone wall " * (BIG_PROMPT_CHARS // 39 + 1)
            )[:BIG_PROMPT_CHARS]
    bodies = [("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4}),
              ("/v1/completions", {"model": MODEL, "prompt": text[1:], "max_tokens": 4}),
              ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": text}]}),
              ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
                  {"role": "system", "content": "x"}, {"role": "user", "content": text}]})]

    async def one(path: str, body: dict) -> dict:
        t0 = time.monotonic()
        try:
            r = await client.post(path, content=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
            status, code = r.status_code, r.json().get("error", {}).get("code")
        except httpx.HTTPError as err:
            status, code = None, repr(err)
        return {"route": path, "status": status, "code": code,
                "seconds": time.monotonic() - t0}

    return list(await asyncio.gather(*(one(p, b) for p, b in bodies)))


async def one_round(url: str, pid: int, n: int, max_tokens: int, adversarial: bool,
                    seed: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    peak = rss_mb(pid)
    stop = asyncio.Event()

    async def sample_rss():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample_rss())
    release = asyncio.Event()
    if not adversarial:
        release.set()
    aborted_before = server_state(url)["aborted"]
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
        slow = [asyncio.create_task(slow_reader(host, int(port), k, release))
                for k in range(2)]
        body = asyncio.create_task(big_body(client, 10)) if adversarial else None
        prompts = asyncio.create_task(big_prompts(client, 1.0)) if adversarial else None
        plan = [(i, random.Random(seed * 1000 + i), adversarial and i % 4 == 3)
                for i in range(n)]
        t0 = time.monotonic()
        results = await asyncio.gather(*(
            stream(client, i, r, max_tokens, rng.randint(2, max_tokens // 2) if drop else None)
            for i, r, drop in plan))
        wall = time.monotonic() - t0
        if adversarial:       # read once the server gave up on the slow readers (or 120 s)
            want = aborted_before + sum(1 for *_, drop in plan if drop) + len(slow)
            deadline = time.monotonic() + 120
            while server_state(url)["aborted"] < want and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        release.set()
        slow_results = [await t for t in slow]
        body_result = await body if body is not None else None
        prompts_result = await prompts if prompts is not None else None
    stop.set()
    await sampler
    kept = [r for r, (_, _, drop) in zip(results, plan, strict=True) if not drop]
    done = [r for r in kept if r["ok"]]
    e2e = [r["e2e_s"] for r in done]
    return {
        "adversarial": adversarial, "streams": n, "wall_s": wall,
        "well_behaved": len(kept), "complete": len(done),
        "dropped": sum(1 for r in results if "dropped_after" in r),
        "failures": [r for r in kept if not r["ok"]][:5],
        "ttft_s": {"p50": pct([r["ttft_s"] for r in done], .5),
                   "p90": pct([r["ttft_s"] for r in done], .9),
                   "max": max(r["ttft_s"] for r in done)} if done else None,
        "e2e_s": {"p50": pct(e2e, .5), "p90": pct(e2e, .9), "max": max(e2e)} if done else None,
        "max_gap_s": {"p50": pct([r["max_gap_s"] for r in done], .5),
                      "max": max(r["max_gap_s"] for r in done)} if done else None,
        "mean_e2e_s": statistics.fmean(e2e) if e2e else None,
        "slow_readers": slow_results, "big_body": body_result,
        "big_prompts": prompts_result, "rss_peak_mb": peak}


def server_state(url: str) -> dict:
    m = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    lab = (("engine", "0"), ("model_name", MODEL))

    def get(name: str, **labels: str) -> float:
        return m.get((name, tuple(sorted({**dict(lab), **labels}.items()))), 0.0)

    return {"running": get("vllm:num_requests_running"),
            "waiting": get("vllm:num_requests_waiting"),
            "kv_usage": get("vllm:kv_cache_usage_perc"),
            "aborted": get("vllm:request_success_total", finished_reason="abort"),
            "finished_length": get("vllm:request_success_total", finished_reason="length"),
            "http_413": get("kvlab:http_errors_total", code="413")}


def wait_idle(url: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = server_state(url)
        if state["running"] == state["waiting"] == 0 and state["kv_usage"] == 0:
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not idle after {timeout} s: {state}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-stream-backlog", type=int, default=4096)
    ap.add_argument("--round-timeout", type=float, default=600.0)
    ap.add_argument("--no-enable-prefix-caching", action="store_true",
                    help="serve without the prefix cache (whose index grows with what it holds)")
    ap.add_argument("--no-write", action="store_true", help="print, do not write the JSON")
    args = ap.parse_args(argv)
    if args.streams < 8 or args.rounds < 1 or args.max_tokens < 8:
        ap.error("need --streams >= 8, --rounds >= 1, --max-tokens >= 8")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlab", "serve", "--model", MODEL, "--port", str(port),
         "--max-model-len", "1024", "--max-num-seqs", "256",
         "--max-stream-backlog", str(args.max_stream_backlog),
         *(["--no-enable-prefix-caching"] if args.no_enable_prefix_caching else [])],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900       # a first CPU-kernel build may run here
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvlab serve exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvlab serve did not become healthy")
            time.sleep(0.2)

        def run(adversarial: bool, seed: int) -> dict:
            res = asyncio.run(asyncio.wait_for(one_round(
                url, proc.pid, args.streams, args.max_tokens, adversarial, seed),
                args.round_timeout))
            res["server_after"] = wait_idle(url, 120)
            res["rss_after_mb"] = rss_mb(proc.pid)
            print(f"{'adversarial' if adversarial else 'baseline'} round: {res['complete']}/"
                  f"{res['well_behaved']} streams complete in {res['wall_s']:.1f} s, E2E p90 "
                  f"{res['e2e_s']['p90'] if res['e2e_s'] else float('nan'):.2f} s, RSS "
                  f"{res['rss_after_mb']:.0f} MB (peak {res['rss_peak_mb']:.0f})", flush=True)
            return res

        rss_boot = rss_mb(proc.pid)
        baseline = run(False, 1)
        rss_start = baseline["rss_after_mb"]
        rounds = [run(True, 2 + k) for k in range(args.rounds)]
    finally:
        proc.terminate()
        proc.wait(60)
    last = rounds[-1]
    checks = {
        "every_well_behaved_stream_complete": all(
            r["complete"] == r["well_behaved"] for r in [baseline, *rounds]),
        "slow_readers_aborted": all(s["too_slow_error"] and s["done"]
                                    for r in rounds for s in r["slow_readers"]),
        "big_body_413": all(r["big_body"]["status"] == 413 for r in rounds),
        "big_prompts_400_before_tokenizing": all(
            p["status"] == 400 and p["code"] == "context_length_exceeded"
            for r in rounds for p in r["big_prompts"]),
        "rss_within_10pct": last["rss_after_mb"] <= 1.10 * rss_start,
        "on_time_p90_within_1_5x": all(r["e2e_s"] is not None and baseline["e2e_s"] is not None
                                       and r["e2e_s"]["p90"] <= 1.5 * baseline["e2e_s"]["p90"]
                                       for r in rounds),
    }
    result = {"model": MODEL, "streams": args.streams, "max_tokens": args.max_tokens,
              "prefix_caching": not args.no_enable_prefix_caching,
              "slow_reader_request": {"n": SLOW_N, "max_tokens": SLOW_TOKENS,
                                      "logprobs": SLOW_LOGPROBS},
              "max_stream_backlog": args.max_stream_backlog, "cpu_count": os.cpu_count(),
              "load_avg_at_end": os.getloadavg(), "rss_boot_mb": rss_boot,
              "rss_start_mb": rss_start, "rss_end_mb": last["rss_after_mb"],
              "rss_end_over_start": last["rss_after_mb"] / rss_start,
              "baseline": baseline, "adversarial_rounds": rounds, "checks": checks}
    print(json.dumps(checks, indent=2))
    if args.no_write:
        print(json.dumps(result, indent=2))
    else:
        write_results("serve_load", result)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
