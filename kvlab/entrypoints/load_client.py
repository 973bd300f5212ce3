"""An open-loop load client for any OpenAI-compatible server (kvlab, vLLM, SGLang).

Requests are sent at pre-drawn arrival times whatever the server does (open loop: a slow server
does not slow its own load), optionally capped by ``max_concurrency``. Each request is streamed
and timed on the client's monotonic clock:

* **TTFT**: from sending the request to the first chunk that carries text;
* **ITL**: the gaps between later chunks that carry text (one per engine step on kvlab and
  vLLM, so one per token or per speculative burst);
* **TPOT**: ``(E2E - TTFT) / (output tokens - 1)`` with the token count from the server's
  ``usage`` (requested with ``stream_options``), else the number of text chunks (prompt
  tokens too come from ``usage``, else the number of token ids sent);
* **E2E**: from sending to the end of the stream.

Failures are classified (:class:`~kvlab.labs.slo.FailureKind`) and never enter latency
statistics: HTTP 429/503 are admission rejects; any other non-2xx answer or broken connection
is an HTTP error; a request not done within ``request_timeout`` is a timeout; a stream the
client abandons on purpose (``abandon_fraction``) or that ends with ``finish_reason "abort"``
is a cancel; ``finish_reason "error"`` or an error event is an engine error. Results are
:class:`~kvlab.labs.slo.LatencyRecord` objects for :func:`~kvlab.labs.slo.evaluate_slo`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlab.labs.slo import FailureKind, LatencyRecord

__all__ = ["LoadConfig", "PlannedRequest", "gamma_arrivals", "plan_requests", "run_load"]

QualityCheck = Callable[[object, str], bool]


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the plan: when to send it (seconds from the start) and what."""

    request_id: str
    arrival: float
    prompt: str | list[int]
    output_len: int


@dataclass
class LoadConfig:
    """How to load the server. ``endpoint``: ``"completions"`` or ``"chat"``."""

    base_url: str
    model: str
    endpoint: str = "completions"
    request_timeout: float = 60.0
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    abandon_fraction: float = 0.0        # share of requests the client drops mid-stream
    abandon_after_chunks: int = 2
    quality_check: QualityCheck | None = None
    progress: bool = False
    seed: int = 0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")
        if not 0 <= self.abandon_fraction <= 1:
            raise ValueError(f"abandon_fraction must be in [0, 1], got {self.abandon_fraction}")


def gamma_arrivals(rate: float, n: int, rng: random.Random, burstiness: float = 1.0
                   ) -> list[float]:
    """``n`` arrival times with gamma-distributed gaps of mean ``1/rate``. ``burstiness`` is
    the gamma shape: 1 = Poisson (exponential gaps), < 1 burstier, > 1 more regular (vLLM's
    ``--burstiness``). ``rate=inf`` sends everything at time 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness!r}")
    t, out = 0.0, []
    for _ in range(n):
        if not math.isinf(rate):
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def plan_requests(n: int, rate: float, prompt_len: Callable[[random.Random], int],
                  output_len: Callable[[random.Random], int], *, seed: int = 0,
                  burstiness: float = 1.0, token_range: tuple[int, int] = (3, 1024),
                  text: bool = False, dataset: Sequence[dict] | None = None
                  ) -> list[PlannedRequest]:
    """The plan: arrivals from :func:`gamma_arrivals`, lengths from the two distributions
    (:mod:`kvlab.sim.workload`'s generators) or from ``dataset`` rows (``{"prompt": str or
    token ids, "output_len": int}`` or ``{"prompt_len": int, "output_len": int}``, cycled).
    Prompts are random token ids in ``token_range`` (valid for any model whose vocabulary is
    at least that large), or with ``text`` space-separated words of about one token each."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"bad token_range {token_range!r}")
    rng = random.Random(seed)
    times = gamma_arrivals(rate, n, rng, burstiness)
    plan = []
    for i, t in enumerate(times):
        row = dataset[i % len(dataset)] if dataset else None
        prompt: str | list[int]
        if row is not None and "prompt" in row:
            prompt, out_len = row["prompt"], int(row["output_len"])
        else:
            plen = int(row["prompt_len"]) if row is not None else prompt_len(rng)
            out_len = int(row["output_len"]) if row is not None else output_len(rng)
            if text:
                prompt = " ".join(rng.choice(WORDS) for _ in range(plen))
            else:
                prompt = [rng.randrange(lo, hi) for _ in range(plen)]
        if out_len < 1:
            raise ValueError(f"request {i}: output_len must be >= 1, got {out_len}")
        plan.append(PlannedRequest(f"bench-{i}", t, prompt, out_len))
    return plan


#: the words text prompts are made of (about one kvlab-tiny token each)
WORDS = ("the", "river", "town", "was", "a", "of", "and", "shepherd", "in", "old")


