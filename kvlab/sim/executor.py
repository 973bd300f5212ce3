"""The simulator: the engine's own step loop on a simulated clock, each step priced by a roofline.

:class:`CostModelExecutor` is the :class:`~kvlab.core.interfaces.Executor` of the simulator: it
charges a step the time a :class:`~kvlab.sim.costmodel.RooflineCostModel` gives it and produces
each sampled token with a token function instead of a model. :func:`simulate` runs
:class:`~kvlab.core.engine_core.EngineCore` (the same loop as the real engine) with it, adding
requests when their arrival time comes. No tensors are touched, so the scheduler and KV manager
that the real engine uses can be studied with thousands of requests on a laptop.

Tokens are not a model's: the next token is a cheap deterministic function of the request's
length (outputs end by ``max_tokens``; EOS is ignored), which is all scheduling needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.engine_core import EngineCore
from kvlab.core.request import RequestStatus, RuntimeRequest
from kvlab.core.step_records import ModelOutput, SchedulerOutput
from kvlab.sim.costmodel import RooflineCostModel, StepCost
from kvlab.sim.workload import RequestSpec, to_request


class SimClock:
    """Simulated time in seconds; only moves forward."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def advance(self, seconds: float) -> float:
        if seconds < 0 or math.isnan(seconds):
            raise ValueError(f"cannot advance the clock by {seconds!r} s")
        self.now += seconds
        return self.now

    def jump_to(self, t: float) -> float:
        if t < self.now:
            raise ValueError(f"cannot move the clock back from {self.now} to {t}")
        self.now = float(t)
        return self.now

    def __call__(self) -> float:
        return self.now


def sim_token(request: RuntimeRequest) -> int:
    """The simulator's token source: cheap and deterministic (never 0, 1 or 2)."""
    return 3 + (request.num_tokens * 7919) % 30000


TokenFn = Callable[[RuntimeRequest], int]


class CostModelExecutor:
    """An executor without a model: tokens from ``token_fn(request)``, time from ``cost``.

    ``requests`` looks a request up by id (the scheduler's ``get_request``). ``cost=None``
    charges nothing (a pure token driver). ``padding(output) -> [(num_tokens, start_pos)]``,
    if given, is dummy work the scheduler makes the GPU do (a static batch's padding); it is
    priced like real tokens. ``info`` of the result is ``(StepCost | None, padding tokens)``.
    """

    def __init__(self, requests: Callable[[str], RuntimeRequest], token_fn: TokenFn = sim_token,
                 cost: RooflineCostModel | None = None,
                 padding: Callable[[SchedulerOutput], Sequence[tuple[int, int]]] | None = None):
        self.requests = requests
        self.token_fn = token_fn
        self.cost = cost
        self.padding = padding

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        sampled = {c.request_id: self.token_fn(self.requests(c.request_id))
                   for c in output.chunks if c.sample}
        pad = list(self.padding(output)) if self.padding is not None else []
        step: StepCost | None = None
        seconds = 0.0
        if self.cost is not None:
            step = self.cost.step_cost(output.chunks, pad)
            seconds = step.seconds if not output.is_empty else 0.0
        return ModelOutput(sampled, seconds, (step, sum(n for n, _ in pad)))


