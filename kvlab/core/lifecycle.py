"""Runtime request lifecycle: the allowed-transition table, idempotent ends, and an event log.

The reference :class:`kvlab.reference.Request` has six phases and no resources. A runtime
request (:class:`~kvlab.core.scheduler_api.RuntimeRequest`) also holds a KV block table, and it
can be *preempted*: its KV is taken back and it waits to recompute, keeping its generated
tokens. This module owns every status change of a runtime request:

* :data:`TRANSITIONS` is the allowed-transition table. :meth:`Lifecycle.transition` raises
  :class:`IllegalTransition` on any other move and changes nothing.
* Ending is idempotent. Moving a request to the terminal status it already has is a no-op;
  :meth:`Lifecycle.cancel` of a request that already ended (a late abort) is a no-op that returns
  ``False``; :meth:`Lifecycle.release` of a request that holds no KV returns ``False``.
* With an :class:`EventLog` attached (opt-in: chapter 5's crash recovery; a default engine keeps
  none, so nothing is retained per request), every transition and every KV acquisition/release
  is appended to it in write-ahead order: the *intent* is logged before the KV manager is
  touched and the *outcome* after it (``acquire_failed`` when the manager refused, e.g. out of
  blocks). After a crash at any point, :mod:`kvlab.recovery` replays the durable prefix of
  the log to decide which requests may still hold KV, and frees exactly the orphans. The record
  format and its integrity data (sequence numbers, checksums, checkpoints) are in
  :mod:`kvlab.core.event_log`; the checks that refuse a corrupt log are in
  :mod:`kvlab.recovery.replay`.

Which resources each status holds (checked by the schedulers' ``check_invariants``):

======================  ========  =========================================================
status                  holds KV  queue
======================  ========  =========================================================
WAITING                 no        waiting
RUNNING                 yes       running (prefilling or decoding: derived from its
                                  token counts, ``RuntimeRequest.is_decoding``)
PREEMPTED               no        waiting (keeps its output tokens; recomputes them)
WAITING_FOR_REMOTE_KV   no        the remote-KV wrapper's own (kvlab.core.remote_kv): back
                                  to WAITING once its KV is installed or refused
FINISHED, CANCELLED,    no        none (terminal; the KV was released exactly once)
FAILED, REJECTED
======================  ========  =========================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .event_log import (  # re-exported: the log's format lives in event_log
    EVENT_KINDS,
    LOG_ID,
    CorruptLog,
    Event,
    EventLog,
    SimulatedCrash,
)
from .scheduler_api import FinishReason, RequestStatus, RuntimeRequest

__all__ = [
    "ALLOWED_REASONS", "EVENT_KINDS", "LOG_ID", "RUNNING_STATUSES", "TRANSITIONS",
    "WAITING_STATUSES", "CorruptLog", "Event", "EventLog", "IllegalTransition", "Lifecycle",
    "SimulatedCrash", "holds_kv", "request_template",
]

S = RequestStatus

TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.WAITING: frozenset({S.RUNNING, S.CANCELLED, S.FAILED, S.REJECTED,
                          S.WAITING_FOR_REMOTE_KV}),
    S.WAITING_FOR_REMOTE_KV: frozenset({S.WAITING, S.CANCELLED, S.FAILED}),
    S.RUNNING: frozenset({S.FINISHED, S.PREEMPTED, S.CANCELLED, S.FAILED}),
    S.PREEMPTED: frozenset({S.RUNNING, S.CANCELLED, S.FAILED}),
    S.FINISHED: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset(),
    S.REJECTED: frozenset(),
}
"""Allowed moves of a runtime request. A terminal status has no way out."""

RUNNING_STATUSES = frozenset({S.RUNNING})
WAITING_STATUSES = frozenset({S.WAITING, S.PREEMPTED})

# The finish reason each terminal status carries, when the caller does not name one.
_DEFAULT_REASON = {
    S.CANCELLED: FinishReason.ABORT,
    S.FAILED: FinishReason.ERROR,
    S.REJECTED: FinishReason.REJECTED,
}
ALLOWED_REASONS = {
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


Listener = Callable[[RuntimeRequest, RequestStatus, RequestStatus], None]


class Lifecycle:
    """Applies status changes to runtime requests, logging each one first (write-ahead) when
    an :class:`EventLog` is attached (``log=None``: no log, the moves are only checked).

    ``step`` is a callable returning the scheduler's current step, used to stamp
    ``finished_step``. Every method validates before mutating: on an exception the request and
    the log are unchanged (except :class:`SimulatedCrash`, which models the process dying).
    """

    def __init__(self, log: EventLog | None = None, step: Callable[[], int] = lambda: 0):
        self.log = log
        self._step = step

    def _append(self, kind: str, request_id: str, data: tuple[Any, ...] = ()) -> None:
        if self.log is not None:
            self.log.append(kind, request_id, data, self._step())

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
            if reason not in ALLOWED_REASONS[target]:
                raise ValueError(
                    f"request {request.request_id!r}: finish reason {reason!r} does not fit "
                    f"status {target.value}"
                )
        elif reason is not None:
            raise ValueError(f"a non-terminal status ({target.value}) takes no finish reason")
        self._append(
            "transition",
            request.request_id,
            (request.status.value, target.value, reason.value if reason else None)
            + ((message,) if message is not None else ()),   # the reason survives a crash
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
        if self.log is not None:
            self._append("add", request.request_id, (request_template(request),))

    def acquire(self, request: RuntimeRequest, kind: str, action: Callable[[], int]) -> int:
        """Run ``action`` (a KV-manager call creating the table) between intent and outcome.

        ``action`` returns how many leading tokens already have KV in the new table (the cached
        prefix for an admission, the parent's computed tokens for a fork). If it raises (e.g.
        OutOfBlocks; the KV manager's mutations are all-or-nothing, so it is unchanged) the
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
