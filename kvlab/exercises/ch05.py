"""Chapter 5 exercises: predict what an abort changes, derive the pools that avoid preemption,
debug a recovery planner, and design a crash test that takes two of recovery's branches.

A check never holds the answer it grades: a prediction is compared with sealed truths
(``_common.sealed``; the instructor edition computes them on a real scheduler), linked values
are checked together and graded once per session (``_common.earlier_prediction``: after a
wrong answer, trying others learns nothing), and a reader's function is run on crashed runs,
against recovery's own decisions or against sealed answers for runs whose logs the chapter
does not show. Each raises ``AssertionError`` naming the concept to revisit, never the answer,
the direction of an error, or which case failed.
"""

from __future__ import annotations

import contextlib
import dataclasses

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RUNNING_STATUSES, FinishReason, RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.exercises._common import (
    earlier_prediction,
    failing_cases,
    graded_once,
    require_answer,
    sealed,
)
from kvlab.labs.invariants import check_scheduler
from kvlab.labs.recovery import RecoveryPlan, plan_recovery, replay
from kvlab.labs.recovery.event_log import EventLog, SimulatedCrash
from kvlab.labs.recovery.replay import met_stop
from kvlab.sim.tokens import drive

S = RequestStatus


# -- runs whose logs the exercises crash -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A scripted scheduler run: a pool of ``num_blocks`` blocks of ``block_size`` tokens,
    ``config``, ``arrivals[step]`` as ``(request id, prompt tokens, max_tokens)`` (the prompt's
    token ids are derived from the id), and ``aborts[step]`` the ids aborted just before it."""

    num_blocks: int
    block_size: int
    config: SchedulerConfig
    arrivals: dict
    aborts: dict = dataclasses.field(default_factory=dict)

    def requests(self) -> dict[int, list[RuntimeRequest]]:
        """The arrivals as requests; request ``q<i>``'s prompt is ``100 i + 1, 100 i + 2, ...``."""
        return {step: [RuntimeRequest(rid, tuple(range(100 * int(rid[1:]) + 1,
                                                       100 * int(rid[1:]) + 1 + prompt)),
                                      max_tokens=max_tokens)
                       for rid, prompt, max_tokens in specs]
                for step, specs in self.arrivals.items()}

    def scheduler(self, kv: KVCacheManager | None = None, log: EventLog | None = None):
        kv = kv if kv is not None else KVCacheManager(self.num_blocks, self.block_size)
        return ProductionScheduler(kv, self.config, log=log)

    def run(self, log: EventLog | None = None, kv: KVCacheManager | None = None):
        """Drive the run to its end; returns the scheduler."""
        sched = self.scheduler(kv, log)
        drive(sched, arrivals=self.requests(), aborts=dict(self.aborts))
        return sched

    def events(self) -> list:
        """The complete log of the uncrashed run."""
        log = EventLog()
        self.run(log)
        return list(log.events)

    def crashed(self, crash_at: int):
        """The run crashed before event ``crash_at``: ``(durable events, surviving manager)``.
        ValueError when the run ends before that event."""
        kv, log = KVCacheManager(self.num_blocks, self.block_size), EventLog(crash_at=crash_at)
        try:
            self.run(log, kv)
        except SimulatedCrash:
            return list(log.events), kv
        raise ValueError(f"the run ended before event {crash_at}; pick a smaller index")


CONFIG = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, prefill_chunk=4,
                         admission="watermark")

#: Exercise 4's scripted run: three 7-token requests of 6 output tokens at step 1, a 3-token
#: request of 3 output tokens at step 3, the client of ``q1`` aborting it before step 4.
SCRIPTED = RunSpec(8, 4, CONFIG, {1: [(f"q{i}", 7, 6) for i in range(3)], 3: [("q3", 3, 3)]},
                   {4: ["q1"]})

#: Runs whose logs the chapter does not print: exercise 3's check crashes each at every point,
#: exercise 4's runs the reader's function on their logs (its answers sealed, one per run).
CRASH_TEST_RUNS = (
    SCRIPTED,
    RunSpec(6, 4, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=5,
                                  admission="watermark"),
            {1: [("q0", 9, 5), ("q1", 4, 9)], 2: [("q2", 6, 4)], 5: [("q3", 2, 7)]},
            {5: ["q1"]}),
    RunSpec(12, 2, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=6, prefill_chunk=3,
                                   admission="reserve"),
            {1: [("q0", 5, 3), ("q1", 3, 8), ("q2", 8, 2)], 4: [("q3", 4, 4)]}),
)


def scripted_run(log: EventLog | None = None,
                 kv: KVCacheManager | None = None) -> ProductionScheduler:
    """:data:`SCRIPTED` driven to the end on ``kv`` (default: a fresh pool of 8 blocks of 4
    tokens). Returns the scheduler; pass an :class:`EventLog` to keep its events."""
    return SCRIPTED.run(log, kv)


