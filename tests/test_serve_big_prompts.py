"""No prompt freezes the server: 2 MiB string prompts beside a running stream.

A string prompt is bounded by characters before it is tokenized (the context length times the
longest token string, vLLM 0.32's ``TokenizeParams._text_len_check`` in
``vllm/renderers/params.py``), and tokenizing releases the GIL. Before, a prompt just under the
2 MiB body limit was tokenized whole while holding the GIL: one stalled every stream ~1.9 s,
four ~2.9 s, and RSS grew 692 -> 2,044 MB and stayed.

The checks are behavioural and deterministic, on a real ``kvlab serve`` process: each of four
2 MiB prompts (two completions, two chat) sent beside a running stream is refused by the
character bound (its message counts characters, which only the check before tokenizing
writes), RSS comes back within 64 MB of its level before them (the failure added ~1.3 GB), and
the bound itself holds on random texts (no text longer than ``n * max_chars_per_token`` has
``n`` tokens or fewer). The stream's largest gap with and without the big prompts is measured
and reported (``record_property``), never asserted: a wall-clock bound would fail on a machine
whose CPUs something else saturates. ``benchmarks/bench_serve_load.py`` measures the stall.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_serve import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvlab-tiny"
BIG = 2 * 1024 * 1024 - 512          # characters: the body stays under the 2 MiB limit
WINDOW = 4.0                         # seconds of stream watched in each phase


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def served():
    if not Path("/proc/self/status").exists():
        pytest.skip("RSS is read from /proc (Linux)")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvlab", "serve", "--port", str(port)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    yield url, proc.pid
    proc.terminate()
    proc.wait(30)


def _watch(url: str, during) -> tuple[float, list]:
    """Run ``during()`` while a stream is running; the stream's largest gap between events
    over the window from ``during``'s start to WINDOW seconds later (or its end, if later),
    and ``during``'s result."""
    arrivals: list[float] = []
    started = threading.Event()

    def read() -> None:
        body = {"model": MODEL, "prompt": "The lamplighter of Vale", "max_tokens": 1500,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    started.set()
                if arrivals and arrivals[-1] > max(t0, done[0]) + 1:
                    return

    t0 = float("inf")
    done = [float("inf")]       # when ``during`` returned (the stream ends a second later)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(120)
    time.sleep(0.5)
    t0 = time.monotonic()
    result = during()
    time.sleep(max(0.0, t0 + WINDOW - time.monotonic()))
    done[0] = time.monotonic()
    reader.join(120)
    # the events in the window, with the last one before it and the first one after it (a
    # stall across the window's edge counts in full)
    end = done[0]
    inside = [t for t in arrivals if t0 <= t <= end]
    edges = [max((t for t in arrivals if t < t0), default=t0),
             min((t for t in arrivals if t > end), default=time.monotonic())]
    events = sorted({edges[0], *inside, edges[1]})
    return max(b - a for a, b in itertools.pairwise(events)), result


def test_four_2mib_prompts_are_refused_before_tokenizing_and_keep_no_memory(served,
                                                                            record_property):
    url, pid = served
    text = ("the lamps of Vale were lit at dusk " * (BIG // 35 + 1))[:BIG]
    bodies = [("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4}),
              ("/v1/completions", {"model": MODEL, "prompt": text[1:], "max_tokens": 4}),
              ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": text}]}),
              ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
                  {"role": "system", "content": "x"}, {"role": "user", "content": text}]})]
    raw = [(path, json.dumps(body).encode()) for path, body in bodies]
    assert all(len(b) < 2 * 1024 * 1024 for _, b in raw)

    def fire() -> list[httpx.Response]:
        def one(item):
            path, content = item
            return httpx.post(url + path, content=content, timeout=120,
                              headers={"content-type": "application/json"})
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, raw))

    control, _ = _watch(url, lambda: None)
    baseline = _rss_mb(pid)
    gap, answers = _watch(url, fire)
    record_property("largest_gap_s", {"control": round(control, 3), "big_prompts": round(gap, 3)})
    for resp in answers:
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["code"] == "context_length_exceeded"
        assert "characters" in err["message"] and err["param"] in ("prompt", "messages")
    time.sleep(1.0)
    assert _rss_mb(pid) < baseline + 64, (baseline, _rss_mb(pid))
    # /tokenize has no context bound (as in vLLM): it tokenizes 2 MiB, then gives the memory
    # back
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text},
                     timeout=300).json()["tokens"]
    assert len(ids) > 2048
    del ids
    assert _rss_mb(pid) < baseline + 64, (baseline, _rss_mb(pid))


def test_character_bound_never_refuses_a_prompt_that_fits():
    """``max_chars_per_token`` is an upper bound: a text of ``c`` characters has at least
    ``c / max_chars_per_token`` tokens, so the bound refuses only prompts over the context."""
    import random

    from kvlab.engine.tokenizer import Tokenizer
    tok = Tokenizer(ROOT / "kvlab" / "models" / MODEL)
    rng = random.Random(0)
    vocab = [s for s in tok.get_vocab() if s.isprintable()]
    pieces = ["the lamps of Vale ", "\u00e9t\u00e9 ", "\u4e2d\u6587", "\U0001f600", "\n\n", "    ",
              *(tok.decode([i]) for i in rng.sample(range(len(vocab)), 200))]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))
        n = len(tok.encode(text, add_special_tokens=False))
        assert n * tok.max_chars_per_token >= len(text), (text[:80], n)
