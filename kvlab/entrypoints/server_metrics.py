"""The server's metrics, with vLLM's names where vLLM has the metric.

Request latencies are measured on the engine's clock (``RequestMetrics``): TTFT from arrival
at the engine to the end of the step that sampled the first token; inter-token latency between
the step ends that delivered consecutive tokens (what vLLM's ``time_per_output_token_seconds``
and ``inter_token_latency_seconds`` observe); per-request TPOT ``(finish - first token) /
(tokens - 1)``; E2E from arrival to finish. A client measures the same quantities from the
stream and sees them slightly larger (HTTP and SSE framing come on top).

Gauges (running, waiting, KV usage) are read from the scheduler and KV manager at scrape time
under the engine core's lock. KV usage is ``1 - allocatable / total`` blocks: cached blocks no
request holds count as free, as in vLLM.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvlab.engine.outputs import RequestOutput
from kvlab.entrypoints.prometheus import Histogram, MetricFamily, render

__all__ = ["ServerMetrics"]


class ServerMetrics:
    """Counters and histograms of one server (see the module docstring)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}
        self.ttft = Histogram()
        self.itl = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.finished_by_reason: dict[str, int] = {}
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.http_errors: dict[str, int] = {}
        # request id -> (tokens so far, last token's time, sample 0's tokens so far)
        self._seen: dict[str, tuple[int, float, int]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ observations
    def observe_arrival(self, request_id: str) -> None:
        with self._lock:
            self._seen[request_id] = (0, 0.0, 0)

    def observe_step(self, trace: Any) -> None:
        if trace is not None:
            with self._lock:
                self.preemptions += len(trace.scheduler_output.preempted)

    def observe_http_error(self, status: int) -> None:
        with self._lock:
            key = str(status)
            self.http_errors[key] = self.http_errors.get(key, 0) + 1

    def observe_output(self, out: RequestOutput) -> None:
        """Fold one output of a request in (a delta: ``SamplingParams.output_kind=DELTA``); the
        final one closes the request. A delta that arrives after its request was closed (a step
        made it just before an abort) still counts its tokens."""
        m = out.metrics
        now = m.finished_time if out.finished and m.finished_time is not None \
            else time.monotonic()
        new = sum(len(c.token_ids) for c in out.outputs)
        with self._lock:
            seen = self._seen.get(out.request_id)
            if seen is None:
                self.generation_tokens += new
                return
            before, last, first = seen
            tokens = before + new
            first += len(out.outputs[0].token_ids)
            if tokens > before:
                if before == 0 and m.first_token_time is not None:
                    self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
                    last = m.first_token_time
                    before = 1
                    self.generation_tokens += 1
                for _ in range(tokens - before):
                    self.itl.observe(max(now - last, 0.0))
                    last = now
                self.generation_tokens += tokens - before
                before = tokens
            self._seen[out.request_id] = (before, last, first)
            if not out.finished:
                return
            del self._seen[out.request_id]
            reason = out.outputs[0].finish_reason or "abort"
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            if reason in ("stop", "length"):
                self.prompt_tokens += len(out.prompt_token_ids)
                end = m.finished_time if m.finished_time is not None else now
                self.e2e.observe(max(end - m.arrival_time, 0.0))
                if first >= 2 and m.first_token_time is not None:
                    self.tpot.observe(max(end - m.first_token_time, 0.0) / (first - 1))

    # ------------------------------------------------------------------ exposition
    def gauges(self) -> dict[str, float]:
        """Running and waiting requests, KV usage, prefix-cache counters, right now."""
        engine = self.engine
        with engine.core.lock:
            sched, kv = engine.scheduler, engine.kv
            running = len(getattr(sched, "running", ()))
            waiting = len(getattr(sched, "waiting", ()))
            usage = 1.0 - kv.num_allocatable_blocks() / engine.num_blocks
            hits, queries = kv.hit_tokens, kv.query_tokens
            live_kv = len(kv.requests())
        return {"running": running, "waiting": waiting, "kv_usage": usage,
                "prefix_hits": hits, "prefix_queries": queries, "requests_with_kv": live_kv}

    def render(self) -> str:
        g = self.gauges()
        lb = self.labels
        fams = [
            MetricFamily("vllm:num_requests_running", "gauge",
                         "Requests in the running batch.").add(g["running"], **lb),
            MetricFamily("vllm:num_requests_waiting", "gauge",
                         "Requests waiting (queued or preempted).").add(g["waiting"], **lb),
            MetricFamily("vllm:kv_cache_usage_perc", "gauge",
                         "KV-cache usage, 1 = full.").add(g["kv_usage"], **lb),
            MetricFamily("vllm:gpu_cache_usage_perc", "gauge",
                         "KV-cache usage, 1 = full (older vLLM name).").add(g["kv_usage"], **lb),
            MetricFamily("vllm:prefix_cache_queries_total", "counter",
                         "Prompt tokens looked up in the prefix cache.")
            .add(g["prefix_queries"], **lb),
            MetricFamily("vllm:prefix_cache_hits_total", "counter",
                         "Prompt tokens found in the prefix cache.").add(g["prefix_hits"], **lb),
        ]
        with self._lock:
            success = MetricFamily("vllm:request_success_total", "counter",
                                   "Requests ended, by finish reason.")
            for reason in ("stop", "length", "abort", "error", "rejected"):
                success.add(self.finished_by_reason.get(reason, 0), finished_reason=reason,
                            **lb)
            errors = MetricFamily("kvlab:http_errors_total", "counter",
                                  "HTTP error answers, by status code.")
            for code, n in sorted(self.http_errors.items()):
                errors.add(n, code=code, **lb)
            fams += [
                success, errors,
                MetricFamily("vllm:num_preemptions_total", "counter",
                             "Preemptions (KV taken back to recompute later).")
                .add(self.preemptions, **lb),
                MetricFamily("vllm:prompt_tokens_total", "counter",
                             "Prompt tokens of finished requests.").add(self.prompt_tokens, **lb),
                MetricFamily("vllm:generation_tokens_total", "counter",
                             "Generated tokens.").add(self.generation_tokens, **lb),
                MetricFamily("kvlab:requests_in_flight", "gauge",
                             "Requests the server is streaming.").add(len(self._seen), **lb),
                MetricFamily("kvlab:requests_holding_kv", "gauge",
                             "Requests that hold a KV block table.")
                .add(g["requests_with_kv"], **lb),
            ]
        fams += [
            MetricFamily("vllm:time_to_first_token_seconds", "histogram",
                         "Time to first token.").add(self.ttft, **lb),
            MetricFamily("vllm:time_per_output_token_seconds", "histogram",
                         "Inter-token latency.").add(self.itl, **lb),
            MetricFamily("vllm:inter_token_latency_seconds", "histogram",
                         "Inter-token latency.").add(self.itl, **lb),
            MetricFamily("vllm:request_time_per_output_token_seconds", "histogram",
                         "Per-request mean time per output token after the first.")
            .add(self.tpot, **lb),
            MetricFamily("vllm:e2e_request_latency_seconds", "histogram",
                         "End-to-end latency of finished requests.").add(self.e2e, **lb),
        ]
        return render(fams)