def crash_scenario(crash_at: int = 37):
    """:func:`scripted_run` crashed before event ``crash_at``: returns ``(events, kv)``, the
    durable log and the surviving KV manager (a fresh copy on every call)."""
    return SCRIPTED.crashed(crash_at)


# -- the tight run of the chapter --------------------------------------------------------------

TIGHT = {"num_blocks": 9, "block_size": 4, "requests": 3, "prompt_tokens": 8, "max_tokens": 8}
TIGHT_CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=6,
                               admission="watermark")


def tight_arrivals() -> dict[int, list[RuntimeRequest]]:
    t = TIGHT
    return {1: [RuntimeRequest(f"q{i}", tuple(range(10 * i + 1, 10 * i + 1 + t["prompt_tokens"])),
                               max_tokens=t["max_tokens"]) for i in range(t["requests"])]}


def tight_scheduler(num_blocks: int | None = None, log: EventLog | None = None, **config):
    """The tight run's scheduler on a pool of ``num_blocks`` (default 9); ``config`` replaces
    fields of its :data:`TIGHT_CONFIG` (``admission``, ``watermark``, ...)."""
    kv = KVCacheManager(num_blocks or TIGHT["num_blocks"], TIGHT["block_size"])
    return ProductionScheduler(kv, dataclasses.replace(TIGHT_CONFIG, **config), log=log)


#: Exercise 1: the tight run, with this request aborted by its client just before this step.
ABORT = {"request": "q1", "step": 3}


def check_abort_prediction(path, finish_reason, preemptions, q2_admitted_step,
                           q0_finished_step) -> str:
    """Exercise 1: in the tight run with :data:`ABORT`, the statuses the aborted request passes
    through (from ``"waiting"``), its finish reason, the run's number of preemptions, the step
    that first gives ``q2`` KV (``admitted_step``) and the step in which ``q0`` finishes
    (``finished_step``): checked together, and graded once (the first wrong answer is the
    prediction; a different answer after it is not graded)."""
    require_answer(path, "the list of statuses")
    require_answer(finish_reason, "the finish reason")
    require_answer(preemptions, "the number of preemptions")
    require_answer(q2_admitted_step, "q2's admitted step")
    require_answer(q0_finished_step, "q0's finished step")
    if isinstance(path, str) or not isinstance(path, (list, tuple)):
        raise AssertionError(f"give the path as a list of statuses, got {path!r}")
    path = [str(p).strip().lower() for p in path]
    known = {s.value for s in RequestStatus}
    unknown = [p for p in path if p not in known]
    if unknown:
        raise AssertionError(f"{unknown[0]!r} is not a request status; the statuses are "
                             f"{sorted(known)}.")
    reasons = [f.value for f in FinishReason]
    got_reason = str(finish_reason).strip().lower()
    if got_reason not in reasons:
        raise AssertionError(f"{finish_reason!r} is not a finish reason; the reasons are "
                             f"{reasons}.")
    for value, what in ((preemptions, "the number of preemptions"),
                        (q2_admitted_step, "q2's admitted step"),
                        (q0_finished_step, "q0's finished step")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AssertionError(f"give {what} as a whole number")
    answer = [path, got_reason, preemptions, q2_admitted_step, q0_finished_step]
    right = sealed("ch05.abort").is_answer(answer)
    earlier = earlier_prediction("ch05.abort", answer, right)
    if earlier is not None:
        return graded_once(earlier)
    if not right:
        # one verdict for the five: naming which is off would let each be tried alone
        raise AssertionError("your prediction is not what the scheduler does (it is recorded: "
                             "a prediction is graded once): revisit when an abort takes effect "
                             "(at a step boundary), what it releases, who the freed blocks "
                             "admit, and whether the pool still overflows without that "
                             "request. Then run it and find where your reasoning parted.")
    return (f"Correct: {' -> '.join(path)}, finish reason {got_reason!r}, {preemptions} "
            f"preemption(s), q2 admitted at step {q2_admitted_step}, q0 finished at step "
            f"{q0_finished_step}. The abort ends a running request and releases its table; "
            "with one request fewer, the other two fit in the pool to the end.")


def preemptions_with(num_blocks: int, **config) -> int:
    """Preemptions in the tight run on a pool of ``num_blocks`` blocks (``config`` as in
    :func:`tight_scheduler`, e.g. ``watermark=0.25``)."""
    sched = tight_scheduler(num_blocks, **config)
    drive(sched, arrivals=tight_arrivals(), check=check_scheduler)
    return sum(r.num_preemptions for r in sched.requests())


def check_pool_sizes(kv_tokens_at_end, watermark_blocks, reserve_blocks) -> str:
    """Exercise 2: the tokens of KV each request of the tight run holds when it ends, the
    smallest pool (blocks) on which the run preempts nothing with its own watermark admission
    (no reserve), and the smallest on which every request finishes with reserve admission;
    checked together and graded once (``_common.earlier_prediction``), since the three are
    small whole numbers a loop could otherwise find."""
    require_answer(kv_tokens_at_end, "the tokens of KV a request holds at its end")
    require_answer(watermark_blocks, "the pool under watermark admission")
    require_answer(reserve_blocks, "the pool under reserve admission")
    answer = [kv_tokens_at_end, watermark_blocks, reserve_blocks]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in answer):
        raise AssertionError(f"give three positive whole numbers, got {answer!r}")
    right = sealed("ch05.pool_sizes").is_answer(answer)
    earlier = earlier_prediction("ch05.pool_sizes", answer, right)
    if earlier is not None:
        return graded_once(earlier)
    if not right:
        raise AssertionError("the three are not all what the scheduler does (your answer is "
                             "recorded: it is graded once): revisit which tokens hold KV when "
                             "a request ends, how many requests each admission policy lets "
                             "run at once, and what reserve admission sets aside for a "
                             "request before admitting it.")
    return (f"Correct: {kv_tokens_at_end} tokens, {watermark_blocks} and {reserve_blocks} "
            "blocks. Admitting on the first chunk runs all three at once, so the pool must hold "
            "all three at their largest; reserving prompt + max_tokens runs them one after "
            "another on the smallest pool, and takes longer.")


