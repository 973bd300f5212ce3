"""The server's metrics, with vLLM 0.32's names and labels where vLLM has the metric.

Every series carries vLLM's labels ``model_name`` and ``engine`` (``"0"``: one engine), and the
names are those ``vllm serve`` 0.32 exports (``vllm/v1/metrics/loggers.py``): the retired
``vllm:gpu_cache_usage_perc`` and ``vllm:time_per_output_token_seconds`` are gone there and here.

Request latencies are measured on the engine's clock (``RequestMetrics``), per sample as vLLM
measures each of the ``n`` child requests of a parallel-sampling request
(``IterationStats.update_from_output``, ``vllm/v1/metrics/stats.py``): a sample's TTFT from the
request's arrival at the engine to the step that gave it its first token; its inter-token
latency once per step that gave it tokens, between consecutive such steps (so ``n`` samples
stepping together add ``n`` gaps of one step each, and a speculative step one gap for its
tokens); per-sample TPOT ``(finish - first token) / (tokens - 1)``; E2E from arrival to finish.
A sample's prompt tokens count when its first token arrives, and each sample ends once in
``vllm:request_success_total`` by its finish reason. A client measures the same quantities from
the stream and sees them slightly larger (HTTP and SSE framing come on top).

Gauges (running, waiting, KV usage) are read from the scheduler and KV manager at scrape time
under the engine core's lock. KV usage is ``1 - allocatable / total`` blocks: cached blocks no
request holds count as free, as in vLLM.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from kvlab.engine.outputs import RequestOutput
from kvlab.entrypoints.prometheus import Histogram, MetricFamily, render

__all__ = ["ServerMetrics"]


@dataclass
class _Sample:
    """One sample's progress: tokens so far, when its first and last tokens came, ended."""

    tokens: int
    first: float
    last: float
    ended: bool = False


class ServerMetrics:
    """Counters and histograms of one server (see the module docstring)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name, "engine": "0"}
        self.ttft = Histogram()
        self.itl = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.finished_by_reason: dict[str, int] = {}
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.http_errors: dict[str, int] = {}
        # request id -> sample index -> its tokens, first and last token times, ended
        self._seen: dict[str, dict[int, _Sample]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ observations
    def observe_arrival(self, request_id: str) -> None:
        with self._lock:
            self._seen[request_id] = {}

    def observe_step(self, trace: Any) -> None:
        if trace is not None:
            with self._lock:
                self.preemptions += len(trace.scheduler_output.preempted)

    def observe_http_error(self, status: int) -> None:
        with self._lock:
            key = str(status)
            self.http_errors[key] = self.http_errors.get(key, 0) + 1

    def observe_output(self, out: RequestOutput) -> None:
        """Fold one output of a request in (a delta: ``SamplingParams.output_kind=DELTA``),
        sample by sample; the final one closes the request. A delta that arrives after its
        request was closed (a step made it just before an abort) still counts its tokens."""
        m = out.metrics
        now = m.finished_time if out.finished and m.finished_time is not None \
            else time.monotonic()
        with self._lock:
            samples = self._seen.get(out.request_id)
            if samples is None:
                self.generation_tokens += sum(len(c.token_ids) for c in out.outputs)
                return
            fresh = not samples      # no sample had a token before this delta
            for c in out.outputs:
                new = len(c.token_ids)
                sample = samples.get(c.index)
                if new and sample is None:
                    first = m.first_token_time if fresh and m.first_token_time is not None \
                        else now
                    sample = samples[c.index] = _Sample(new, first, first)
                    self.ttft.observe(max(first - m.arrival_time, 0.0))
                    self.prompt_tokens += len(out.prompt_token_ids)
                elif new:
                    self.itl.observe(max(now - sample.last, 0.0))
                    sample.tokens += new
                    sample.last = now
                self.generation_tokens += new
                if c.finish_reason is not None or out.finished:
                    self._end(sample or samples.setdefault(c.index, _Sample(0, now, now)),
                              c.finish_reason or "abort", m.arrival_time, now)
            if out.finished:
                del self._seen[out.request_id]

    def _end(self, sample: _Sample, reason: str, arrival: float, now: float) -> None:
        """One sample ended (under the lock): its finish reason, and for a completed one its
        E2E latency and TPOT."""
        if sample.ended:
            return
        sample.ended = True
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        if reason in ("stop", "length"):
            self.e2e.observe(max(now - arrival, 0.0))
            if sample.tokens >= 2:
                self.tpot.observe(max(now - sample.first, 0.0) / (sample.tokens - 1))

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
                             "Prompt tokens, per sample once prefilled.")
                .add(self.prompt_tokens, **lb),
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
            MetricFamily("vllm:inter_token_latency_seconds", "histogram",
                         "Inter-token latency.").add(self.itl, **lb),
            MetricFamily("vllm:request_time_per_output_token_seconds", "histogram",
                         "Per-request mean time per output token after the first.")
            .add(self.tpot, **lb),
            MetricFamily("vllm:e2e_request_latency_seconds", "histogram",
                         "End-to-end latency of finished requests.").add(self.e2e, **lb),
        ]
        return render(fams)
