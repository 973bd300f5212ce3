"""EngineCore: kvlab's one step loop (schedule, execute, update), and the observer hooks the
labs attach to it (:class:`StepObserver`; none by default).

The real engine, the simulator and the chapters' drivers all run :meth:`EngineCore.step`: the
scheduler sends :class:`SchedulerOutput` (chunks with block-table deltas, copies to run first),
the executor answers :class:`ModelOutput`; a step that raises fails its requests and the core
keeps serving. One thread steps; any thread may add or abort (an abort during a step applies
when it ends). Chapter 7 walks through it.

Overlap mode (vLLM's ``async_scheduling``) runs the same three calls one step apart: the
executor works on a worker thread while :meth:`EngineCore.step` plans the next step, the
scheduler standing in a placeholder for each token still being sampled (see
:meth:`~kvlab.core.scheduler.SchedulerBase.schedule`). It is the last section of this file.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvlab.core.interfaces import Executor, Scheduler
from kvlab.core.request import RequestStatus, RuntimeRequest
from kvlab.core.step_records import ModelOutput, SchedulerOutput


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
    requests); drivers that inspect requests after the run pass False.

    ``overlap`` (needs the scheduler's ``async_scheduling``): the executor runs each step on
    one worker thread, in the order planned, and :meth:`step` plans step n+1 while step n
    executes, then applies step n's output. The executor must read nothing but the
    scheduler's outputs. A failed step fails the step planned on it too; an abort between
    steps applies at once, even to a request in flight. Chapter 7."""

    def __init__(self, scheduler: Scheduler, executor: Executor, *,
                 forget_ended: bool = True, overlap: bool = False) -> None:
        config = getattr(scheduler, "config", None)
        if overlap and not getattr(config, "async_scheduling", False):
            raise ValueError("EngineCore(overlap=True) needs a scheduler built with "
                             "SchedulerConfig(async_scheduling=True): it plans a step while "
                             "the one before is still executing")
        self.scheduler = scheduler
        self.executor = executor
        self.forget_ended = forget_ended
        self.overlap = overlap
        self.lock = threading.RLock()
        self._stepping = False
        self._late_aborts: list[str] = []
        self._leaving: list[str] = []   # ended, to forget once no step in flight holds them
        self.observers: list[StepObserver] = []
        # overlap mode: the steps handed to the worker thread, oldest first (at most two)
        self._pipeline: deque[tuple[SchedulerOutput, Future[ModelOutput], float]] = deque()
        self._worker = ThreadPoolExecutor(1, "kvlab-step") if overlap else None

    def add_observer(self, observer: StepObserver) -> None:
        """Register an observer (see the module docstring); called in registration order."""
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

    def _claim_step(self) -> None:
        """Under the lock: mark a step as running; EngineBusy if one already is."""
        if self._stepping:
            raise EngineBusy("step() is already running in another thread: one thread "
                             "steps the engine; others may only add and abort requests")
        self._stepping = True

    def step(self) -> StepResult:
        """Schedule, execute, update (see the module docstring). EngineBusy if a step is
        already running; the executor's exception, after its step was failed, if it raises."""
        if self.overlap:
            return self._step_overlapped()
        with self.lock:
            self._claim_step()
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
                    self.scheduler.complete_copies(output.copies)
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
        """Drop ended requests from the registry (overlap mode: one a step in flight still
        holds is dropped once that step is applied)."""
        if not self.forget_ended:
            return
        leaving, self._leaving = [*self._leaving, *(r.request_id for r in requests)], []
        for rid in leaving:
            if self.scheduler.can_forget(rid):
                self.scheduler.forget(rid)
            elif rid in self.scheduler.inflight_ids:
                self._leaving.append(rid)

    # -- overlap mode (``async_scheduling``): the same three calls, one step apart ---------
    def _step_overlapped(self) -> StepResult:
        """Overlap mode's step: keep a step executing on the worker, plan the next one while
        it runs, then wait for the oldest and apply it (step n's update meets step n+1's
        execution). The executor runs the steps one at a time, in the order planned."""
        with self.lock:
            self._claim_step()
            try:
                if not self._pipeline:
                    self._launch()
                if self.scheduler.has_unfinished_requests():
                    self._launch()
            except BaseException:
                self._stepping = False
                raise
        output, future, schedule_s = self._pipeline[0]
        try:
            result = future.result()
        except BaseException as error:
            self._fail_pipeline(error, f"step {output.step} failed: {type(error).__name__}: "
                                       f"{error}")
            raise
        with self.lock:
            if output.copies:
                deferred = [o.defer_copies(self, output) for o in self.observers]
                if not any(deferred):
                    self.scheduler.complete_copies(output.copies)
            t1 = time.perf_counter()
            try:
                ended = self.scheduler.update_from_output(output, result.sampled)
            except ValueError as error:   # the executor's result broke the protocol
                bad = error
            else:
                update_s = time.perf_counter() - t1
                self._pipeline.popleft()
                self._forget(ended)
                aborted = self._end_step()
                step_result = StepResult(output, result, ended, aborted, schedule_s, update_s)
                for observer in self.observers:
                    observer.after_step(self, step_result)
                return step_result
        self._fail_pipeline(bad, f"step {output.step}: bad executor output: {bad}")
        raise bad

    def _launch(self) -> None:
        """Plan a step and hand it to the worker."""
        assert self._worker is not None
        t0 = time.perf_counter()
        output = self.scheduler.schedule()
        schedule_s = time.perf_counter() - t0
        for observer in self.observers:
            observer.before_execute(self, output)
        self._pipeline.append((output, self._worker.submit(self.executor.execute, output),
                               schedule_s))

    def _fail_pipeline(self, error: BaseException, message: str) -> None:
        """The oldest step failed (``message``): its requests fail, and so do those of the
        step planned on it (it ran on the failed step's placeholders), once it has run."""
        wait([f for _, f, _ in self._pipeline])   # outside the lock: the executor may abort
        with self.lock:
            failed = [output for output, _, _ in self._pipeline]
            self._pipeline.clear()
            for output in failed:
                self.scheduler.fail_step(output, message if output is failed[0] else (
                    f"step {output.step} failed: planned on step {failed[0].step}, which "
                    f"failed: {type(error).__name__}: {error}"))
            self._end_step()
            for output in failed:
                for observer in self.observers:
                    observer.after_failed_step(self, output, error)

    def has_steps_in_flight(self) -> bool:
        """Overlap mode: whether a step handed to the executor is still to be applied."""
        return bool(self._pipeline)

    def wait_executed(self) -> None:
        """Overlap mode: return once the executor has run every step handed to it (their
        outputs not yet applied), so that its state may be read; at once otherwise."""
        wait([f for _, f, _ in list(self._pipeline)])
