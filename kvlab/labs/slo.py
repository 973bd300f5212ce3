"""Goodput under service-level objectives, and the failure taxonomy of spec rule 10 (no torch).

The production counterpart of :func:`kvlab.reference.goodput`. The input is one
:class:`LatencyRecord` per request, from any source: the load client (measured from a server's
stream), the simulator (simulated clock) or an engine's own metrics. The rules:

* **Open loop, warm-up excluded.** Requests are issued on an arrival schedule that does not wait
  for earlier answers (a closed loop hides overload: a slow server slows its own load). Requests
  that *arrive* before ``warmup_s`` are left out of every count; the measurement window runs
  from ``warmup_s`` to the end given: by default the last arrival or completion (the final
  drain included, as vLLM's ``bench serve`` counts), or with ``window_s="arrivals"`` the last
  arrival, which leaves out the drain (the time the server spends finishing requests after the
  load has stopped arriving).
* **One window for every rate.** With ``window_s="arrivals"`` the three rates count one cohort,
  the requests that arrived in the window, over the window's seconds: *offered* (all of them),
  *throughput* (those that completed by the window's end) and *goodput* (those that completed
  by then within the SLO). So ``goodput <= throughput <= offered`` holds for every run, by
  construction. What the window leaves out is stated, not hidden: the warm-up's requests, even
  when they complete inside the window, and the requests still in flight at its end (about
  offered rate x E2E of them, by Little's law, so throughput reads a little below the offered
  rate even when the server keeps up). With the default window every measured request that
  finished counts; a window given in seconds counts every measured request too (the
  reference's semantics: the caller chose the records).
* **Failures are counted by kind, never folded into latency.** A request that was rejected at
  admission, answered with an HTTP error, timed out, was cancelled, or failed inside the engine
  has no TTFT/TPOT/E2E; it counts against SLO *attainment* (the fraction of measured requests
  that met every objective) and is reported under its :class:`FailureKind`.
* **Goodput** here (spec rule 10; vLLM's ``bench serve`` reports the same rate as "request
  goodput") is the number of finished requests that met every objective and passed the
  quality check, per second of the window (with ``"arrivals"``: those completed within it).
  **Attainment** is the share of all measured requests (failures included) that met it,
  whenever they completed. DistServe's *goodput* of a deployment is a different number,
  found from a sweep: the highest request rate per GPU whose attainment still reaches 90%
  (:func:`kvlab.labs.serving.rate_at_attainment`).
* **Percentiles** are computed by :func:`percentile`: ``"nearest"`` rank (the value at rank
  ``ceil(q/100 * n)``, an observed value) or ``"linear"`` interpolation between closest ranks
  (NumPy's default). Both are stated in every report.

A request with one output token has no inter-token interval: its TPOT is None and the TPOT
objective holds vacuously (the reference, which requires a number, is given ``0.0`` for it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "SLO",
    "FailureKind",
    "GoodputReport",
    "LatencyRecord",
    "arrival_window",
    "evaluate_slo",
    "percentile",
]


class FailureKind(str, Enum):
    """Why a request did not finish. Each is counted on its own (spec rule 10)."""

    REJECTED = "rejected"        # refused at admission (queue full, can never fit): HTTP 429/503
    HTTP_ERROR = "http_error"    # any other non-2xx answer, or a broken connection
    TIMEOUT = "timeout"          # no complete answer within the client's deadline
    CANCELLED = "cancelled"      # the client (or the server, finish_reason "abort") gave up
    ENGINE_ERROR = "engine_error"  # the stream ended with finish_reason "error"


FINISHED = "finished"
_STATUSES = frozenset({FINISHED, *(k.value for k in FailureKind)})


def _nonneg(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
            or math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class LatencyRecord:
    """One request, as measured. Times in seconds; ``arrival`` on the run's own clock.

    ``status``: ``"finished"`` or a :class:`FailureKind` value. A finished record has ``ttft``
    and ``e2e`` (and ``tpot`` when it produced two tokens or more); a failed one may carry
    whatever partial timings there were, which are never used for latency statistics.
    ``itl``: the inter-token latencies seen (optional; used for ITL percentiles).
    """

    request_id: str
    arrival: float
    status: str = FINISHED
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    quality_ok: bool = True
    itl: tuple[float, ...] = ()
    error: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.status, FailureKind):
            object.__setattr__(self, "status", self.status.value)
        if self.status not in _STATUSES:
            raise ValueError(f"LatencyRecord.status must be one of {sorted(_STATUSES)}, "
                             f"got {self.status!r}")
        _nonneg("LatencyRecord.arrival", self.arrival)
        for name in ("ttft", "tpot", "e2e"):
            _nonneg(f"LatencyRecord.{name}", getattr(self, name))
        if self.status == FINISHED and (self.ttft is None or self.e2e is None):
            raise ValueError(f"LatencyRecord {self.request_id!r}: a finished request needs "
                             "ttft and e2e")
        if self.ttft is not None and self.e2e is not None and self.ttft > self.e2e + 1e-12:
            raise ValueError(f"LatencyRecord {self.request_id!r}: ttft {self.ttft} > e2e "
                             f"{self.e2e}")
        object.__setattr__(self, "itl", tuple(self.itl))

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def end(self) -> float:
        """When the request ended (arrival + e2e), or its arrival if it has no e2e."""
        return self.arrival + (self.e2e or 0.0)


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; None leaves that metric unbounded. A request meets the
    SLO when it finished, passed the quality check, and is within every bound."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "e2e"):
            value = getattr(self, name)
            if value is not None:
                _nonneg(f"SLO.{name}", value)

    def met_by(self, r: LatencyRecord) -> bool:
        if not r.finished or not r.quality_ok:
            return False
        if self.ttft is not None and r.ttft > self.ttft:  # type: ignore[operator]
            return False
        if self.tpot is not None and r.tpot is not None and r.tpot > self.tpot:
            return False
        return self.e2e is None or r.e2e <= self.e2e  # type: ignore[operator]


def percentile(values: Iterable[float], q: float, method: str = "linear") -> float:
    """The ``q``-th percentile (``0 <= q <= 100``) of ``values``; NaN when there are none.

    ``"nearest"``: nearest rank, ``sorted[max(ceil(q/100 * n), 1) - 1]`` (always an observed
    value). ``"linear"``: linear interpolation at position ``(n - 1) * q / 100`` (NumPy's
    default method).
    """
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be a number in [0, 100], got {q!r}")
    if method not in ("nearest", "linear"):
        raise ValueError(f"percentile: method must be 'nearest' or 'linear', got {method!r}")
    xs = sorted(values)
    if not xs:
        return math.nan
    if method == "nearest":
        return xs[max(math.ceil(q / 100 * len(xs)), 1) - 1]
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class GoodputReport:
    """What :func:`evaluate_slo` found. Rates are per second of ``window_s``."""

    slo: SLO
    window_s: float
    warmup_s: float
    measured: int                       # requests that arrived after the warm-up
    finished: int                       # of them, finished (at any time)
    met: int                            # finished, quality ok, within every bound
    quality_failed: int                 # finished but failed the quality check
    failures: dict[str, int] = field(default_factory=dict)   # FailureKind value -> count
    output_tokens: int = 0              # of the requests counted in ``completed``
    percentile_method: str = "linear"
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    completed: int | None = None        # finished within the window (None: all ``finished``)
    completed_met: int | None = None    # of those, met the SLO (None: all ``met``)

    @property
    def offered(self) -> float:
        """Measured requests per second of the window: the rate the load was offered at."""
        return self.measured / self.window_s

    @property
    def goodput(self) -> float:
        """Requests per second completed within the window that met the SLO."""
        return (self.met if self.completed_met is None else self.completed_met) / self.window_s

    @property
    def goodput_by_arrival(self) -> float:
        """Requests per second of the window that arrived in it and met the SLO, whenever they
        completed: attainment x offered rate. Free of the in-flight requests that ``goodput``
        loses at the window's end, but not a completion rate: compare it with the offered rate,
        never with ``throughput``."""
        return self.met / self.window_s

    @property
    def throughput(self) -> float:
        """Requests per second completed within the window (whether or not they met the SLO)."""
        return (self.finished if self.completed is None else self.completed) / self.window_s

    @property
    def token_throughput(self) -> float:
        """Output tokens of the completed requests per second."""
        return self.output_tokens / self.window_s

    @property
    def attainment(self) -> float:
        """Fraction of measured requests (failures included) that met the SLO; NaN if none."""
        return self.met / self.measured if self.measured else math.nan

    def as_dict(self) -> dict:
        return {
            "slo": {"ttft_s": self.slo.ttft, "tpot_s": self.slo.tpot, "e2e_s": self.slo.e2e},
            "window_s": self.window_s, "warmup_s": self.warmup_s, "measured": self.measured,
            "finished": self.finished, "met_slo": self.met, "quality_failed": self.quality_failed,
            "failures": dict(self.failures), "goodput_req_s": self.goodput,
            "throughput_req_s": self.throughput, "offered_req_s": self.offered,
            "output_tok_s": self.token_throughput,
            "attainment": self.attainment, "percentile_method": self.percentile_method,
            "latency_s": self.latency,
        }


PERCENTILES = (50, 90, 99)


def arrival_window(records: Sequence[LatencyRecord], warmup_s: float = 0.0) -> float:
    """Seconds from ``warmup_s`` to the last arrival among records arriving after it: the
    span over which the load was offered (the final drain excluded). ValueError if no record
    arrives after the warm-up."""
    arrivals = [r.arrival for r in records if r.arrival >= warmup_s]
    if not arrivals:
        raise ValueError(f"no request arrives after the warm-up ({warmup_s} s)")
    return max(arrivals) - warmup_s


def evaluate_slo(records: Sequence[LatencyRecord], slo: SLO, *,
                 window_s: float | str | None = None,
                 warmup_s: float = 0.0, percentile_method: str = "linear",
                 percentiles: Sequence[float] = PERCENTILES) -> GoodputReport:
    """Goodput, attainment, failures by kind and latency percentiles of ``records``.

    Records arriving before ``warmup_s`` are excluded. ``window_s``: the measurement window's
    length in seconds; ``"arrivals"`` for :func:`arrival_window` (the drain excluded: only
    requests completed by the last arrival count towards throughput and goodput, see the module
    docstring); default from ``warmup_s`` to the latest arrival or end among measured records.
    ValueError for a non-positive window or an unknown window name, a negative warm-up, or
    records that are not :class:`LatencyRecord`.
    """
    if not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO, got {type(slo).__name__}")
    _nonneg("warmup_s", warmup_s)
    if not all(isinstance(r, LatencyRecord) for r in records):
        raise TypeError("records must be LatencyRecord objects")
    measured = [r for r in records if r.arrival >= warmup_s]
    closes = math.inf                   # completions after this time are not counted
    if isinstance(window_s, str):
        if window_s != "arrivals":
            raise ValueError(f"window must be a number of seconds or 'arrivals', got "
                             f"{window_s!r}")
        window_s = arrival_window(measured, warmup_s)
        closes = warmup_s + window_s
    elif window_s is None:
        window_s = max((r.end for r in measured), default=warmup_s) - warmup_s
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) \
            or not window_s > 0 or math.isinf(window_s):
        raise ValueError(f"window must be positive, got {window_s!r}")
    done = [r for r in measured if r.finished]
    failures = {k.value: 0 for k in FailureKind}
    for r in measured:
        if not r.finished:
            failures[r.status] += 1
    latency: dict[str, dict[str, float]] = {}
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in r.itl],
        "e2e": [r.e2e for r in done],
    }
    for name, xs in series.items():
        stats = {f"p{q:g}": percentile(xs, q, percentile_method) for q in percentiles}
        stats["mean"] = sum(xs) / len(xs) if xs else math.nan
        latency[name] = stats
    completed = [r for r in done if r.end <= closes]
    return GoodputReport(
        slo=slo, window_s=float(window_s), warmup_s=float(warmup_s), measured=len(measured),
        finished=len(done), met=sum(slo.met_by(r) for r in done),
        quality_failed=sum(not r.quality_ok for r in done), failures=failures,
        output_tokens=sum(r.output_tokens for r in completed),
        percentile_method=percentile_method, latency=latency, completed=len(completed),
        completed_met=sum(slo.met_by(r) for r in completed))
