"""EngineCore: the one step loop of kvlab — schedule, execute, update.

Every engine in kvlab runs this loop and no other: :class:`~kvlab.engine.llm_engine.LLMEngine`
with the :class:`~kvlab.engine.model_runner.ModelRunner` (the real model), the simulator with the
:class:`~kvlab.sim.executor.CostModelExecutor` (roofline time, tokens from a function), and the
chapters' drivers (:func:`kvlab.sim.tokens.drive`). One :meth:`EngineCore.step`:

1. ``output = scheduler.schedule()``: admissions, chunks, KV allocation, copy-on-write list;
2. ``result = executor.execute(output)``: the executor performs ``output.copies`` before any
   write, runs the chunks and samples one token for every chunk with ``sample=True``; the core
   then lifts the copies' fences (``kv.complete_copies``);
3. ``ended = scheduler.update_from_output(output, result.sampled)``: tokens appended, stop
   conditions applied, KV of ended requests released.

If ``execute`` raises, or ``update_from_output`` refuses its result (ValueError: a token
missing, extra or malformed; nothing was changed), ``scheduler.fail_step`` fails that step's
requests (FAILED / ERROR, KV released exactly once) and the exception propagates; the core
keeps serving, and the failed requests are reported by the next step.

Observers (:class:`StepObserver`, registered with :meth:`add_observer`; none by default) plug
into this one loop: ``before_execute`` after scheduling, ``after_step`` after the update,
``after_failed_step`` when a step failed; ``defer_copies`` returning True takes over lifting
that step's copy fences (it must do so before the next execute). The invariant monitor
(:mod:`kvlab.core.invariant_set`) and the fault injector (:mod:`kvlab.core.faults`) are
observers; a default engine has none, and the loop then calls nothing but the three steps.

Threading model: one thread calls :meth:`step`; any thread may call :meth:`add_request` and
:meth:`abort_request`. Each holds :attr:`lock` briefly. The executor runs *outside* the lock,
so requests can arrive while a step executes; an abort that arrives then is applied when the
step ends (the executor may still be reading the request's KV). A second :meth:`step` while
one runs raises :class:`EngineBusy` instead of corrupting state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .scheduler_api import RequestStatus, RuntimeRequest, Scheduler, SchedulerOutput


@dataclass
class ModelOutput:
    """What an executor returns for one step.

    ``sampled`` maps each request whose chunk had ``sample=True`` to its new token. ``seconds``
    is the step's duration on the executor's clock (modelled for the simulator, measured for
    the real model). ``info`` is executor-specific detail (logits shape, metadata, logprobs).
    """

    sampled: Mapping[str, int]
    seconds: float = 0.0
    info: Any = None


class Executor(Protocol):
    """Runs one step's decisions: copies first, then the chunks, then one sample per
    ``sample=True`` chunk. Must not change scheduler or KV-manager state."""

    def execute(self, output: SchedulerOutput) -> ModelOutput: ...


class StepObserver:
    """Base class of the engine core's observers: override the hooks you need (each default
    does nothing). Observers must not change scheduler state except as their hook allows."""

    def before_execute(self, core: EngineCore, output: SchedulerOutput) -> None:
        """After ``schedule()``, before the executor runs ``output``."""

    def defer_copies(self, core: EngineCore, output: SchedulerOutput) -> bool:
        """Return True to lift ``output.copies``' fences yourself (before the next execute)."""
        return False

    def after_step(self, core: EngineCore, result: StepResult) -> None:
        """After ``update_from_output()`` applied the step."""

    def after_failed_step(self, core: EngineCore, output: SchedulerOutput,
                          error: BaseException) -> None:
        """After the step was failed (the executor raised, or its output was refused)."""


class EngineBusy(RuntimeError):
    """``step()`` was called while another thread's ``step()`` is still running."""


@dataclass
class StepResult:
    """One step of the core: the scheduler's output, the executor's result and what ended.

    ``ended``: requests that reached a terminal status and were reported this step (finished,
    rejected, failed). ``aborted``: requests cancelled by aborts that arrived during the step.
    ``schedule_s`` / ``update_s``: wall time of the two scheduler calls.
    """

    output: SchedulerOutput
    model: ModelOutput
    ended: list[RuntimeRequest] = field(default_factory=list)
    aborted: list[RuntimeRequest] = field(default_factory=list)
    schedule_s: float = 0.0
    update_s: float = 0.0


class EngineCore:
    """The step loop over a :class:`~kvlab.core.scheduler_api.Scheduler` and an :class:`Executor`.

    ``forget_ended``: drop each request from the scheduler's registry once it has been reported
    (ended, or returned by an abort), so memory stays proportional to live requests and an
    ended id can be reused. Drivers that inspect requests after the run pass False.
    """

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
        if not isinstance(observer, StepObserver):
            raise TypeError(f"observers subclass StepObserver, got {type(observer).__name__}")
        self.observers.append(observer)

    # ------------------------------------------------------------------ requests
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

    # ------------------------------------------------------------------ the loop
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
