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

__all__ = ["Counter", "Gauge", "Metric", "Vector"]


@dataclass
class Metric:
    """A named metric with ``key=value`` labels (``engine`` is always "0": one engine)."""

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
