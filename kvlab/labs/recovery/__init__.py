"""Crash recovery from the lifecycle event log (spec rules 5 and 11).

The scheduler writes every status change and every KV acquisition/release to an
:class:`~kvlab.labs.recovery.event_log.EventLog` in write-ahead order (intent, then the KV manager
call,
then the outcome; status changes before the release they cause). The model of a crash: the
scheduler process dies between two log appends; its queues are lost, the KV manager (think of a
block pool owned by a separate process, or device memory that a restarted scheduler re-attaches
to) keeps whatever it held at that instant.

:func:`recover` works in three phases, and changes nothing before the third:

1. **Check.** :func:`~kvlab.labs.recovery.replay.replay` checks the whole log and rebuilds every
   request
   from it; a log it cannot trust is refused with
   :class:`~kvlab.labs.recovery.event_log.CorruptLog`.
   The KV manager's own invariants must hold, and ``make_scheduler`` must give an empty
   scheduler on this manager and log.
2. **Plan.** :func:`plan_recovery` decides request by request (table below) from the replayed
   log and what the manager holds, and the plan is checked against everything the recovered
   scheduler's ``check_invariants`` will demand.
3. **Apply.** Pending copies are completed, the planned transitions and releases are logged
   and applied, tables the log does not account for are freed, and the requests are installed
   with the scheduler's public ``restore``. Each of these moves was proven legal in phase 2, so
   the final ``check_invariants`` cannot fail short of a bug in the manager or the scheduler.

==============================  ==================  ==============================================
status in the log               manager holds KV?   action
==============================  ==================  ==============================================
RUNNING, and its last sampled   either              finish it (STOP or LENGTH), free its table
token met a stop rule
RUNNING                         yes                 resume: same table, same computed tokens
RUNNING                         no                  requeue as PREEMPTED (recompute its tokens)
anything else                   yes                 orphan: free it (exactly once)
anything else                   no                  nothing to do (already released, or never had)
==============================  ==================  ==============================================

Because a status change is logged *before* the release it implies, a request whose log says
"finished" or "preempted" may or may not still hold KV; the manager answers, and ``free`` is
idempotent, so nothing leaks and nothing is freed twice. Because ``acquired`` is logged *after*
the manager call and the RUNNING transition after that, a crash in between leaves a waiting
request holding KV: an orphan, freed. A table the log cannot explain (an id it never mentions,
or one whose KV it says was never acquired or was released) is freed without a log record.
Recovery's own records are stamped with the step of the last durable event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.request import RUNNING_STATUSES, FinishReason, Lifecycle, RequestStatus
from kvlab.labs.invariants import check_kv_manager, check_scheduler
from kvlab.labs.recovery.event_log import CorruptLog, Event, EventLog
from kvlab.labs.recovery.replay import ReplayedRequest, met_stop, replay

__all__ = ["CorruptLog", "RecoveryPlan", "RecoveryReport", "ReplayedRequest", "plan_recovery",
           "recover", "replay"]

S = RequestStatus


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`recover` did. Every id appears in at most one of the first five fields."""

    resumed: tuple[str, ...] = ()     # running; table kept, continues where it stopped
    requeued: tuple[str, ...] = ()    # running per log but no usable table: recompute
    freed: tuple[str, ...] = ()       # orphans: held KV the log says they may not hold
    finished: tuple[str, ...] = ()    # running, but their last token already met a stop rule
    unknown_freed: tuple[str, ...] = ()  # tables the log does not account for
    redone_copies: tuple[tuple[int, int], ...] = field(default=())

    def summary(self) -> str:
        return (f"resumed {len(self.resumed)}, requeued {len(self.requeued)}, "
                f"orphans freed {len(self.freed) + len(self.unknown_freed)}, "
                f"finished {len(self.finished)}, copies redone {len(self.redone_copies)}")


@dataclass(frozen=True)
class RecoveryPlan:
    """Every decision of a recovery, made before anything changes (see :func:`plan_recovery`).

    ``resume`` is in running order (latest admission last).
    """

    resume: tuple[str, ...] = ()
    requeue: tuple[str, ...] = ()
    finish: tuple[tuple[str, FinishReason], ...] = ()
    free: tuple[str, ...] = ()
    unaccounted: tuple[str, ...] = ()


def plan_recovery(state: Mapping[str, ReplayedRequest], tables: Mapping[str, int]) -> RecoveryPlan:
    """Decide what recovery does with each request. Pure.

    ``state`` is :func:`replay`'s result; ``tables`` maps every request id the KV manager holds
    a table for to the number of token slots of that table.
    """
    resume, requeue, finish, free = [], [], [], []
    for rid, entry in state.items():
        request, slots = entry.request, tables.get(rid)
        if request.status in RUNNING_STATUSES:
            reason = met_stop(request)
            if reason is not None:
                finish.append((rid, reason))
            # A table too small for the logged progress cannot hold that KV: recompute.
            elif (slots is not None and request.num_uncomputed_tokens > 0
                  and slots >= request.num_computed_tokens):
                resume.append(rid)
            else:
                requeue.append(rid)
        elif slots is not None and entry.kv != "none":
            free.append(rid)
    accounted = set(resume) | set(requeue) | {rid for rid, _ in finish} | set(free)
    resume.sort(key=lambda rid: state[rid].admit_index)
    return RecoveryPlan(
        resume=tuple(resume),
        requeue=tuple(requeue),
        finish=tuple(finish),
        free=tuple(free),
        unaccounted=tuple(sorted(rid for rid in tables if rid not in accounted)),
    )