def prefix_repetition(num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                      output_len: int, *, seed: int = 0) -> list[dict]:
    """vLLM's ``prefix_repetition`` workload in words: ``num_prefixes`` tenants, each a random
    system prompt of ``prefix_len`` words shared by ``num_requests // num_prefixes`` requests
    that end in their own ``suffix_len`` words, in random order (``{"prompt", "output_len",
    "tenant"}`` rows, a ``dataset`` for :func:`plan_requests`)."""
    if not (num_prefixes >= 1 and num_requests >= num_prefixes):
        raise ValueError(f"need 1 <= num_prefixes <= num_requests, got {num_prefixes} and "
                         f"{num_requests}")
    for name, value in (("prefix_len", prefix_len), ("suffix_len", suffix_len),
                        ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    rows = []
    for tenant in range(num_prefixes):
        prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len))
        for _ in range(num_requests // num_prefixes):
            suffix = " ".join(rng.choice(WORDS) for _ in range(suffix_len))
            rows.append({"prompt": f"{prefix} {suffix}", "output_len": output_len,
                         "tenant": tenant})
    rng.shuffle(rows)
    return rows


def _body(cfg: LoadConfig, req: PlannedRequest) -> dict:
    body = {"model": cfg.model, "max_tokens": req.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        content = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = req.prompt
    body.update(cfg.extra_body)
    return body


def _chunk_text(chunk: dict, chat: bool) -> tuple[str | None, str | None]:
    """(text, finish_reason) of a stream chunk's first choice."""
    choices = chunk.get("choices") or []
    if not choices:
        return None, None
    c = choices[0]
    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
    return text, c.get("finish_reason")


async def _one(client, cfg: LoadConfig, req: PlannedRequest, t0: float,
               abandon: bool) -> LatencyRecord:
    chat = cfg.endpoint == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    sent = time.monotonic()
    arrival = sent - t0
    ttft = None
    last = sent
    itl: list[float] = []
    chunks = 0
    pieces: list[str] = []
    usage_tokens = None
    usage_prompt = None
    reason = None

    def failed(kind: FailureKind, error: str) -> LatencyRecord:
        now = time.monotonic()
        return LatencyRecord(req.request_id, arrival, kind, ttft=ttft,
                             e2e=max(now - sent, ttft or 0.0), output_tokens=chunks, error=error)

    async def stream() -> LatencyRecord | None:
        nonlocal ttft, last, chunks, usage_tokens, usage_prompt, reason
        async with client.stream("POST", path, json=_body(cfg, req)) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    message = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = raw[:200].decode(errors="replace")
                kind = FailureKind.REJECTED if resp.status_code in (429, 503) \
                    else FailureKind.HTTP_ERROR
                return failed(kind, f"HTTP {resp.status_code}: {message}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return failed(FailureKind.ENGINE_ERROR, str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    usage_prompt = chunk["usage"].get("prompt_tokens")
                text, finish = _chunk_text(chunk, chat)
                now = time.monotonic()
                if text:
                    if ttft is None:
                        ttft = now - sent
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
                    pieces.append(text)
                    if abandon and chunks >= cfg.abandon_after_chunks:
                        return failed(FailureKind.CANCELLED, "abandoned by the client")
                if finish is not None:
                    reason = finish
        return None

    try:
        early = await asyncio.wait_for(stream(), cfg.request_timeout)
    except asyncio.TimeoutError:
        return failed(FailureKind.TIMEOUT, f"no complete answer in {cfg.request_timeout} s")
    except asyncio.CancelledError:
        return failed(FailureKind.CANCELLED, "cancelled")
    except Exception as err:   # transport errors (refused, reset, bad stream) of any client lib
        return failed(FailureKind.HTTP_ERROR, f"{type(err).__name__}: {err}")
    if early is not None:
        return early
    if reason == "abort":
        return failed(FailureKind.CANCELLED, "the server aborted the request")
    if reason == "error" or ttft is None:
        return failed(FailureKind.ENGINE_ERROR, f"stream ended with finish_reason {reason!r} "
                                                "and no text" if ttft is None else "error")
    e2e = time.monotonic() - sent
    tokens = usage_tokens if usage_tokens is not None else chunks
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else None
    text = "".join(pieces)
    ok = True if cfg.quality_check is None else bool(cfg.quality_check(req.prompt, text))
    prompt_tokens = usage_prompt if usage_prompt is not None else (
        len(req.prompt) if isinstance(req.prompt, list) else 0)
    return LatencyRecord(req.request_id, arrival, ttft=ttft, tpot=tpot, e2e=e2e,
                         output_tokens=tokens, prompt_tokens=prompt_tokens, quality_ok=ok,
                         itl=tuple(itl))


async def _run(cfg: LoadConfig, plan: Sequence[PlannedRequest]) -> tuple[list, float]:
    import httpx

    rng = random.Random(cfg.seed + 1)
    abandon = [rng.random() < cfg.abandon_fraction for _ in plan]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.request_timeout, connect=min(cfg.request_timeout, 10.0))
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(plan), desc="requests")
    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=timeout) as cl:
        t0 = time.monotonic()

        async def launch(i: int, req: PlannedRequest) -> LatencyRecord:
            delay = t0 + req.arrival - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                rec = await _one(cl, cfg, req, t0, abandon[i])
            else:
                async with sem:
                    rec = await _one(cl, cfg, req, t0, abandon[i])
            if bar is not None:
                bar.update(1)
            return rec

        records = await asyncio.gather(*(launch(i, r) for i, r in enumerate(plan)))
        duration = time.monotonic() - t0
    if bar is not None:
        bar.close()
    return list(records), duration


def run_load(cfg: LoadConfig, plan: Sequence[PlannedRequest]
             ) -> tuple[list[LatencyRecord], float]:
    """Run ``plan`` against the server; ``(records in plan order, wall seconds)``. Works from
    plain scripts and from inside a running event loop (a notebook): then it runs in a
    worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_run(cfg, plan))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _run(cfg, plan)).result()
