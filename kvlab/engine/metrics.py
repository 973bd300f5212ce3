"""The engine's counters as vLLM's :meth:`LLM.get_metrics` returns them: a list of metric objects.

vLLM (``vllm/v1/metrics/reader.py``) reads its Prometheus registry into ``Counter`` (int
``value``), ``Gauge`` (float ``value``), ``Vector`` (``values``: one counter per speculative
position) and ``Histogram`` objects, each with a ``name`` such as ``vllm:prompt_tokens`` and
``labels``. kvlab keeps the same classes and names for the counters it has, so a loop written for
vLLM (``for m in llm.get_metrics(): if m.name == "vllm:spec_decode_num_drafts": ...``) runs
unchanged. kvlab has no histograms here (latency histograms are the server's, ``/metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.core.request import RequestStatus

__all__ = ["Counter", "Gauge", "Metric", "Vector", "engine_metrics"]


@dataclass
class Metric:
    """A named metric with ``key=value`` labels: vLLM's ``model_name`` (the model as given to
    the engine, vLLM's default served name) and ``engine`` (always "0": one engine)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer count."""

    value: int


@dataclass
class Gauge(Metric):
    """A value that goes up and down (requests running or waiting now, cache use)."""

    value: float


@dataclass
class Vector(Metric):
    """An ordered array of counters: accepted draft tokens per speculative position."""

    values: list[int]


def engine_metrics(engine) -> list[Metric]:
    """An :class:`~kvlab.engine.llm_engine.LLMEngine`'s counters (taken under its lock):
    ``Counter`` s ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
    ``vllm:prefix_cache_queries`` / ``_hits`` (prompt tokens looked up / served by the cache),
    ``vllm:request_success`` per ``finished_reason`` label, ``Gauge`` s
    ``vllm:num_requests_running`` / ``_waiting`` and ``vllm:kv_cache_usage_perc`` (a fraction,
    as in vLLM); when speculating, ``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` /
    ``_num_accepted_tokens`` and the ``Vector`` ``vllm:spec_decode_num_accepted_tokens_per_pos``.
    """
    with engine.core.lock:
        st = engine.stats
        model = engine.args.model       # a name, a directory, or a LoadedCheckpoint
        labels = {"model_name": str(getattr(model, "path", model)), "engine": "0"}
        out: list[Metric] = [
            Counter("vllm:prompt_tokens", dict(labels), st.prompt_tokens),
            Counter("vllm:generation_tokens", dict(labels), st.generated_tokens),
            Counter("vllm:prefix_cache_queries", dict(labels), st.prompt_tokens),
            Counter("vllm:prefix_cache_hits", dict(labels), st.cached_prompt_tokens),
        ]
        out += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, n)
                for reason, n in sorted(st.finished_by_reason.items())]
        live = [r.status for r in engine.scheduler.requests() if not r.status.is_terminal]
        running = sum(status is RequestStatus.RUNNING for status in live)
        waiting = len(live) - running
        kv = engine.kv
        out += [Gauge("vllm:num_requests_running", dict(labels), float(running)),
                Gauge("vllm:num_requests_waiting", dict(labels), float(waiting)),
                Gauge("vllm:kv_cache_usage_perc", dict(labels),
                      1.0 - kv.num_allocatable_blocks() / kv.num_blocks)]
        if engine.speculator is not None:
            m = engine.speculator.metrics
            out += [Counter("vllm:spec_decode_num_drafts", dict(labels), m.num_drafts),
                    Counter("vllm:spec_decode_num_draft_tokens", dict(labels),
                            m.num_draft_tokens),
                    Counter("vllm:spec_decode_num_accepted_tokens", dict(labels),
                            m.num_accepted_tokens),
                    Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                           list(m.accepted_per_pos))]
    return out
