"""The write-ahead event log of runtime requests, with integrity data on every record.

:class:`~kvlab.core.request.Lifecycle` appends one :class:`Event` per status change, KV
acquisition/release and step result; :mod:`kvlab.labs.recovery` replays the log after a crash.
A log that recovery cannot trust must be *refused*, not replayed into wrong tokens, so every
record carries three pieces of integrity data:

``index``
    A global sequence number: 0, 1, 2, ... in append order, never reused.
``seq``
    A per-request sequence number: 0 for the request's ``add``, then 1, 2, ... for each of its
    later events. Compaction drops *whole* requests, so the surviving requests' sequences stay
    contiguous and checkable.
``checksum``
    ``zlib.crc32`` of a canonical encoding (:func:`canonical`) of
    ``(index, seq, kind, request_id, step, data)``. A record changed after it was written (a
    flipped bit, a field edited by hand) no longer matches its checksum.

Compaction leaves gaps in the global index. To tell a legitimate gap from a lost event,
:meth:`EventLog.compact` writes a ``checkpoint`` record (request id ``""``, see :data:`LOG_ID`)
whose data is the number of events missing below its index. Only the latest checkpoint is kept,
so a valid log has at most one; below it the gaps add up to exactly that count, and above it
there are none. (A CRC detects accidents, not forgeries: a record rewritten together with a
fresh checksum is caught only by the semantic checks of :mod:`kvlab.labs.recovery.replay`.)
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import Enum
from typing import Any

from kvlab.core.checks import is_int

LOG_ID = ""
"""The ``request_id`` of log-level records (checkpoints); no request may use it."""

EVENT_KINDS = frozenset({
    "add",        # data: (request template,)  a frozen copy of the request as submitted
    "transition",  # data: (src status value, dst status value, finish reason value | None)
    "acquire",    # data: (kind,)  intent: about to create/extend the KV table ("admit"/"fork")
    "acquired",   # data: (kind, num_computed_tokens)  the manager holds the table; KV of that
                  #       many leading tokens is already written (cached prefix, or the parent's)
    "acquire_failed",  # data: (kind, exception type name)  the manager refused the acquisition
                  #       (e.g. OutOfBlocks) and is unchanged: the request holds no KV
    "release",    # data: ()  intent: about to free the request's KV
    "released",   # data: (freed: bool,)  the KV manager no longer holds the table
    "progress",   # data: (num_computed_tokens, sampled token | None)  after a step's output
    "checkpoint",  # data: (events dropped below this index,)  written by EventLog.compact only;
                  #       request_id is LOG_ID and seq counts the checkpoints written so far
})


class SimulatedCrash(RuntimeError):
    """Raised by :class:`EventLog` when its ``crash_at`` index is reached (fault injection)."""


class CorruptLog(ValueError):
    """A log that recovery must not replay. Raised before anything was changed.

    ``index``, ``request_id`` and ``kind`` name the offending record (as stored, so they may be
    the corrupted values); ``problem`` says what is wrong with it.
    """

    def __init__(self, index: Any, request_id: Any, kind: Any, problem: str) -> None:
        super().__init__(f"corrupt event log at event {index} ({kind} of request "
                         f"{request_id!r}): {problem}")
        self.index, self.request_id, self.kind, self.problem = index, request_id, kind, problem


def canonical(value: Any) -> str:
    """A deterministic text encoding of plain values, the input of the record checksum.

    Every value carries a type tag (so ``1``, ``True`` and ``"1"`` differ) and strings are
    length-prefixed (so no content can fake a separator). Enums encode by value, sets sorted,
    dataclasses field by field (:func:`dataclasses.fields`). Anything else is a TypeError: the
    log holds plain values only.
    """
    encode = _EXACT.get(type(value))   # the common plain types, without the isinstance chain
    if encode is not None:
        return encode(value)
    if value is None:
        return "N"
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, Enum):
        return f"e{type(value).__name__}:{canonical(value.value)}"
    if isinstance(value, int):
        return f"i{value}"
    if isinstance(value, float):
        return f"f{value!r}"
    if isinstance(value, str):
        return f"s{len(value)}:{value}"
    if isinstance(value, tuple):
        return "(" + ",".join(canonical(v) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(canonical(v) for v in value)) + "}"
    if is_dataclass(value) and not isinstance(value, type):
        body = ",".join(f"{f.name}={canonical(getattr(value, f.name))}" for f in fields(value))
        return f"d{type(value).__name__}({body})"
    raise TypeError(f"cannot encode a {type(value).__name__} in the event log: {value!r}")


_EXACT: dict[type, Any] = {
    type(None): lambda v: "N",
    bool: lambda v: "T" if v else "F",
    int: lambda v: f"i{v}",
    str: lambda v: f"s{len(v)}:{v}",
    float: lambda v: f"f{v!r}",
    tuple: lambda v: "(" + ",".join(canonical(x) for x in v) + ")",
}


def record_checksum(index: int, seq: int, kind: str, request_id: str, step: int,
                    data: tuple[Any, ...]) -> int:
    """The CRC-32 of one record's canonical encoding (see the module docstring)."""
    if not (is_int(index) and is_int(seq) and is_int(step)
            and isinstance(kind, str) and isinstance(request_id, str)):
        return zlib.crc32(canonical((index, seq, kind, request_id, step, data)).encode("utf-8"))
    return _typed_checksum(index, seq, kind, request_id, step, data)


