"""Crash recovery from the lifecycle event log (spec rules 5 and 11).

The scheduler writes every status change and every KV acquisition/release to an
:class:`~kvlab.core.lifecycle.EventLog` in write-ahead order (intent, then the KV manager call,
then the outcome; status changes before the release they cause). The model of a crash: the
scheduler process dies between two log appends; its queues are lost, the KV manager (think of a
block pool owned by a separate process, or device memory that a restarted scheduler re-attaches
to) keeps whatever it held at that instant.

:func:`recover` replays the durable log and decides, request by request:

==============================  ==================  ==============================================
status in the log               manager holds KV?   action
==============================  ==================  ==============================================
PREFILL / DECODE (running)      yes                 resume: same table, same computed tokens
PREFILL / DECODE (running)      no                  requeue as PREEMPTED (recompute its tokens)
anything else                   yes                 orphan: free it (exactly once)
anything else                   no                  nothing to do (already released, or never had)
==============================  ==================  ==============================================

Because a status change is logged *before* the release it implies, a request whose log says
"finished" or "preempted" may or may not still hold KV; the manager answers, and ``free`` is
idempotent, so nothing leaks and nothing is freed twice. Because ``acquired`` is logged *after*
the manager call and the PREFILL transition after that, a crash in between leaves a waiting
request holding KV: an orphan, freed. Copies that were pending at the crash are completed (the
executor must redo them: a copy from a fenced source is idempotent); resumed requests whose last
sampled token already meets a stop condition are finished.

:func:`~kvlab.core.replay.replay` checks the whole log before anything is changed and refuses
a corrupt one with :class:`~kvlab.core.event_log.CorruptLog`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .event_log import CorruptLog, Event, EventLog
from .lifecycle import RUNNING_STATUSES
from .replay import ReplayedRequest, replay
from .scheduler_api import RequestStatus, stop_reason

__all__ = ["CorruptLog", "RecoveryReport", "ReplayedRequest", "recover", "replay"]

S = RequestStatus


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`recover` did. Every id appears in at most one of the first five fields."""

    resumed: tuple[str, ...] = ()     # running; table kept, continues where it stopped
    requeued: tuple[str, ...] = ()    # running per log but no table: back to waiting, recompute
    freed: tuple[str, ...] = ()       # orphans: held KV the log says they may not hold
    finished: tuple[str, ...] = ()    # resumed, but their last token already met a stop rule
    unknown_freed: tuple[str, ...] = ()  # tables of ids the log never mentions
    redone_copies: tuple[tuple[int, int], ...] = field(default=())

    def summary(self) -> str:
        return (f"resumed {len(self.resumed)}, requeued {len(self.requeued)}, "
                f"orphans freed {len(self.freed) + len(self.unknown_freed)}, "
                f"finished {len(self.finished)}, copies redone {len(self.redone_copies)}")


def _table_owners(kv: Any) -> list[str]:
    """Request ids that own a block table in ``kv`` (from its snapshot), sorted."""
    snapshot = kv.snapshot()
    tables = getattr(snapshot, "tables", None)
    if tables is None:
        return []
    return sorted(str(owner) for owner in tables)


def recover(
    events: Iterable[Event],
    kv: Any,
    make_scheduler: Callable[[Any, EventLog], Any],
) -> tuple[Any, RecoveryReport]:
    """Rebuild a scheduler from the durable log and the surviving KV manager.

    ``make_scheduler(kv, log)`` builds an empty scheduler (same class and config as before the
    crash) that appends to ``log``; the recovered log starts with the durable events, and the
    recovery's own releases are logged after them. Returns the scheduler (its
    ``check_invariants`` holds) and a :class:`RecoveryReport`.
    """
    durable = list(events)
    state = replay(durable)
    log = EventLog(events=list(durable))
    scheduler = make_scheduler(kv, log)
    lifecycle = scheduler.lifecycle

    pending = tuple(kv.pool.pending_copies()) if hasattr(kv, "pool") else ()
    if pending:
        kv.complete_copies(pending)

    resumed, requeued, freed, finished = [], [], [], []
    for rid, entry in state.items():
        request = entry.request
        held = kv.has(rid)
        if request.status in RUNNING_STATUSES:
            # A child forked in the step that crashed has its prompt computed but lost its
            # first token: nothing to resume from, so it recomputes like a preempted request.
            if held and request.num_uncomputed_tokens > 0:
                resumed.append(rid)
            else:
                lifecycle.transition(request, S.PREEMPTED)
                lifecycle.release(request, kv)
                request.num_computed_tokens = 0
                requeued.append(rid)
        else:
            request.num_computed_tokens = 0   # a waiting or ended request has no KV written
            if held:
                lifecycle.release(request, kv)
                freed.append(rid)
    known = set(state)
    unknown = [owner for owner in _table_owners(kv) if owner not in known]
    for owner in unknown:
        kv.free(owner)

    running_order = sorted(resumed, key=lambda rid: state[rid].admit_index)
    last_step = max((event.step for event in durable), default=0)
    scheduler.restore([entry.request for entry in state.values()], running_order, last_step)
    for rid in running_order:
        request = state[rid].request
        if request.status == S.PREFILL and request.output_token_ids \
                and request.num_uncomputed_tokens == 1:
            lifecycle.transition(request, S.DECODE)
        reason = stop_reason(request)
        if reason is not None:
            lifecycle.finish(request, reason)
            scheduler.running.remove(rid)
            lifecycle.release(request, kv)
            finished.append(rid)
    resumed = [rid for rid in running_order if rid not in finished]
    report = RecoveryReport(
        resumed=tuple(resumed),
        requeued=tuple(requeued),
        freed=tuple(freed),
        finished=tuple(finished),
        unknown_freed=tuple(unknown),
        redone_copies=pending,
    )
    scheduler.check_invariants()
    return scheduler, report
