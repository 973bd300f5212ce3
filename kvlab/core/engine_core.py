"""EngineCore: kvlab's one step loop (schedule, execute, update) and the records that cross it.

The real engine, the simulator and the chapters' drivers all run :meth:`EngineCore.step`: the
scheduler sends :class:`SchedulerOutput` (chunks with block-table deltas, copies to run first),
the executor answers :class:`ModelOutput`; a step that raises fails its requests and the core
keeps serving. One thread steps; any thread may add or abort (an abort during a step applies
when it ends). Chapter 7 walks through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .request import RequestStatus, RuntimeRequest

if TYPE_CHECKING:
    from .interfaces import Executor, Scheduler, StepObserver


@dataclass(frozen=True)
class ScheduledChunk:
    """Work for one request in one step: feed ``token_ids`` at positions ``start_pos...``.

    The table travels as a delta (vLLM v1's ``new_block_ids``): the first ``num_kept_blocks``
    entries of the table last sent, then ``new_block_ids``. ``sample``: its last logits give the
    next token. ``num_lookahead`` (:mod:`.spec_plan`): draft slots verified in the same forward.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    new_block_ids: tuple[int, ...]
    sample: bool
    is_prefill: bool
    num_lookahead: int = 0
    num_kept_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_query_tokens(self) -> int:
        """Tokens this chunk may put through the forward: its own plus the lookahead."""
        return len(self.token_ids) + self.num_lookahead


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decisions; ``copies`` are (src_block, dst_block) KV copies to run first."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    copies: tuple[tuple[int, int], ...] = ()
    preempted: tuple[str, ...] = ()        # request ids preempted (KV released) this step:
                                           # their tables are gone (resent whole on resume)
    admitted: tuple[str, ...] = ()         # request ids given a KV table this step (first
                                           # admission, or re-admission after a preemption)
    rejected: tuple[str, ...] = ()         # request ids refused at admission this step
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def check_sampled(output: SchedulerOutput, sampled: Mapping[str, Any]
                  ) -> dict[str, tuple[int, ...]]:
    """``request id -> tokens`` of one step's executor answer: an int >= 0 for each chunk with
    ``sample=True`` (a tuple of 1..num_lookahead+1 with lookahead), nothing for the others.
    ValueError names the first problem."""
    expected = {c.request_id: c for c in output.chunks if c.sample}
    missing = set(expected) - set(sampled)
    extra = set(sampled) - set(expected)
    if missing:
        raise ValueError(f"no sampled token for {sorted(missing)}")
    if extra:
        raise ValueError(f"sampled tokens for requests that did not sample: {sorted(extra)}")
    tokens: dict[str, tuple[int, ...]] = {}
    for rid, chunk in expected.items():
        got = sampled[rid]
        seq = tuple(got) if isinstance(got, (tuple, list)) else (got,)
        if not 1 <= len(seq) <= chunk.num_lookahead + 1:
            raise ValueError(f"{rid!r}: {len(seq)} tokens for a chunk with "
                             f"{chunk.num_lookahead} lookahead slots")
        for token in seq:
            if type(token) is not int or token < 0:
                raise ValueError(f"sampled token for {rid!r} must be an int >= 0, got {token!r}")
        tokens[rid] = seq
    return tokens


@dataclass
class ModelOutput:
    """An executor's answer for one step. ``sampled``: request id -> its new tokens, for each
    chunk with ``sample=True`` (one; up to ``num_lookahead + 1`` when it speculated; a bare int
    is accepted for one). Per token, where the executor computes them: ``logprobs`` and
    ``top_logprobs`` (a dict, or None when not asked). ``drafts``: request id -> (drafts
    proposed, accepted). ``seconds`` on the executor's clock; ``info``: its own trace of the
    step (timings, metadata) for observers and figures."""

    sampled: Mapping[str, tuple[int, ...] | int]
    seconds: float = 0.0
    info: object = None
    logprobs: Mapping[str, list[float]] = field(default_factory=dict)
    top_logprobs: Mapping[str, list[dict[int, float] | None]] = field(default_factory=dict)
    drafts: Mapping[str, tuple[int, int]] = field(default_factory=dict)


class EngineBusy(RuntimeError):
    """``step()`` was called while another thread's ``step()`` is still running."""


@dataclass
class StepResult:
    """One step: the scheduler's output, the executor's answer, the requests that ended
    (reported this step) or were aborted during it, and the two scheduler calls' wall time."""

    output: SchedulerOutput
    model: ModelOutput
    ended: list[RuntimeRequest] = field(default_factory=list)
    aborted: list[RuntimeRequest] = field(default_factory=list)
    schedule_s: float = 0.0
    update_s: float = 0.0


class EngineCore:
    """The step loop over a :class:`Scheduler` and an :class:`Executor`. ``forget_ended``:
    drop each request from the scheduler's registry once reported (memory follows the live
    requests); drivers that inspect requests after the run pass False."""

    def __init__(self, scheduler: Scheduler, executor: Executor, *,
                 forget_ended: bool = True) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.forget_ended = forget_ended
        self.lock = threading.RLock()
        self._stepping = False
        self._late_aborts: list[str] = []
        self.observers: list[StepObserver] = []

    def add_observer(self, observer: StepObserver) -> None:
        """Register an observer (see the module docstring); called in registration order."""
        from .interfaces import StepObserver

        if not isinstance(observer, StepObserver):
            raise TypeError(f"observers subclass StepObserver, got {type(observer).__name__}")
        self.observers.append(observer)

    def add_request(self, request: RuntimeRequest) -> None:
        """Queue ``request`` (the scheduler validates it; on error nothing changed)."""
        with self.lock:
            self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RuntimeRequest | None:
        """Cancel a request. Idempotent; None for an unknown id. During a step the abort is
        applied when the step ends, and the request is returned as it is now."""
        with self.lock:
            if self._stepping:
                request = self.scheduler.find_request(request_id)
                if request is not None and request_id not in self._late_aborts:
                    self._late_aborts.append(request_id)
                return request
            request = self.scheduler.abort_request(request_id)
            self._forget([request] if request is not None else [])
            return request

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            return self.scheduler.has_unfinished_requests()

    def step(self) -> StepResult:
        """Schedule, execute, update (see the module docstring). EngineBusy if a step is
        already running; the executor's exception, after its step was failed, if it raises."""
        with self.lock:
            if self._stepping:
                raise EngineBusy("step() is already running in another thread: one thread "
                                 "steps the engine; others may only add and abort requests")
            self._stepping = True
            try:
                t0 = time.perf_counter()
                output = self.scheduler.schedule()
                schedule_s = time.perf_counter() - t0
            except BaseException:
                self._stepping = False
                raise
        try:
            for observer in self.observers:
                observer.before_execute(self, output)
            result = self.executor.execute(output)
            if output.copies:
                deferred = [o.defer_copies(self, output) for o in self.observers]
                if not any(deferred):
                    self.scheduler.kv.complete_copies(output.copies)
        except BaseException as error:
            with self.lock:
                self.scheduler.fail_step(
                    output, f"step {output.step} failed: {type(error).__name__}: {error}")
                self._end_step()
                for observer in self.observers:
                    observer.after_failed_step(self, output, error)
            raise
        with self.lock:
            try:
                t1 = time.perf_counter()
                try:
                    ended = self.scheduler.update_from_output(output, result.sampled)
                except ValueError as error:   # the executor's result broke the protocol
                    self.scheduler.fail_step(output, f"step {output.step}: bad executor "
                                                     f"output: {error}")
                    raise
                update_s = time.perf_counter() - t1
                self._forget(ended)
            finally:
                aborted = self._end_step()
            step_result = StepResult(output, result, ended, aborted, schedule_s, update_s)
            for observer in self.observers:
                observer.after_step(self, step_result)
        return step_result

    def _end_step(self) -> list[RuntimeRequest]:
        """Apply the aborts that arrived during the step; the next step may start."""
        aborted = []
        for rid in self._late_aborts:
            request = self.scheduler.abort_request(rid)
            if request is not None and request.status is RequestStatus.CANCELLED:
                aborted.append(request)
        self._late_aborts = []
        self._stepping = False
        self._forget(aborted)
        return aborted

    def _forget(self, requests: list[RuntimeRequest]) -> None:
        if not self.forget_ended:
            return
        for request in requests:
            if self.scheduler.can_forget(request.request_id):
                self.scheduler.forget(request.request_id)
