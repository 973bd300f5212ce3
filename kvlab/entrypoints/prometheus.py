"""Prometheus text exposition (format 0.0.4): counters, gauges and histograms, and a parser.

Small on purpose: the server publishes a dozen series and the tests and the load client read
them back, so writing and reading the format here keeps both sides in one place. Metric names
follow vLLM's where vLLM has the metric (``vllm:time_to_first_token_seconds`` and so on), so
dashboards and scripts written for vLLM read kvlab's server unchanged.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Iterable, Sequence

__all__ = ["Histogram", "MetricFamily", "parse_metrics", "render"]

#: Latency buckets (seconds), close to vLLM's for TTFT and inter-token latency.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


class Histogram:
    """A cumulative histogram with fixed upper bounds (thread-safe ``observe``)."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("histogram buckets must be strictly increasing and non-empty")
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)   # last: above the largest bound
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        if not value >= 0:
            raise ValueError(f"histogram observation must be >= 0, got {value!r}")
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        with self._lock:
            out, running = [], 0
            for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
                running += n
                out.append(f"{name}_bucket{_labels({**labels, 'le': _fmt(bound)})} {running}")
            out.append(f"{name}_sum{_labels(labels)} {_fmt(self.sum)}")
            out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class MetricFamily:
    """One metric: a name, a type (counter/gauge/histogram), help text and labelled samples."""

    def __init__(self, name: str, kind: str, help_text: str) -> None:
        if kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"unknown metric type {kind!r}")
        self.name, self.kind, self.help = name, kind, help_text
        self.samples: list[tuple[dict[str, str], float | Histogram]] = []

    def add(self, value: float | Histogram, **labels: str) -> MetricFamily:
        self.samples.append((labels, value))
        return self

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for labels, value in self.samples:
            if isinstance(value, Histogram):
                out.extend(value.lines(self.name, labels))
            else:
                out.append(f"{self.name}{_labels(labels)} {_fmt(value)}")
        return out


def render(families: Iterable[MetricFamily]) -> str:
    """The text exposition of ``families`` (ends with a newline)."""
    return "\n".join(line for f in families for line in f.lines()) + "\n"


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(name, sorted label pairs): value}`` for every sample of a text exposition.
    ValueError naming the line for a malformed one."""
    out = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"metrics line {lineno} is not a sample: {line!r}")
        name, labels, value = m.groups()
        pairs = tuple(sorted(_LABEL.findall(labels or "")))
        out[(name, pairs)] = float(value.replace("+Inf", "inf").replace("-Inf", "-inf"))
    return out