# -- exercise 3: a recovery planner to debug ------------------------------------------------------

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
    out.update({rid: f"finish ({reason.value})" for rid, reason in plan.finish})
    out.update({rid: "free" for rid in plan.free})
    out.update({rid: "free (unaccounted)" for rid in plan.unaccounted})
    return out


def planner_mistakes(planner, events, kv) -> dict[str, tuple[str, str]]:
    """Requests on which ``planner`` and ``plan_recovery`` decide differently for a durable log
    and the surviving manager: id -> (planner's decision, recovery's decision)."""
    state = replay(events)
    tables = {rid: kv.num_slots(rid) for rid in kv.requests()}
    plan = planner(state, tables)
    if not isinstance(plan, RecoveryPlan):
        raise AssertionError(f"the planner returned {type(plan).__name__}, not a RecoveryPlan")
    got, want = _decisions(plan), _decisions(plan_recovery(state, tables))
    return {rid: (got.get(rid, "nothing"), want.get(rid, "nothing"))
            for rid in sorted(set(got) | set(want)) if got.get(rid) != want.get(rid)}


def check_fixed_plan(fixed_plan) -> str:
    """Exercise 3: ``fixed_plan(state, tables) -> RecoveryPlan``, :func:`compact_plan` with its
    bug fixed. The check compares its decisions with recovery's at every crash point of the
    tight run and of runs the chapter does not print."""
    require_answer(fixed_plan, "your fixed_plan function")
    if not callable(fixed_plan):
        raise AssertionError("pass a function (state, tables) -> RecoveryPlan")
    if fixed_plan is plan_recovery:
        raise AssertionError("that is the library's planner; fix compact_plan instead.")
    points = 0
    for spec in (None, *CRASH_TEST_RUNS):
        n = _tight_event_count() if spec is None else len(spec.events())
        for k in range(n):
            events, kv = _crash_tight(k) if spec is None else spec.crashed(k)
            if planner_mistakes(fixed_plan, events, kv):
                raise AssertionError(
                    "at some crash point your planner decides a request differently from "
                    "recovery: revisit the write-ahead order of a table's life in the log "
                    "(acquire, acquired, transition, release, released) and what a crash "
                    "between two of those records leaves behind.")
            points += 1
    return (f"Correct: your planner decides as recovery does at all {points} crash points. "
            "Every request that holds a table but is not running is an orphan, whatever its "
            "status: waiting (crashed between 'acquired' and the transition to running), "
            "preempted or ended (crashed between the transition and the release).")


# -- exercise 4: a crash test that takes two branches at once -------------------------------------

def check_crash_points(crash_points) -> str:
    """Exercise 4: ``crash_points(events) -> list[int]``: from the complete log of a run, every
    crash point ``k`` (the durable log is ``events[:k]``) at which recovery, with the manager
    surviving, finishes a request whose last token already met its stop rule *and* resumes
    another. The check runs it on the logs of :data:`CRASH_TEST_RUNS`."""
    require_answer(crash_points, "your crash_points function")
    if not callable(crash_points):
        raise AssertionError("pass a function events -> list of crash points")
    logs = [{"events": spec.events()} for spec in CRASH_TEST_RUNS]

    def points(events):
        return sorted(int(k) for k in crash_points(list(events)))

    wrong = failing_cases(points, "ch05.crash_points", logs)
    if wrong:
        raise AssertionError("your crash points are not the ones where recovery takes both "
                             "branches on every run: revisit what the "
                             "log must hold for a request to be finished at recovery (its last "
                             "'progress' record, and no FINISHED transition yet) and for "
                             "another to be resumed.")
    return (f"Correct on all {len(logs)} runs. The finish branch needs a crash after a "
            "request's last 'progress' record and before its FINISHED transition; the resume "
            "branch another request that is running with tokens still to generate.")
