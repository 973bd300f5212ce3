"""Chapter 5 exercises: predict what an abort changes, derive the pool that avoids preemption,
debug a recovery planner, and design a crash test.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it on a real scheduler); the debug and design checks evaluate the
reader's choice with :mod:`kvlab.core.request` / :mod:`kvlab.labs.recovery`. Each raises
``AssertionError`` saying what is wrong (too high or too low, that a named request is not the
one), never the answer.
"""

from __future__ import annotations

import contextlib

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RUNNING_STATUSES, FinishReason, RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.exercises._common import require_answer, sealed
from kvlab.labs.invariants import check_scheduler
from kvlab.labs.recovery import RecoveryPlan, plan_recovery, recover, replay
from kvlab.labs.recovery.event_log import EventLog, SimulatedCrash
from kvlab.labs.recovery.replay import met_stop
from kvlab.sim.tokens import drive

S = RequestStatus


CONFIG = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, prefill_chunk=4,
                         admission="watermark")


def scripted_run(log: EventLog | None = None,
                 kv: KVCacheManager | None = None) -> ProductionScheduler:
    """Exercise 4's scripted run, driven to the end on ``kv`` (default: a fresh pool of 8
    blocks of 4 tokens): three 7-token requests of 6 output tokens arrive at step 1, a 3-token
    request of 3 output tokens at step 3, and the client of ``q1`` aborts it just before step
    4. Returns the scheduler; pass an :class:`EventLog` to keep its events."""
    sched = ProductionScheduler(kv if kv is not None else KVCacheManager(8, 4), CONFIG, log=log)
    arrivals = {1: [RuntimeRequest(f"q{i}", tuple(range(10 * i + 1, 10 * i + 8)), max_tokens=6)
                    for i in range(3)],
                3: [RuntimeRequest("q3", (99, 98, 97), max_tokens=3)]}
    drive(sched, arrivals=arrivals, aborts={4: ["q1"]})
    return sched


def crash_scenario(crash_at: int = 37):
    """:func:`scripted_run` crashed before event ``crash_at``: returns ``(events, kv)``, the
    durable log and the surviving KV manager (a fresh copy on every call)."""
    kv = KVCacheManager(8, 4)
    log = EventLog(crash_at=crash_at)
    try:
        scripted_run(log, kv)
    except SimulatedCrash:
        pass
    else:
        raise ValueError(f"the run ended before event {crash_at}; pick a smaller index")
    return list(log.events), kv


# -- the tight run of the chapter --------------------------------------------------------------

TIGHT = {"num_blocks": 9, "block_size": 4, "requests": 3, "prompt_tokens": 8, "max_tokens": 8}
TIGHT_CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=6,
                               admission="watermark")


def tight_arrivals() -> dict[int, list[RuntimeRequest]]:
    t = TIGHT
    return {1: [RuntimeRequest(f"q{i}", tuple(range(10 * i + 1, 10 * i + 1 + t["prompt_tokens"])),
                               max_tokens=t["max_tokens"]) for i in range(t["requests"])]}


def tight_scheduler(num_blocks: int | None = None, log: EventLog | None = None):
    kv = KVCacheManager(num_blocks or TIGHT["num_blocks"], TIGHT["block_size"])
    return ProductionScheduler(kv, TIGHT_CONFIG, log=log)


#: Exercise 1: the tight run, with this request aborted by its client just before this step.
ABORT = {"request": "q1", "step": 3}


#: Why each finish reason is wrong when it is not the request's (said of the chosen reason
#: only; the right one's entry is never shown).
_REASON_FAILS = {
    "stop": "it never generated a stop token.",
    "length": "it never reached its max_tokens.",
    "abort": "nobody cancelled it.",
    "error": "nothing failed while it ran.",
    "rejected": "it was admitted.",
}