def _typed_checksum(index: int, seq: int, kind: str, request_id: str, step: int,
                    data: tuple[Any, ...]) -> int:
    """:func:`record_checksum` for fields already known to be ints and strs: the same text,
    spelled out (the log's hot path)."""
    body = ",".join([f"i{v}" if type(v) is int else "N" if v is None else canonical(v)
                     for v in data])
    text = (f"(i{index},i{seq},s{len(kind)}:{kind},s{len(request_id)}:{request_id},"
            f"i{step},({body}))")
    return zlib.crc32(text.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class Event:
    """One durable record. ``kind`` is one of :data:`EVENT_KINDS`; ``data`` holds plain values.

    Build records with :meth:`EventLog.append` (or :func:`seal`), which fill in ``checksum``;
    a hand-built ``Event`` keeps the checksum it is given.
    """

    index: int
    kind: str
    request_id: str
    data: tuple[Any, ...] = ()
    step: int = 0             # the scheduler step in which it was written
    seq: int = 0              # position among this request's events (0 = its ``add``)
    checksum: int = 0         # record_checksum of the fields above

    def expected_checksum(self) -> int:
        """The checksum the record's current fields call for. TypeError if not encodable."""
        return record_checksum(self.index, self.seq, self.kind, self.request_id, self.step,
                               self.data)


def seal(event: Event) -> Event:
    """``event`` with the checksum its fields call for (used by the log, and by tests that
    build well-formed records with wrong contents)."""
    return replace(event, checksum=event.expected_checksum())


@dataclass
class EventLog:
    """Append-only write-ahead log of request events.

    ``crash_at``: when set, appending the event with that index raises :class:`SimulatedCrash`
    *instead of* writing it, so the durable log is the events with a smaller index and nothing
    the caller meant to do after that append happens. Used to test recovery at every point.
    The schedulers :meth:`compact` the log now and then (ended, released requests), so it stays
    proportional to the live requests, like a write-ahead log truncated at checkpoints.
    A log built from existing ``events`` (recovery does this) continues their numbering.
    """

    events: list[Event] = field(default_factory=list)
    crash_at: int | None = None
    next_index: int = -1       # index of the next event (events may have been compacted)
    _next_seq: dict[str, int] = field(default_factory=dict, init=False, repr=False,
                                      compare=False)   # per-request seq of the next event

    def __post_init__(self) -> None:
        if self.next_index < 0:
            self.next_index = self.events[-1].index + 1 if self.events else 0
        for event in self.events:
            self._next_seq[event.request_id] = event.seq + 1

    def append(self, kind: str, request_id: str, data: tuple[Any, ...] = (),
               step: int = 0) -> Event:
        """Write one record of ``request_id`` and return it. ValueError (nothing written) for
        an unknown kind, a checkpoint (only :meth:`compact` writes those), a bad request id or
        step, or data that is not plain values."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {sorted(EVENT_KINDS)}")
        if kind == "checkpoint":
            raise ValueError("checkpoint records are written by EventLog.compact only")
        if not isinstance(request_id, str) or request_id == LOG_ID:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        return self._write(kind, request_id, tuple(data), step)

    def _write(self, kind: str, request_id: str, data: tuple[Any, ...], step: int) -> Event:
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        index = self.next_index
        seq = self._next_seq.get(request_id, 0)
        try:
            checksum = _typed_checksum(index, seq, kind, request_id, step, data)
        except TypeError as error:
            raise ValueError(f"event data must be plain values: {error}") from None
        if self.crash_at is not None and index >= self.crash_at:
            raise SimulatedCrash(f"simulated crash before event {index} ({kind} {request_id})")
        event = Event(index, kind, request_id, data, step, seq, checksum)
        self.events.append(event)
        self.next_index += 1
        self._next_seq[request_id] = seq + 1
        return event

    def compact(self, request_ids: set[str], step: int | None = None) -> int:
        """Drop every event of ``request_ids`` (call it only for requests that ended and whose
        KV release completed, which recovery would ignore anyway) and record the drop.

        Writes one ``checkpoint`` record (stamped ``step``, default: the last event's step)
        saying how many events are missing below its index; the previous checkpoint is dropped.
        All or nothing: a :class:`SimulatedCrash` on the checkpoint leaves the log as it was.
        :data:`LOG_ID` in ``request_ids`` is ignored. Returns the number of events dropped
        (0, and nothing written, when no event matches).
        """
        drop = set(request_ids) - {LOG_ID}
        dropped = sum(1 for e in self.events if e.request_id in drop)
        if not dropped:
            return 0
        kept = [e for e in self.events if e.request_id not in drop and e.kind != "checkpoint"]
        if step is None:
            step = self.events[-1].step if self.events else 0
        missing = self.next_index - len(kept)   # every index below the checkpoint not kept
        before = self.events
        self.events = kept
        try:
            self._write("checkpoint", LOG_ID, (missing,), step)
        except BaseException:
            self.events = before
            raise
        for rid in drop:
            self._next_seq.pop(rid, None)
        return dropped

    def __len__(self) -> int:
        return len(self.events)

    def request_ids(self) -> set[str]:
        """The ids of the requests that have events in the log (checkpoints excluded)."""
        return {e.request_id for e in self.events} - {LOG_ID}

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def durable(self) -> list[Event]:
        """The events that survived (all of them: a crash stops appends, it loses nothing)."""
        return list(self.events)
