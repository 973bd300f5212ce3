"""Runtime request lifecycle: the allowed-transition table, idempotent ends, and an event log.

The reference :class:`kvlab.core.request.Request` has six phases and no resources. A runtime
request (:class:`~kvlab.core.scheduler_api.RuntimeRequest`) also holds a KV block table, and it
can be *preempted*: its KV is taken back and it waits to recompute, keeping its generated
tokens. This module owns every status change of a runtime request:

* :data:`TRANSITIONS` is the allowed-transition table. :meth:`Lifecycle.transition` raises
  :class:`IllegalTransition` on any other move and changes nothing.
* Ending is idempotent. Moving a request to the terminal status it already has is a no-op;
  :meth:`Lifecycle.cancel` of a request that already ended (a late abort) is a no-op that returns
  ``False``; :meth:`Lifecycle.release` of a request that holds no KV returns ``False``.
* Every transition and every KV acquisition/release is appended to an :class:`EventLog` in
  write-ahead order: the *intent* is logged before the KV manager is touched and the *outcome*
  after it (``acquire_failed`` when the manager refused, e.g. out of blocks). After a crash at
  any point, :mod:`kvlab.core.recovery` replays the durable prefix of the log to decide which
  requests may still hold KV, and frees exactly the orphans.

Which resources each status holds (checked by the schedulers' ``check_invariants``):

======================  ========  =========================================================
status                  holds KV  queue
======================  ========  =========================================================
WAITING                 no        waiting
PREFILL, DECODE         yes       running
PREEMPTED               no        waiting (keeps its output tokens; recomputes them)
FINISHED, CANCELLED,    no        none (terminal; the KV was released exactly once)
FAILED, REJECTED
======================  ========  =========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .scheduler_api import FinishReason, RequestStatus, RuntimeRequest

S = RequestStatus

TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.WAITING: frozenset({S.PREFILL, S.CANCELLED, S.FAILED, S.REJECTED}),
    S.PREFILL: frozenset({S.DECODE, S.FINISHED, S.PREEMPTED, S.CANCELLED, S.FAILED}),
    S.DECODE: frozenset({S.FINISHED, S.PREEMPTED, S.CANCELLED, S.FAILED}),
    S.PREEMPTED: frozenset({S.PREFILL, S.CANCELLED, S.FAILED}),
    S.FINISHED: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset(),
    S.REJECTED: frozenset(),
}
"""Allowed moves of a runtime request. A terminal status has no way out."""

RUNNING_STATUSES = frozenset({S.PREFILL, S.DECODE})
WAITING_STATUSES = frozenset({S.WAITING, S.PREEMPTED})

# The finish reason each terminal status carries, when the caller does not name one.
_DEFAULT_REASON = {
    S.CANCELLED: FinishReason.ABORT,
    S.FAILED: FinishReason.ERROR,
    S.REJECTED: FinishReason.REJECTED,
}
_ALLOWED_REASONS = {
    S.FINISHED: frozenset({FinishReason.STOP, FinishReason.LENGTH}),
    S.CANCELLED: frozenset({FinishReason.ABORT}),
    S.FAILED: frozenset({FinishReason.ERROR}),
    S.REJECTED: frozenset({FinishReason.REJECTED}),
}


def holds_kv(status: RequestStatus) -> bool:
    """Whether a request in ``status`` owns a KV block table (only running ones do)."""
    return status in RUNNING_STATUSES


class IllegalTransition(ValueError):
    """A status change that :data:`TRANSITIONS` does not allow; nothing was changed."""


class SimulatedCrash(RuntimeError):
    """Raised by :class:`EventLog` when its ``crash_at`` index is reached (fault injection)."""


@dataclass(frozen=True)
class Event:
    """One durable record. ``kind`` is one of :data:`EVENT_KINDS`; ``data`` is plain values."""

    index: int
    kind: str
    request_id: str
    data: tuple[Any, ...] = ()
    step: int = 0             # the scheduler step in which it was written


EVENT_KINDS = frozenset({
    "add",        # data: (request template,)  a frozen copy of the request as submitted
    "transition",  # data: (src status value, dst status value, finish reason value | None)
    "acquire",    # data: (kind,)  intent: about to create/extend the KV table ("admit"/"fork")
    "acquired",   # data: (kind, num_computed_tokens)  the manager holds the table; KV of that
                  #       many leading tokens is already written (cached prefix, or the parent's)
    "acquire_failed",  # data: (kind, exception type name)  the manager refused the acquisition
                  #       (e.g. MemoryError) and is unchanged: the request holds no KV
    "release",    # data: ()  intent: about to free the request's KV
    "released",   # data: (freed: bool,)  the KV manager no longer holds the table
    "progress",   # data: (num_computed_tokens, sampled token | None)  after a step's output
})


@dataclass
class EventLog:
    """Append-only write-ahead log of request events.

    ``crash_at``: when set, appending the event with that index raises :class:`SimulatedCrash`
    *instead of* writing it, so the durable log is ``events[:crash_at]`` and nothing the caller
    meant to do after that append happens. Used to test recovery at every point of a run.
    The schedulers :meth:`compact` the log now and then (ended, released requests), so it stays
    proportional to the live requests, like a write-ahead log truncated at checkpoints.
    """

    events: list[Event] = field(default_factory=list)
    crash_at: int | None = None
    next_index: int = -1       # index of the next event (events may have been compacted)

    def __post_init__(self) -> None:
        if self.next_index < 0:
            self.next_index = self.events[-1].index + 1 if self.events else 0

    def append(self, kind: str, request_id: str, data: tuple[Any, ...] = (),
               step: int = 0) -> Event:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {sorted(EVENT_KINDS)}")
        index = self.next_index
        if self.crash_at is not None and index >= self.crash_at:
            raise SimulatedCrash(f"simulated crash before event {index} ({kind} {request_id})")
        event = Event(index, kind, request_id, tuple(data), step)
        self.events.append(event)
        self.next_index += 1
        return event

    def compact(self, request_ids: set[str]) -> int:
        """Drop every event of ``request_ids`` (a checkpoint: call it only for requests that
        ended and whose KV release completed, which recovery would ignore anyway). Indices of
        the remaining events are kept. Returns the number of events dropped."""
        before = len(self.events)
        self.events = [e for e in self.events if e.request_id not in request_ids]
        return before - len(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def durable(self) -> list[Event]:
        """The events that survived (all of them: a crash stops appends, it loses nothing)."""
        return list(self.events)


Listener = Callable[[RuntimeRequest, RequestStatus, RequestStatus], None]


class Lifecycle:
    """Applies status changes to runtime requests, logging each one first (write-ahead).

    ``step`` is a callable returning the scheduler's current step, used to stamp
    ``finished_step``. Every method validates before mutating: on an exception the request and
    the log are unchanged (except :class:`SimulatedCrash`, which models the process dying).
    """

    def __init__(self, log: EventLog | None = None, step: Callable[[], int] = lambda: 0):
        self.log = log if log is not None else EventLog()
        self._step = step

    def _append(self, kind: str, request_id: str, data: tuple[Any, ...] = ()) -> Event:
        return self.log.append(kind, request_id, data, self._step())

    # -- transitions -------------------------------------------------------------------------

    def check(self, request: RuntimeRequest, target: RequestStatus) -> bool:
        """True if ``request`` may move to ``target``, False if it is already there and the move
        is an idempotent no-op; raises :class:`IllegalTransition` otherwise."""
        if not isinstance(target, RequestStatus):
            raise TypeError(f"target must be a RequestStatus, got {target!r}")
        if request.status == target and target.is_terminal:
            return False
        if target not in TRANSITIONS[request.status]:
            raise IllegalTransition(
                f"request {request.request_id!r}: illegal transition "
                f"{request.status.value} -> {target.value}"
            )
        return True

    def transition(
        self,
        request: RuntimeRequest,
        target: RequestStatus,
        reason: FinishReason | None = None,
        message: str | None = None,
    ) -> bool:
        """Move ``request`` to ``target``; returns False for an idempotent terminal repeat.

        Terminal targets record a finish reason (``reason`` or the status's default; FINISHED
        requires STOP or LENGTH). ``message`` is kept in ``status_message`` (e.g. why a request
        was rejected). The move is logged before it is applied.
        """
        if not self.check(request, target):
            return False
        if target.is_terminal:
            reason = reason if reason is not None else _DEFAULT_REASON.get(target)
            if reason not in _ALLOWED_REASONS[target]:
                raise ValueError(
                    f"request {request.request_id!r}: finish reason {reason!r} does not fit "
                    f"status {target.value}"
                )
        elif reason is not None:
            raise ValueError(f"a non-terminal status ({target.value}) takes no finish reason")
        self._append(
            "transition",
            request.request_id,
            (request.status.value, target.value, reason.value if reason else None),
        )
        request.status = target
        if target.is_terminal:
            request.finish_reason = reason
            request.finished_step = self._step()
        if message is not None:
            request.status_message = message
        if target == S.PREEMPTED:
            request.num_preemptions += 1
        return True

    def finish(self, request: RuntimeRequest, reason: FinishReason) -> bool:
        """End a running request with STOP or LENGTH. Idempotent: False if already finished."""
        return self.transition(request, S.FINISHED, reason)

    def cancel(self, request: RuntimeRequest) -> bool:
        """Cancel (client abort). A request that already ended is left alone: returns False."""
        if request.status.is_terminal:
            return False
        return self.transition(request, S.CANCELLED, FinishReason.ABORT)

    def fail(self, request: RuntimeRequest, message: str) -> bool:
        """Mark a request FAILED (ERROR) with ``message``; False if it already ended."""
        if request.status.is_terminal:
            return False
        return self.transition(request, S.FAILED, FinishReason.ERROR, message)

    def reject(self, request: RuntimeRequest, message: str) -> bool:
        """Refuse a waiting request at admission, with the reason in ``status_message``."""
        return self.transition(request, S.REJECTED, FinishReason.REJECTED, message)

    # -- resources ---------------------------------------------------------------------------

    def add(self, request: RuntimeRequest) -> None:
        """Log the arrival of ``request`` (a template copy, so recovery can rebuild it)."""
        self._append("add", request.request_id, (request_template(request),))

    def acquire(self, request: RuntimeRequest, kind: str, action: Callable[[], int]) -> int:
        """Run ``action`` (a KV-manager call creating the table) between intent and outcome.

        ``action`` returns how many leading tokens already have KV in the new table (the cached
        prefix for an admission, the parent's computed tokens for a fork). If it raises (e.g.
        MemoryError; the KV manager's mutations are all-or-nothing, so it is unchanged) the
        compensating outcome ``acquire_failed`` is logged and the exception re-raised: every
        intent in the log gets an outcome, and recovery reads the request as holding no KV.
        Only a crash *during* the action leaves the intent alone, which recovery reads as "may
        or may not hold KV: ask the manager".
        """
        self._append("acquire", request.request_id, (kind,))
        try:
            cached = action()
        except Exception as error:
            self._append("acquire_failed", request.request_id, (kind, type(error).__name__))
            raise
        self._append("acquired", request.request_id, (kind, cached))
        return cached

    def release(self, request: RuntimeRequest, kv: Any) -> bool:
        """Free the request's KV exactly once. Idempotent: False when it held nothing.

        The intent is logged first, then ``kv.free`` (itself idempotent), then the outcome, so
        a crash anywhere leaves a log from which recovery can tell what to do.
        """
        if not kv.has(request.request_id):
            return False
        self._append("release", request.request_id)
        freed = kv.free(request.request_id)
        self._append("released", request.request_id, (bool(freed),))
        return bool(freed)

    def progress(self, request: RuntimeRequest, token: int | None) -> None:
        """Log that a step's output was applied: ``num_computed_tokens`` and the sampled token."""
        self._append("progress", request.request_id, (request.num_computed_tokens, token))


def request_template(request: RuntimeRequest) -> RuntimeRequest:
    """A fresh copy of ``request`` as it was submitted: no outputs, no progress, WAITING."""
    from dataclasses import replace

    return replace(
        request,
        output_token_ids=[],
        num_computed_tokens=0,
        num_cached_tokens=0,
        status=S.WAITING,
        finish_reason=None,
        num_preemptions=0,
        status_message=None,
        admitted_step=None,
        first_token_step=None,
        finished_step=None,
    )