def check_abort_prediction(path, finish_reason, preemptions) -> str:
    """Exercise 1: in the tight run with :data:`ABORT`, the statuses the aborted request passes
    through (from ``"waiting"``), its finish reason, and the run's number of preemptions."""
    require_answer(path, "the list of statuses")
    require_answer(finish_reason, "the finish reason")
    require_answer(preemptions, "the number of preemptions")
    if isinstance(path, str) or not isinstance(path, (list, tuple)):
        raise AssertionError(f"give the path as a list of statuses, got {path!r}")
    path = [str(p).strip().lower() for p in path]
    known = {s.value for s in RequestStatus}
    unknown = [p for p in path if p not in known]
    if unknown:
        raise AssertionError(f"{unknown[0]!r} is not a request status; the statuses are "
                             f"{sorted(known)}.")
    if not sealed("ch05.abort.path").is_answer(path):
        # no index and no 'right so far': either would let the path be found entry by entry
        raise AssertionError("that is not the path the scheduler took.")
    reasons = [f.value for f in FinishReason]
    got_reason = str(finish_reason).strip().lower()
    if got_reason not in reasons:
        raise AssertionError(f"{finish_reason!r} is not a finish reason; the reasons are "
                             f"{reasons}.")
    if not sealed("ch05.abort.reason").is_answer(got_reason):
        raise AssertionError(f"{got_reason!r} is not why this request ended: "
                             f"{_REASON_FAILS[got_reason]}")
    if isinstance(preemptions, bool) or not isinstance(preemptions, int):
        raise AssertionError("give the number of preemptions as an integer")
    way = sealed("ch05.abort.preemptions").direction(preemptions)
    if way:
        raise AssertionError(f"{preemptions} preemptions is "
                             f"{'too many' if way == 'too high' else 'too few'}.")
    return (f"Correct: {' -> '.join(path)}, finish reason {got_reason!r}, {preemptions} "
            "preemption(s). The abort ends a running request and releases its table; with "
            "one request fewer, the other two fit in the pool to the end.")


def preemptions_with(num_blocks: int) -> int:
    """Preemptions in the tight run on a pool of ``num_blocks`` blocks."""
    sched = tight_scheduler(num_blocks)
    drive(sched, arrivals=tight_arrivals(), check=check_scheduler)
    return sum(r.num_preemptions for r in sched.requests())


def check_no_preemption_blocks(num_blocks) -> str:
    """Exercise 2: the smallest pool (in blocks) on which the tight run preempts nothing."""
    require_answer(num_blocks, "the number of blocks")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 4:
        raise AssertionError("give a whole number of blocks, at least 4 (one request's prompt "
                             "needs some)")
    way = sealed("ch05.no_preemption_blocks").direction(num_blocks)
    if way == "too low":
        raise AssertionError(f"with {num_blocks} blocks the run still preempts: too low.")
    if way:
        raise AssertionError(f"{num_blocks} blocks avoid preemption, but so does one fewer: "
                             "too high.")
    return (f"Correct: {num_blocks} blocks. Every request ends holding the KV of its prompt "
            "and of all but its last output token, rounded up to whole blocks, and all three "
            "run at once.")


def _crash_tight(crash_at: int):
    """The tight run crashed before event ``crash_at``: (durable events, surviving manager)."""
    log = EventLog(crash_at=crash_at)
    sched = tight_scheduler(log=log)
    with contextlib.suppress(SimulatedCrash):
        drive(sched, arrivals=tight_arrivals())
    return list(log.events), sched.kv


def _tight_event_count() -> int:
    full = EventLog()
    drive(tight_scheduler(log=full), arrivals=tight_arrivals())
    return len(full.events)


def _require_crash_point(crash_at) -> None:
    n = _tight_event_count()
    if isinstance(crash_at, bool) or not isinstance(crash_at, int) or not 0 <= crash_at < n:
        raise AssertionError(f"crash_at must be an event index from 0 to {n - 1}")


# -- exercise 3: a recovery planner to debug ------------------------------------------------------

def compact_plan(state, tables) -> RecoveryPlan:
    """A shorter recovery planner with the signature of
    :func:`kvlab.labs.recovery.plan_recovery`: ``state`` from ``replay``, ``tables`` mapping
    the id of every table the manager holds to its number of slots."""
    resume, requeue, finish, free = [], [], [], []
    for rid, entry in state.items():
        request = entry.request
        held = rid in tables
        if request.status in RUNNING_STATUSES:
            reason = met_stop(request)
            if reason is not None:
                finish.append((rid, reason))
            elif (held and request.num_uncomputed_tokens > 0
                  and tables[rid] >= request.num_computed_tokens):
                resume.append(rid)
            else:
                requeue.append(rid)
        elif request.status.is_terminal and held:
            free.append(rid)
    resume.sort(key=lambda rid: state[rid].admit_index)
    return RecoveryPlan(resume=tuple(resume), requeue=tuple(requeue), finish=tuple(finish),
                        free=tuple(free),
                        unaccounted=tuple(sorted(rid for rid in tables if rid not in state)))