@dataclass
class RequestRecord:
    """What happened to one request, in simulated seconds."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    deadline: float | None = None
    first_token: float | None = None
    finish: float | None = None
    status: str = "waiting"
    finish_reason: str | None = None
    num_preemptions: int = 0
    output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)

    @property
    def normalized_latency(self) -> float | None:
        """End-to-end latency per output token (Orca's and vLLM's latency metric)."""
        if self.e2e is None or not self.output_tokens:
            return None
        return self.e2e / self.output_tokens


@dataclass(frozen=True)
class StepRecord:
    """One simulated step: its chunks as ``(request_id, num_tokens, is_prefill)``."""

    step: int
    start: float
    duration: float
    chunks: tuple[tuple[str, int, bool], ...]
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    padding_tokens: int = 0
    bound: str = "memory"

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.chunks)


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class SimResult:
    """Per-request and per-step records of a simulation, and summary metrics."""

    requests: list[RequestRecord]
    steps: list[StepRecord] = field(default_factory=list)
    makespan: float = 0.0
    num_steps: int = 0

    def record(self, request_id: str) -> RequestRecord:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)

    def summary(self) -> dict[str, float]:
        """Throughput (output tokens/s, requests/s over the makespan) and latency percentiles
        (seconds) over finished requests, plus counts of rejections and preemptions."""
        done = [r for r in self.requests if r.status == "finished"]
        out_tokens = sum(r.output_tokens for r in done)
        span = self.makespan or math.nan

        def pct(attr: str, q: float) -> float:
            return _percentile([getattr(r, attr) for r in done if getattr(r, attr) is not None],
                               q)

        return {
            "finished": float(len(done)),
            "rejected": float(sum(r.status == "rejected" for r in self.requests)),
            "preemptions": float(sum(r.num_preemptions for r in self.requests)),
            "steps": float(self.num_steps),
            "makespan_s": self.makespan,
            "throughput_tok_s": out_tokens / span,
            "throughput_req_s": len(done) / span,
            "ttft_p50_s": pct("ttft", 50),
            "ttft_p99_s": pct("ttft", 99),
            "e2e_p50_s": pct("e2e", 50),
            "e2e_p99_s": pct("e2e", 99),
            "tpot_p50_s": pct("tpot", 50),
            "norm_latency_mean_s": (sum(r.normalized_latency for r in done) / len(done)
                                    if done else math.nan),
            "norm_latency_p50_s": pct("normalized_latency", 50),
        }


def simulate(
    scheduler: Any,
    workload: Sequence[RequestSpec],
    cost: RooflineCostModel,
    *,
    shared_prefix: int = 0,
    token_fn: TokenFn = sim_token,
    record_steps: bool = True,
    max_steps: int = 10_000_000,
    until: float | None = None,
) -> SimResult:
    """Run ``workload`` through ``scheduler`` on a simulated clock priced by ``cost``.

    ``scheduler`` is any :class:`~kvlab.core.interfaces.Scheduler` (it may also offer
    ``padding(output) -> [(num_tokens, start_pos)]`` for dummy work it makes the GPU do, as a
    static batch does). The loop is :class:`~kvlab.core.engine_core.EngineCore`'s, with a
    :class:`CostModelExecutor`. ``until``: stop at that simulated time (unfinished requests
    stay unfinished in the records). RuntimeError if the scheduler makes no progress while it
    still has requests and no arrival is pending (a policy bug), or after ``max_steps``.
    """
    specs = sorted(workload, key=lambda s: (s.arrival_time, s.request_id))
    records = {s.request_id: RequestRecord(s.request_id, s.arrival_time, s.prompt_len,
                                           s.output_len, s.deadline) for s in specs}
    clock = SimClock()
    executor = CostModelExecutor(scheduler.get_request, token_fn, cost,
                                 getattr(scheduler, "padding", None))
    core = EngineCore(scheduler, executor)
    steps: list[StepRecord] = []
    i = step = 0
    idle_in_a_row = 0
    while i < len(specs) or core.has_unfinished_requests():
        if until is not None and clock.now >= until:
            break
        while i < len(specs) and specs[i].arrival_time <= clock.now:
            core.add_request(to_request(specs[i], shared_prefix=shared_prefix))
            i += 1
        if not core.has_unfinished_requests():
            clock.jump_to(specs[i].arrival_time)
            continue
        step += 1
        if step > max_steps:
            raise RuntimeError(f"simulation not done after {max_steps} steps")
        result = core.step()
        out = result.output
        start = clock.now
        if out.is_empty:
            idle_in_a_row += 1
            if i < len(specs):
                clock.jump_to(max(clock.now, specs[i].arrival_time))
            elif idle_in_a_row > 2 and not out.rejected:
                raise RuntimeError("scheduler made no progress with requests left and no "
                                   "arrivals pending")
        else:
            idle_in_a_row = 0
            clock.advance(result.model.seconds)
        now = clock.now
        for rid in result.model.sampled:
            rec = records[rid]
            rec.output_tokens += 1
            if rec.first_token is None:
                rec.first_token = now
        for req in result.ended:
            rec = records[req.request_id]
            rec.finish = now
            rec.status = req.status.value
            rec.finish_reason = req.finish_reason.value if req.finish_reason else None
            rec.num_preemptions = req.num_preemptions
        if record_steps:
            cost_of_step, padding_tokens = result.model.info
            steps.append(StepRecord(
                step=out.step, start=start, duration=clock.now - start,
                chunks=tuple((ch.request_id, ch.num_tokens, ch.is_prefill) for ch in out.chunks),
                admitted=out.admitted, preempted=out.preempted,
                finished=tuple(r.request_id for r in result.ended
                               if r.status == RequestStatus.FINISHED),
                padding_tokens=padding_tokens, bound=cost_of_step.bound))
    for req in scheduler.requests():   # the ones still running or waiting
        rec = records.get(req.request_id)
        if rec is not None:
            rec.num_preemptions = req.num_preemptions
            if not req.status.is_terminal:
                rec.status = req.status.value
    return SimResult(list(records.values()), steps, clock.now, step)