def _final_statuses(state: Mapping[str, ReplayedRequest],
                    plan: RecoveryPlan) -> dict[str, RequestStatus]:
    """Every request's status once ``plan`` is applied."""
    final = {rid: entry.request.status for rid, entry in state.items()}
    final.update({rid: S.PREEMPTED for rid in plan.requeue})
    final.update({rid: S.FINISHED for rid, _ in plan.finish})
    return final


def _check_plan(state: Mapping[str, ReplayedRequest], tables: Mapping[str, int],
                plan: RecoveryPlan) -> None:
    """What the recovered scheduler's ``check_invariants`` demands, checked on the plan.

    The replay's checks and :func:`plan_recovery` guarantee all of it; an AssertionError here
    is a bug, caught while nothing has changed yet.
    """
    resume = set(plan.resume)
    released = set(plan.requeue) | {rid for rid, _ in plan.finish} | set(plan.free) \
        | set(plan.unaccounted)
    assert resume <= set(tables), "a resumed request has no table"
    assert set(tables) - resume <= released, "a table outside the running queue survives"
    for rid, status in _final_statuses(state, plan).items():
        request = state[rid].request
        assert (status in RUNNING_STATUSES) == (rid in resume), f"{rid}: queue mismatch"
        if status.is_terminal and status != S.FINISHED:   # FINISHED gets its reason in apply
            assert request.finish_reason is not None, f"{rid}: ended without a reason"
        assert 0 <= request.num_computed_tokens <= request.num_tokens, f"{rid}: computed"
        assert len(request.output_token_ids) <= request.max_tokens, f"{rid}: outputs"


def _require_fresh(scheduler: Any, kv: Any, log: EventLog) -> None:
    if scheduler.requests() or scheduler.has_unfinished_requests() \
            or getattr(scheduler, "step_count", 0):
        raise ValueError("make_scheduler must return a new, empty scheduler")
    if scheduler.kv is not kv or scheduler.log is not log:
        raise ValueError("make_scheduler(kv, log) must build a scheduler on that kv and log")


def recover(
    events: Iterable[Event],
    kv: Any,
    make_scheduler: Callable[[Any, EventLog], Any],
) -> tuple[Any, RecoveryReport]:
    """Rebuild a scheduler from the durable log and the surviving KV manager.

    ``make_scheduler(kv, log)`` builds an empty scheduler (same class and config as before the
    crash) that appends to ``log``; the recovered log starts with the durable events, and the
    recovery's own records are appended after them. Returns the scheduler (its
    ``check_invariants`` holds) and a :class:`RecoveryReport`.

    Raises, with the KV manager and ``events`` unchanged: :class:`CorruptLog` for a log that
    fails :func:`replay`'s checks; AssertionError when the manager's invariants are already
    broken; ValueError when ``make_scheduler`` does not give a fresh scheduler on ``kv`` and
    the new log.
    """
    durable = list(events)
    state = replay(durable)                                    # phase 1: check
    check_kv_manager(kv)
    log = EventLog(events=list(durable))
    scheduler = make_scheduler(kv, log)
    _require_fresh(scheduler, kv, log)
    tables = {rid: kv.num_slots(rid) for rid in kv.requests()}
    plan = plan_recovery(state, tables)                        # phase 2: plan
    _check_plan(state, tables, plan)
    last_step = durable[-1].step if durable else 0
    pending = tuple(kv.pending_copies())

    if pending:                                                # phase 3: apply
        kv.complete_copies(pending)
    lifecycle = Lifecycle(log, step=lambda: last_step)
    finish = dict(plan.finish)
    requeue, resume, free = set(plan.requeue), set(plan.resume), set(plan.free)
    for rid, entry in state.items():
        request = entry.request
        if rid in finish:
            lifecycle.finish(request, finish[rid])
            lifecycle.release(request, kv)
        elif rid in requeue:
            lifecycle.transition(request, S.PREEMPTED)
            lifecycle.release(request, kv)
            request.num_computed_tokens = 0
        elif rid not in resume:
            request.num_computed_tokens = 0   # a waiting or ended request has no KV written
            if rid in free:
                lifecycle.release(request, kv)
    for rid in plan.unaccounted:
        kv.free(rid)
    scheduler.restore([entry.request for entry in state.values()], plan.resume, last_step)
    check_scheduler(scheduler)
    report = RecoveryReport(
        resumed=plan.resume,
        requeued=plan.requeue,
        freed=plan.free,
        finished=tuple(rid for rid, _ in plan.finish),
        unknown_freed=plan.unaccounted,
        redone_copies=pending,
    )
    return scheduler, report