def _decisions(plan: RecoveryPlan) -> dict[str, str]:
    out = {rid: "resume" for rid in plan.resume}
    out.update({rid: "requeue" for rid in plan.requeue})
    out.update({rid: "finish" for rid, _ in plan.finish})
    out.update({rid: "free" for rid in plan.free})
    out.update({rid: "free (unaccounted)" for rid in plan.unaccounted})
    return out


def planner_mistakes(crash_at: int) -> dict[str, tuple[str, str]]:
    """Requests on which :func:`compact_plan` and ``plan_recovery`` decide differently when the
    tight run crashes before event ``crash_at``: id -> (compact decision, correct decision)."""
    events, kv = _crash_tight(crash_at)
    state = replay(events)
    tables = {rid: kv.num_slots(rid) for rid in kv.requests()}
    got, want = _decisions(compact_plan(state, tables)), _decisions(plan_recovery(state, tables))
    return {rid: (got.get(rid, "nothing"), want.get(rid, "nothing"))
            for rid in sorted(set(got) | set(want)) if got.get(rid) != want.get(rid)}


def check_planner_bug(crash_at, request_id) -> str:
    """Exercise 3: a crash point of the tight run at which :func:`compact_plan` decides wrongly,
    and the id of a request it gets wrong there."""
    require_answer(crash_at, "the crash point")
    require_answer(request_id, "the request id")
    _require_crash_point(crash_at)
    mistakes = planner_mistakes(crash_at)
    ids = sorted(r.request_id for reqs in tight_arrivals().values() for r in reqs)
    if request_id not in ids:
        raise AssertionError(f"{request_id!r} is not a request of the tight run ({ids}).")
    if request_id not in mistakes:
        # the same words whether or not another request is decided wrongly there: saying so
        # would leave only the other ids to try
        raise AssertionError(f"crashing before event {crash_at}, compact_plan decides "
                             f"{request_id!r} as the real planner does.")
    got, want = mistakes[request_id]
    events, _ = _crash_tight(crash_at)
    status = replay(events)[request_id].request.status.value
    return (f"Correct: the log calls {request_id} {status!r} and the manager still holds its "
            f"table; compact_plan decides {got!r} where recovery must {want!r}, so nobody "
            "would ever free those blocks. Every request that holds a table but is not "
            "running is an orphan, whatever its status: waiting (crashed between 'acquired' "
            "and the transition to running), preempted or ended (crashed between the "
            "transition and the release).")


# -- a crash test that takes two branches at once -------------------------------------------------

def check_crash_design(crash_at) -> str:
    """A crash point of the chapter's tight run at which recovery (the manager survives)
    both finishes a request whose last token already met its stop rule and resumes a running
    one (kept for teachers: the chapter prints the events around its only answer, so its
    exercise 4 asks :func:`check_crash_test` on :func:`scripted_run` instead)."""
    require_answer(crash_at, "the crash point")
    _require_crash_point(crash_at)
    return _grade_recovery(crash_at, *_crash_tight(crash_at), TIGHT_CONFIG)


def _grade_recovery(crash_at: int, events, kv, config) -> str:
    """Recover ``events`` on ``kv`` (the manager survived), drive the recovered scheduler to the
    end, and require that recovery both finished a request and resumed another."""
    recovered, report = recover(events, kv,
                                lambda kv, lg: ProductionScheduler(kv, config, log=lg))
    drive(recovered, check=check_scheduler)
    if not report.finished:
        raise AssertionError(f"crashing before event {crash_at}, recovery finishes no request "
                             "whose last token had already met its stop rule.")
    if not report.resumed:
        raise AssertionError(f"crashing before event {crash_at}, recovery finishes a request, "
                             "but resumes none.")
    return (f"Correct: recovery {report.summary()}. The crash fell after one request's last "
            "'progress' record and before its FINISHED transition, while another still had "
            "tokens to generate.")


def check_crash_test(crash_at) -> str:
    """Exercise 4: a crash point of :func:`scripted_run` at which recovery (the manager
    survives) both finishes a request whose last token already met its stop rule and resumes
    another, and the run then completes on the recovered scheduler."""
    require_answer(crash_at, "the crash point")
    full = EventLog()
    scripted_run(full)
    n = len(full.events)
    if isinstance(crash_at, bool) or not isinstance(crash_at, int) or not 0 <= crash_at < n:
        raise AssertionError(f"crash_at must be an event index from 0 to {n - 1}")
    return _grade_recovery(crash_at, *crash_scenario(crash_at), CONFIG)
