"""A runtime request (token ids only; the runner owns its sampling) and its state machine:
:class:`Lifecycle` makes every status change, checked against :data:`TRANSITIONS`, with
idempotent ends, and logs each one write-ahead when a :class:`RequestLog` is attached (opt-in,
chapter 5's crash recovery). Only a RUNNING request holds KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.core.radix_cache import scope_key
from kvlab.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheManager


class RequestStatus(Enum):
    """Where a runtime request is. Exactly one at any moment (spec rule 5)."""

    WAITING = "waiting"        # queued, holds no KV
    RUNNING = "running"        # holds a block table; prefilling or decoding (is_decoding)
    PREEMPTED = "preempted"    # KV taken back; waits to recompute, keeps its generated tokens
    FINISHED = "finished"      # terminal: stop token or length
    CANCELLED = "cancelled"    # terminal: aborted by the client
    FAILED = "failed"          # terminal: an error while running
    REJECTED = "rejected"      # terminal: refused at admission (can never fit, or overload)
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # parked for transferred KV (remote_kv)

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED,
                               RequestStatus.FAILED, RequestStatus.REJECTED})


class FinishReason(str, Enum):
    """Why a request ended. ``stop``, ``length`` and ``abort`` are vLLM's ``finish_reason``
    values (the first two also OpenAI's); ``error`` and ``rejected`` are kvlab's additions."""

    STOP = "stop"          # a stop token (or EOS) was generated
    LENGTH = "length"      # max_tokens reached (or the model's context)
    ABORT = "abort"        # cancelled by the client
    ERROR = "error"        # failed while running
    REJECTED = "rejected"  # refused at admission


@dataclass
class RuntimeRequest:
    """A request as the scheduler sees it: token ids, budgets, stop conditions. The first
    ``num_computed_tokens`` of ``prompt_token_ids + output_token_ids`` have KV in its block
    table. ``sampling_params`` and ``seed`` are carried for the executor (the scheduler never
    reads them; :class:`~kvlab.core.step_records.NewRequest` takes them there)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    scope: tuple = ()                       # prefix-cache compatibility scope (spec rule 4)
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    priority: int = 0                       # lower value = more important (as in vLLM)
    deadline: float | None = None          # absolute time on the engine's clock, seconds
    arrival_time: float = 0.0
    max_model_len: int | None = None        # context limit; reaching it finishes with LENGTH
    sampling_params: SamplingParams | None = None
    seed: int | None = None                 # the sampler's stream (sample i of n: seed + i)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0              # prompt tokens served by the prefix cache at admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Filled in by the scheduler (the engine may read them; it should not write them):
    status_message: str | None = None       # why it was rejected / failed (human readable)
    num_output_placeholders: int = 0        # trailing outputs still in flight (overlap mode)
    arrival_seq: int = 0                    # arrival order (the scheduler's stable tie-breaker)
    admit_seq: int = 0                      # order of the latest admission (preemption victims)
    arrival_step: int | None = None         # scheduler step counter when add_request ran
    admitted_step: int | None = None        # step that first gave it KV (kept across preemption)
    first_token_step: int | None = None     # step whose output carried its first sampled token
    finished_step: int | None = None        # step in which it reached a terminal status

    def check_new(self) -> None:
        """ValueError naming the field unless this is a well-formed, fresh request (the
        scheduler's boundary, ``add_request``, calls it)."""
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty str, got {rid!r}")
        prompt = self.prompt_token_ids
        if not isinstance(prompt, tuple):
            raise ValueError(f"request {rid!r}: prompt_token_ids must be a tuple of ints, got "
                             f"{type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"request {rid!r} has an empty prompt")
        for i, token in enumerate(prompt):
            if type(token) is not int or token < 0:
                raise ValueError(f"request {rid!r}: prompt_token_ids[{i}] must be an int >= 0, "
                                 f"got {token!r}")

        def nat(value: object, least: int = 0) -> bool:
            return type(value) is int and value >= least

        eos, stops, deadline = self.eos_token_id, self.stop_token_ids, self.deadline
        for ok, field_, want in (
                (nat(self.max_tokens, 1), "max_tokens", "an int >= 1"),
                (self.max_model_len is None or nat(self.max_model_len, 1), "max_model_len",
                 "None or an int >= 1"),
                (isinstance(stops, (set, frozenset)) and all(nat(t) for t in stops),
                 "stop_token_ids", "a frozenset of ints >= 0"),
                (eos is None or nat(eos), "eos_token_id", "None or an int >= 0"),
                (isinstance(self.ignore_eos, bool), "ignore_eos", "a bool"),
                (type(self.priority) is int, "priority", "an int"),
                (deadline is None or (isinstance(deadline, (int, float)) and deadline == deadline
                                      and not isinstance(deadline, bool)),
                 "deadline", "None or a number")):
            if not ok:
                raise ValueError(f"request {rid!r}: {field_} must be {want}, "
                                 f"got {getattr(self, field_)!r}")
        try:
            scope_key(self.scope)
        except TypeError as error:
            raise ValueError(f"request {rid!r}: bad scope: {error}") from None
        if (self.status != RequestStatus.WAITING or self.output_token_ids
                or self.num_computed_tokens or self.finish_reason is not None):
            raise ValueError(
                f"request {rid!r} must be fresh (WAITING, no outputs, nothing computed)")

    @property
    def is_decoding(self) -> bool:
        """Running, and only its last sampled token lacks KV (derived, never stored)."""
        return (self.status is RequestStatus.RUNNING and bool(self.output_token_ids)
                and self.num_computed_tokens == self.num_tokens - 1)

    @property
    def phase(self) -> str:
        """``"prefill"`` or ``"decode"`` while running, else the status value."""
        if self.status is not RequestStatus.RUNNING:
            return self.status.value
        return "decode" if self.is_decoding else "prefill"

    @property
    def max_kv_slots(self) -> int:
        """KV slots the request can ever occupy: every token but the last one sampled."""
        final = self.num_prompt_tokens + self.max_tokens
        if self.max_model_len is not None:
            final = min(final, self.max_model_len)
        return final - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def known_output_token_ids(self) -> list[int]:
        """The outputs sampled so far, without the placeholders of steps still in flight."""
        n = len(self.output_token_ids) - self.num_output_placeholders
        return self.output_token_ids[:n]

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """``all_token_ids[start:end]`` in O(end - start)."""
        if not 0 <= start <= end:
            raise ValueError(f"token_slice needs 0 <= start <= end, got {start}, {end}")
        prompt = self.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return tuple(self.output_token_ids[start - p:end - p])
        return prompt[start:] + tuple(self.output_token_ids[:end - p])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens


#: An output token a step in flight will produce (overlap scheduling): the scheduler plans the
#: next step with it, the executor puts the real token in its place.
PLACEHOLDER = -1


def stop_reason(request: RuntimeRequest, num_outputs: int | None = None
                ) -> FinishReason | None:
    """STOP (stop token, or EOS unless ``ignore_eos``), LENGTH (``max_tokens`` or
    ``max_model_len`` reached) or None for a running request's latest sampled token (with
    ``num_outputs``: for its output ``num_outputs - 1``, the outputs after it still in flight)."""
    n = len(request.output_token_ids) if num_outputs is None else num_outputs
    if request.status != RequestStatus.RUNNING or not n:
        return None
    token = request.output_token_ids[n - 1]
    if token in request.stop_token_ids or (token == request.eos_token_id
                                           and not request.ignore_eos):
        return FinishReason.STOP
    if n >= request.max_tokens:
        return FinishReason.LENGTH
    if request.max_model_len is not None and request.num_prompt_tokens + n >= request.max_model_len:
        return FinishReason.LENGTH
    return None


S = RequestStatus

TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.WAITING: frozenset({S.RUNNING, S.CANCELLED, S.FAILED, S.REJECTED,
                          S.WAITING_FOR_REMOTE_KV}),
    S.WAITING_FOR_REMOTE_KV: frozenset({S.WAITING, S.CANCELLED, S.FAILED}),
    S.RUNNING: frozenset({S.FINISHED, S.PREEMPTED, S.CANCELLED, S.FAILED}),
    S.PREEMPTED: frozenset({S.RUNNING, S.CANCELLED, S.FAILED}),
    **{terminal: frozenset() for terminal in (S.FINISHED, S.CANCELLED, S.FAILED, S.REJECTED)},
}
RUNNING_STATUSES = frozenset({S.RUNNING})
WAITING_STATUSES = frozenset({S.WAITING, S.PREEMPTED})

_DEFAULT_REASON = {S.CANCELLED: FinishReason.ABORT, S.FAILED: FinishReason.ERROR,
                   S.REJECTED: FinishReason.REJECTED}
ALLOWED_REASONS = {
    S.FINISHED: frozenset({FinishReason.STOP, FinishReason.LENGTH}),
    S.CANCELLED: frozenset({FinishReason.ABORT}),
    S.FAILED: frozenset({FinishReason.ERROR}),
    S.REJECTED: frozenset({FinishReason.REJECTED}),
}


def holds_kv(status: RequestStatus) -> bool:
    """Only a running request owns a KV block table."""
    return status in RUNNING_STATUSES


class IllegalTransition(ValueError):
    """A status change that :data:`TRANSITIONS` does not allow; nothing was changed."""


class RequestLog(Protocol):
    """A write-ahead log of request events (chapter 5's ``EventLog`` in
    :mod:`kvlab.labs.recovery.event_log`): :class:`Lifecycle` appends, the scheduler compacts
    the events of requests that ended and hold no KV."""

    def append(self, kind: str, request_id: str, data: tuple[Any, ...], step: int) -> None: ...
    def __len__(self) -> int: ...
    def request_ids(self) -> set[str]: ...
    def compact(self, request_ids: set[str], step: int | None = None) -> int: ...


class Lifecycle:
    """Applies status changes, logging each first (write-ahead) when a :class:`RequestLog` is
    attached. ``step()`` stamps ``finished_step``. Validates before mutating: on an exception
    the request and the log are unchanged."""

    def __init__(self, log: RequestLog | None = None, step: Callable[[], int] = lambda: 0):
        self.log = log
        self._step = step

    def _append(self, kind: str, request_id: str, data: tuple[Any, ...] = ()) -> None:
        if self.log is not None:
            self.log.append(kind, request_id, data, self._step())

    def check(self, request: RuntimeRequest, target: RequestStatus) -> bool:
        """True: a legal move; False: an idempotent terminal repeat; else IllegalTransition."""
        if not isinstance(target, RequestStatus):
            raise TypeError(f"target must be a RequestStatus, got {target!r}")
        if request.status == target and target.is_terminal:
            return False
        if target not in TRANSITIONS[request.status]:
            raise IllegalTransition(f"request {request.request_id!r}: illegal transition "
                                    f"{request.status.value} -> {target.value}")
        return True

    def transition(self, request: RuntimeRequest, target: RequestStatus,
                   reason: FinishReason | None = None, message: str | None = None) -> bool:
        """Move ``request`` to ``target`` (False: an idempotent terminal repeat). A terminal
        target records ``reason`` (default per status); ``message`` goes to ``status_message``."""
        if not self.check(request, target):
            return False
        if target.is_terminal:
            reason = reason if reason is not None else _DEFAULT_REASON.get(target)
            if reason not in ALLOWED_REASONS[target]:
                raise ValueError(f"request {request.request_id!r}: finish reason {reason!r} "
                                 f"does not fit status {target.value}")
        elif reason is not None:
            raise ValueError(f"a non-terminal status ({target.value}) takes no finish reason")
        self._append("transition", request.request_id,   # the message survives a crash
                     (request.status.value, target.value, reason.value if reason else None)
                     + ((message,) if message is not None else ()))
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

    def add(self, request: RuntimeRequest) -> None:
        """Log the arrival of ``request`` (a template copy, so recovery can rebuild it)."""
        if self.log is not None:
            self._append("add", request.request_id, (request_template(request),))

    def acquire(self, request: RuntimeRequest, kind: str, action: Callable[[], int]) -> int:
        """Run ``action`` (a KV-manager call creating the table; returns the tokens that
        already have KV) between a logged intent and its outcome; a raise logs
        ``acquire_failed`` and re-raises, so every intent gets an outcome (chapter 5)."""
        self._append("acquire", request.request_id, (kind,))
        try:
            cached = action()
        except Exception as error:
            self._append("acquire_failed", request.request_id, (kind, type(error).__name__))
            raise
        self._append("acquired", request.request_id, (kind, cached))
        return cached

    def release(self, request: RuntimeRequest, kv: KVCacheManager) -> bool:
        """Free the request's KV exactly once (False: it held nothing); intent and outcome
        are logged around ``kv.free``."""
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
    return replace(request, output_token_ids=[], num_computed_tokens=0, num_cached_tokens=0,
                   status=S.WAITING, finish_reason=None, num_preemptions=0, status_message=None,
                   admitted_step=None, first_token_step=None, finished_step=None)
