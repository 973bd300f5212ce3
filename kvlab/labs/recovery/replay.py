"""Replay the event log: check every record, then rebuild every request from it.

:func:`replay` is pure (it touches no KV manager and does not change the events it reads) and
refuses, with :class:`~kvlab.labs.recovery.event_log.CorruptLog` naming the first bad record, any
log
that is not exactly what a :class:`~kvlab.core.request.Lifecycle` could have written before a
crash. Recovery replays before it changes anything, so a refused log changes nothing.

The checks, in the order they are made:

1. **Records.** Each is an :class:`~kvlab.labs.recovery.event_log.Event` with fields of the right
   types,
   a known ``kind``, and a ``checksum`` that matches its fields. At most one ``checkpoint``.
2. **Global order.** Indices strictly increase. Gaps are allowed only below the checkpoint and
   must add up to the count it records (the events compaction dropped); there are none above
   it, and none at all without a checkpoint. Steps never decrease.
3. **Per-request order.** A request's events are numbered 0, 1, 2, ... with no gap or repeat;
   event 0 is its one and only ``add``. An event of a request never added is refused.
4. **Data and meaning.** Each kind's data has its arity and types, and must make sense for
   the request as replayed so far: a transition starts from the replayed status and is allowed
   by :data:`~kvlab.core.request.TRANSITIONS` (finish reason included); an outcome
   (``acquired``, ``acquire_failed``, ``released``) answers an open intent; the move to
   RUNNING follows a completed acquisition; FINISHED comes with the stop condition the
   replayed outputs meet (:func:`met_stop`); ``progress`` comes while running with KV, never
   lowers the computed count within one admission, never passes the request's tokens, carries
   a token exactly when the computed count reaches the request's end, and adds no token past
   ``max_tokens`` or a stop condition.

An intent with no outcome (``acquire`` or ``release`` as a request's latest KV event) is what a
crash leaves behind: the request's KV is then ``"maybe"`` and recovery asks the manager.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvlab.core.checks import is_int
from kvlab.core.request import (
    ALLOWED_REASONS,
    RUNNING_STATUSES,
    TRANSITIONS,
    WAITING_STATUSES,
    FinishReason,
    RequestStatus,
    RuntimeRequest,
    request_template,
    stop_reason,
)
from kvlab.labs.recovery.event_log import EVENT_KINDS, LOG_ID, CorruptLog, Event

S = RequestStatus
ACQUIRE_KINDS = frozenset({"admit", "fork"})
_STATUS_VALUES = frozenset(s.value for s in S)
_REASON_VALUES = frozenset(r.value for r in FinishReason)


@dataclass
class ReplayedRequest:
    """What the log says about one request.

    ``kv`` is ``"none"`` (no table, or its release completed), ``"held"`` (acquisition
    completed, no release started) or ``"maybe"`` (an acquisition or release was in progress:
    ``intent`` says which). ``admit_index`` is the log index of its latest admission (running
    order), -1 if none. ``next_seq`` is the per-request sequence number its next event needs.
    """

    request: RuntimeRequest
    kv: str = "none"
    admit_index: int = -1
    intent: str | None = None          # "acquire" or "release" while kv == "maybe"
    acquire_kind: str | None = None    # the kind of the open (or last) acquisition
    next_seq: int = 1


def replay(events: Iterable[Event]) -> dict[str, ReplayedRequest]:
    """Check the whole log, then rebuild every request in arrival order. Pure.

    Raises :class:`CorruptLog` (see the module docstring for the checks).
    """
    records = list(events)
    checkpoint = _check_records(records)
    return _Replayer(checkpoint).run(records)


def met_stop(request: RuntimeRequest) -> FinishReason | None:
    """The stop condition the request's last sampled token meets (as if decoding), or None.

    A request is finished exactly when this is not None; a token past it is never sampled.
    """
    if not request.output_token_ids:
        return None
    return stop_reason(replace(request, status=S.RUNNING))


def _is_int(value: object, low: int | None = 0) -> bool:
    """An int (not a bool) that is at least ``low`` (no bound when ``low`` is None)."""
    return is_int(value) and (low is None or value >= low)


def _fail(event: Any, problem: str) -> CorruptLog:
    return CorruptLog(getattr(event, "index", "?"), getattr(event, "request_id", "?"),
                      getattr(event, "kind", "?"), problem)


def _check_records(records: list[Any]) -> Event | None:
    """Check 1 (each record on its own); returns the checkpoint record, if any."""
    checkpoint = None
    for position, event in enumerate(records):
        if not isinstance(event, Event):
            raise CorruptLog(f"#{position}", "?", "?",
                             f"not an Event record: {type(event).__name__}")
        if not (_is_int(event.index) and _is_int(event.seq) and _is_int(event.step)
                and isinstance(event.kind, str) and isinstance(event.request_id, str)
                and isinstance(event.data, tuple) and _is_int(event.checksum)):
            raise _fail(event, "a field has the wrong type (index, seq, step and checksum are "
                               "ints >= 0, kind and request_id strs, data a tuple)")
        try:
            expected = event.expected_checksum()
        except TypeError as error:
            raise _fail(event, f"data is not plain values ({error})") from None
        if event.checksum != expected:
            raise _fail(event, f"bad checksum {event.checksum:#010x} (the record's fields give "
                               f"{expected:#010x}): the record changed after it was written")
        if event.kind not in EVENT_KINDS:
            raise _fail(event, f"unknown kind; expected one of {sorted(EVENT_KINDS)}")
        if (event.kind == "checkpoint") != (event.request_id == LOG_ID):
            raise _fail(event, f"only checkpoint records use the log-level id {LOG_ID!r}")
        if event.kind == "checkpoint":
            if checkpoint is not None:
                raise _fail(event, f"a second checkpoint (after event {checkpoint.index}); "
                                   "compaction keeps only the latest")
            if len(event.data) != 1 or not _is_int(event.data[0]):
                raise _fail(event, "checkpoint data must be (number of events dropped,)")
            checkpoint = event
    return checkpoint


class _Replayer:
    """Checks 2 to 4 while rebuilding the requests; one ``_on_<kind>`` method per kind."""

    def __init__(self, checkpoint: Event | None) -> None:
        self.checkpoint = checkpoint
        self.state: dict[str, ReplayedRequest] = {}

    def run(self, records: list[Event]) -> dict[str, ReplayedRequest]:
        previous: Event | None = None
        for position, event in enumerate(records):
            self._check_order(event, previous, position)
            if event.kind != "checkpoint":
                getattr(self, f"_on_{event.kind}")(event, self._entry(event))
            previous = event
        return self.state

    # -- check 2: global order -----------------------------------------------------------------

    def _check_order(self, event: Event, previous: Event | None, position: int) -> None:
        last = previous.index if previous is not None else -1
        if event.index <= last:
            what = "duplicate" if event.index == last else "out-of-order"
            raise _fail(event, f"{what} index (the previous record is event {last})")
        checkpoint = self.checkpoint
        below = checkpoint is not None and event.index <= checkpoint.index
        if event.index != last + 1 and not below:   # gaps below a checkpoint: counted there
            raise _fail(event, f"index gap: events {last + 1}..{event.index - 1} are missing "
                               "and no checkpoint accounts for them")
        if event is checkpoint:
            missing = event.index - position
            if missing != event.data[0]:
                raise _fail(event, f"{missing} events are missing below this checkpoint, but "
                                   f"it records {event.data[0]} dropped by compaction")
        if previous is not None and event.step < previous.step:
            raise _fail(event, f"step {event.step} goes back (the previous record has step "
                               f"{previous.step})")

    # -- check 3: per-request order ------------------------------------------------------------

    def _entry(self, event: Event) -> ReplayedRequest | None:
        """The replayed request ``event`` belongs to (None for an ``add``), after check 3."""
        rid = event.request_id
        entry = self.state.get(rid)
        if event.kind == "add":
            if entry is not None:
                raise _fail(event, "a second add of this request id")
            if event.seq != 0:
                raise _fail(event, f"an add must be its request's event 0, got seq {event.seq}")
            return None
        if entry is None:
            raise _fail(event, "event of a request that was never added (or was compacted)")
        if event.seq < entry.next_seq:
            raise _fail(event, f"per-request seq {event.seq} repeats or goes back (expected "
                               f"{entry.next_seq})")
        if event.seq > entry.next_seq:
            raise _fail(event, f"per-request gap: seq {event.seq} follows {entry.next_seq - 1} "
                               "(events of this request are missing)")
        entry.next_seq += 1
        return entry

    # -- check 4: each kind ----------------------------------------------------------------------

    def _on_add(self, event: Event, _entry: None) -> None:
        problem = _template_problem(event.data, event.request_id)
        if problem:
            raise _fail(event, problem)
        request = request_template(event.data[0])
        request.arrival_step = event.step
        self.state[event.request_id] = ReplayedRequest(request)

    def _on_transition(self, event: Event, entry: ReplayedRequest) -> None:
        data, request = event.data, entry.request
        if (len(data) not in (3, 4) or (len(data) == 4 and not isinstance(data[3], str))
                or data[0] not in _STATUS_VALUES or data[1] not in _STATUS_VALUES
                or not (data[2] is None or data[2] in _REASON_VALUES)):
            raise _fail(event, f"transition data must be (status, status, reason | None), got "
                               f"{data!r}")
        src, dst = S(data[0]), S(data[1])
        reason = FinishReason(data[2]) if data[2] is not None else None
        if src != request.status:
            raise _fail(event, f"source status {src.value} is not the replayed status "
                               f"{request.status.value}")
        if dst not in TRANSITIONS[src]:
            raise _fail(event, f"TRANSITIONS forbids {src.value} -> {dst.value}")
        if dst.is_terminal and reason not in ALLOWED_REASONS[dst]:
            raise _fail(event, f"finish reason {data[2]!r} does not fit status {dst.value}")
        if not dst.is_terminal and reason is not None:
            raise _fail(event, f"a move to {dst.value} takes no finish reason")
        if dst == S.RUNNING and entry.kv != "held":
            raise _fail(event, "admitted (-> running) without a completed KV acquisition")
        if dst == S.FINISHED and met_stop(request) != reason:
            raise _fail(event, f"finished ({data[2]}), but the replayed request meets stop "
                               f"condition {met_stop(request)}")
        request.status = dst
        if len(data) == 4:
            request.status_message = data[3]
        if dst.is_terminal:
            request.finish_reason = reason
            request.finished_step = event.step
        if dst == S.RUNNING:
            entry.admit_index = event.index
            if request.admitted_step is None:
                request.admitted_step = event.step
        if dst == S.PREEMPTED:
            request.num_preemptions += 1
            request.num_computed_tokens = 0

    def _on_acquire(self, event: Event, entry: ReplayedRequest) -> None:
        if len(event.data) != 1 or event.data[0] not in ACQUIRE_KINDS:
            raise _fail(event, f"acquire data must be ('admit' | 'fork',), got {event.data!r}")
        if entry.request.status not in WAITING_STATUSES:
            raise _fail(event, f"acquisition for a {entry.request.status.value} request")
        if entry.kv == "held":
            raise _fail(event, "acquisition while the request holds KV")
        entry.kv, entry.intent, entry.acquire_kind = "maybe", "acquire", event.data[0]

    def _check_outcome(self, event: Event, entry: ReplayedRequest, intent: str) -> None:
        if entry.intent != intent:
            raise _fail(event, f"{event.kind} without an open {intent} intent")
        if intent == "acquire" and event.data[:1] != (entry.acquire_kind,):
            raise _fail(event, f"{event.kind} kind {event.data[:1]!r} does not match the "
                               f"intent's {entry.acquire_kind!r}")

    def _on_acquired(self, event: Event, entry: ReplayedRequest) -> None:
        data, request = event.data, entry.request
        if len(data) != 2 or not _is_int(data[1]):
            raise _fail(event, f"acquired data must be (kind, computed tokens >= 0), got {data!r}")
        self._check_outcome(event, entry, "acquire")
        if data[1] > request.num_tokens:
            raise _fail(event, f"{data[1]} computed tokens, but the request has "
                               f"{request.num_tokens}")
        entry.kv, entry.intent = "held", None
        request.num_computed_tokens = data[1]
        if data[0] == "admit" and request.admitted_step is None:
            request.num_cached_tokens = data[1]

    def _on_acquire_failed(self, event: Event, entry: ReplayedRequest) -> None:
        if len(event.data) != 2 or not isinstance(event.data[1], str):
            raise _fail(event, f"acquire_failed data must be (kind, error name), got "
                               f"{event.data!r}")
        self._check_outcome(event, entry, "acquire")
        entry.kv, entry.intent = "none", None   # the manager refused and is unchanged

    def _on_release(self, event: Event, entry: ReplayedRequest) -> None:
        if event.data != ():
            raise _fail(event, f"release data must be (), got {event.data!r}")
        if entry.kv == "none":
            raise _fail(event, "release of a request that holds no KV")
        if entry.request.status in RUNNING_STATUSES:
            raise _fail(event, f"release of a {entry.request.status.value} (running) request")
        entry.kv, entry.intent = "maybe", "release"

    def _on_released(self, event: Event, entry: ReplayedRequest) -> None:
        if len(event.data) != 1 or not isinstance(event.data[0], bool):
            raise _fail(event, f"released data must be (freed: bool,), got {event.data!r}")
        self._check_outcome(event, entry, "release")
        entry.kv, entry.intent = "none", None

    def _on_progress(self, event: Event, entry: ReplayedRequest) -> None:
        data, request = event.data, entry.request
        if len(data) != 2 or not _is_int(data[0]) or not (data[1] is None or _is_int(data[1])):
            raise _fail(event, f"progress data must be (computed tokens >= 0, token >= 0 | "
                               f"None), got {data!r}")
        computed, token = data
        if request.status not in RUNNING_STATUSES or entry.kv != "held":
            raise _fail(event, f"progress of a {request.status.value} request with KV "
                               f"{entry.kv!r} (only running requests holding KV progress)")
        if computed < request.num_computed_tokens:
            raise _fail(event, f"computed count goes back from {request.num_computed_tokens} "
                               f"to {computed} within one admission")
        if computed > request.num_tokens:
            raise _fail(event, f"{computed} computed tokens, but the request has "
                               f"{request.num_tokens}")
        if (token is not None) != (computed == request.num_tokens):
            raise _fail(event, f"a token is sampled exactly when the computed count reaches the "
                               f"request's end ({computed} of {request.num_tokens}, token "
                               f"{token!r})")
        if token is not None:
            if len(request.output_token_ids) >= request.max_tokens:
                raise _fail(event, f"a token past max_tokens={request.max_tokens}")
            if met_stop(request) is not None:
                raise _fail(event, "a token after the request met its stop condition")
            request.output_token_ids.append(token)
            if request.first_token_step is None:
                request.first_token_step = event.step
        request.num_computed_tokens = computed


def _template_problem(data: tuple[Any, ...], rid: str) -> str | None:
    """Why ``data`` is not ``(template,)`` of a fresh, well-formed request ``rid`` (or None)."""
    if len(data) != 1 or not isinstance(data[0], RuntimeRequest):
        return f"add data must be (RuntimeRequest template,), got {data!r}"
    t = data[0]
    if t.request_id != rid:
        return f"the template's request_id {t.request_id!r} is not the record's"
    prompt = t.prompt_token_ids
    if not (isinstance(prompt, tuple) and prompt and all(_is_int(x) for x in prompt)):
        return "the template's prompt_token_ids must be a non-empty tuple of ints >= 0"
    if not _is_int(t.max_tokens, 1):
        return f"the template's max_tokens must be an int >= 1, got {t.max_tokens!r}"
    if not (t.max_model_len is None or _is_int(t.max_model_len, 1)):
        return f"the template's max_model_len must be None or an int >= 1, got {t.max_model_len!r}"
    if not (isinstance(t.stop_token_ids, (set, frozenset))
            and all(_is_int(x) for x in t.stop_token_ids)
            and (t.eos_token_id is None or _is_int(t.eos_token_id))):
        return "the template's stop_token_ids / eos_token_id must be ints >= 0"
    if (t.status != S.WAITING or t.output_token_ids != [] or t.num_computed_tokens != 0
            or t.finish_reason is not None):
        return "the template must be fresh (WAITING, no outputs, nothing computed, no reason)"
    return None
