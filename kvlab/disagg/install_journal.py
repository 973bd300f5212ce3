"""The install journal of remote KV, and recovery from a consumer that died mid-install.

Installing a transferred entry is one **operation** with an id (``"<request>@<entry>"``). The
consumer writes its steps to an :class:`InstallJournal` in write-ahead order, each record before
the action it announces completes being visible:

==============  =============================================================================
record          meaning
==============  =============================================================================
``begin``       about to allocate a table for the operation (data: request id, tokens)
``allocated``   the KV manager holds the table (data: block ids, cached tokens reused)
``written``     every payload byte is in those blocks
``committed``   the blocks are in the prefix cache: the install is complete and visible
                (a crash between the commit and this record leaves ``written`` last: recovery
                then asks the manager whether the operation's blocks were committed)
``released``    the operation's own hold on the blocks is gone (the request holds them now,
                or recovery freed them)
==============  =============================================================================

A consumer that dies leaves the journal and the KV manager as they were (kvlab's crash model,
as in :mod:`kvlab.labs.recovery`). :func:`recover_installs` then says, per operation, whether
its blocks were **installed** (a ``committed`` record) and frees every table the operation still
holds exactly once: a table of an uncommitted operation may hold half-written KV, and since it
was never committed to the prefix cache nobody can read it. Records carry a CRC like the event
log's, and a duplicate operation id is refused: install is idempotent by construction.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

__all__ = ["INSTALL_RECORDS", "InstallCrash", "InstallJournal", "InstallRecord", "OpRecovery",
           "recover_installs"]

INSTALL_RECORDS = ("begin", "allocated", "written", "committed", "released")


class InstallCrash(RuntimeError):
    """The consumer died before writing a journal record (``InstallJournal(crash_at=...)``)."""


@dataclass(frozen=True)
class InstallRecord:
    index: int
    kind: str
    op_id: str
    data: tuple[Any, ...] = ()
    checksum: int = 0

    def expected_checksum(self) -> int:
        record = [self.index, self.kind, self.op_id, list(self.data)]
        return zlib.crc32(json.dumps(record, separators=(",", ":")).encode())


class InstallJournal:
    """Append-only install records. ``crash_at``: the index before which
    :class:`InstallCrash` is raised (fault injection)."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.records: list[InstallRecord] = []
        self.crash_at = crash_at

    def __len__(self) -> int:
        return len(self.records)

    def append(self, kind: str, op_id: str, data: tuple[Any, ...] = ()) -> InstallRecord:
        if kind not in INSTALL_RECORDS:
            raise ValueError(f"unknown install record {kind!r}")
        index = len(self.records)
        if self.crash_at is not None and index >= self.crash_at:
            raise InstallCrash(f"consumer crashed before install record {index} ({kind} of "
                                 f"{op_id})")
        rec = InstallRecord(index, kind, op_id, tuple(data))
        rec = InstallRecord(index, kind, op_id, rec.data, rec.expected_checksum())
        self.records.append(rec)
        return rec

    def state(self, op_id: str) -> str | None:
        """The latest record kind of ``op_id`` (None if the journal never saw it)."""
        last = None
        for rec in self.records:
            if rec.op_id == op_id:
                last = rec.kind
        return last

    def ops(self) -> list[str]:
        return list(dict.fromkeys(r.op_id for r in self.records))

    def installed(self, op_id: str) -> bool:
        """Whether the operation's blocks reached the prefix cache (a ``committed`` record)."""
        return any(r.op_id == op_id and r.kind == "committed" for r in self.records)

    def check(self) -> None:
        """ValueError naming the first corrupt record (bad CRC, index, or order of kinds)."""
        last: dict[str, int] = {}
        for i, rec in enumerate(self.records):
            if rec.index != i or rec.checksum != rec.expected_checksum():
                raise ValueError(f"install journal record {i} is corrupt")
            order = INSTALL_RECORDS.index(rec.kind)
            prev = last.get(rec.op_id, -1)
            if order <= prev or (order != prev + 1 and rec.kind != "released"):
                raise ValueError(f"install journal record {i}: {rec.kind} of {rec.op_id} "
                                 f"after {INSTALL_RECORDS[prev] if prev >= 0 else 'nothing'}")
            last[rec.op_id] = order


@dataclass(frozen=True)
class OpRecovery:
    """What recovery found for one operation."""

    op_id: str
    last_record: str
    installed: bool          # the KV is complete and in the prefix cache
    freed: bool              # recovery freed a table the operation still held


def recover_installs(journal: InstallJournal, kv: Any) -> dict[str, OpRecovery]:
    """After a crash: per operation, was it installed; free every table operations still hold.

    ``kv`` is the surviving :class:`~kvlab.core.kv_cache_manager.KVCacheManager`. Idempotent: a
    second call frees nothing. The journal's ``crash_at`` is cleared (the process restarted).
    ValueError (nothing changed) if the journal is corrupt.
    """
    journal.check()
    journal.crash_at = None
    report = {}
    for op in journal.ops():
        last = journal.state(op) or "begin"
        installed = journal.installed(op)
        if last == "written" and kv.has(op):
            # died between the prefix-cache commit and its record: the manager answers
            tokens = next(r.data[1] for r in journal.records
                          if r.op_id == op and r.kind == "begin")
            installed = not kv.needs_commit(op, tokens)
        freed = bool(kv.has(op) and kv.free(op))
        if last != "released":
            journal.append("released", op, ("recovery", installed))
        report[op] = OpRecovery(op, last, installed, freed)
    return report
