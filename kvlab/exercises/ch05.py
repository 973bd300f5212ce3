"""Chapter 5 exercises: predict a request's path, derive the pool that avoids preemption,
find orphans after a crash, and design a crash test.

Each check computes the truth with :mod:`kvlab.core.lifecycle` / :mod:`kvlab.core.recovery`
on a real scheduler and raises ``AssertionError`` saying what is wrong (which entry diverges,
too high or too low, which request was missed or wrongly named), never the answer.
"""

from __future__ import annotations

import contextlib

from kvlab.core.kv_manager import KVCacheManager
from kvlab.core.lifecycle import TRANSITIONS, EventLog, SimulatedCrash, holds_kv
from kvlab.core.recovery import recover
from kvlab.core.scheduler import ProductionScheduler, SchedulerConfig
from kvlab.core.scheduler_api import FinishReason, RequestStatus, RuntimeRequest
from kvlab.sim.tokens import drive

from ._common import require_answer

S = RequestStatus

#: The moves of :func:`check_legal_moves`, as (from, to) status names.
MOVES = (
    ("waiting", "running"), ("waiting", "finished"), ("running", "finished"),
    ("running", "preempted"), ("preempted", "finished"), ("preempted", "running"),
    ("finished", "cancelled"), ("rejected", "waiting"), ("waiting", "rejected"),
    ("running", "waiting"),
)


def check_legal_moves(answer) -> str:
    """``answer``: a list of booleans, one per pair in :data:`MOVES`: is the move allowed?"""
    require_answer(answer, "a list of True/False, one per move in MOVES")
    answer = list(answer)
    if len(answer) != len(MOVES):
        raise AssertionError(f"expected {len(MOVES)} booleans, got {len(answer)}")
    for (src, dst), got in zip(MOVES, answer, strict=True):
        want = S(dst) in TRANSITIONS[S(src)]
        if bool(got) != want:
            hint = ("a preempted request recomputes: it must run again before it can finish"
                    if src == "preempted" else "look at TRANSITIONS[RequestStatus(...)]")
            raise AssertionError(f"{src} -> {dst} is {'allowed' if want else 'illegal'} ({hint})")
    return f"Correct: {sum(answer)} of the {len(MOVES)} moves are legal."


def check_holds_kv(answer) -> str:
    """``answer``: dict status name -> bool: does a request in that status own KV blocks?"""
    require_answer(answer, "a dict {status name: True/False} for all seven statuses")
    want = {s.value: holds_kv(s) for s in S}
    if set(answer) != set(want):
        raise AssertionError(f"give exactly these keys: {sorted(want)}")
    wrong = sorted(k for k in want if bool(answer[k]) != want[k])
    if wrong:
        raise AssertionError(f"wrong for {wrong}: only running requests (prefilling or "
                             "decoding) hold a block table; preempted ones gave theirs back")
    return "Correct: only RUNNING holds KV."


CONFIG = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, prefill_chunk=4,
                         admission="watermark")


def crash_scenario(crash_at: int = 37):
    """A scripted run crashed before event ``crash_at``: returns ``(events, kv)``, the durable
    log and the surviving KV manager (a fresh copy on every call)."""
    kv = KVCacheManager(8, 4)
    log = EventLog(crash_at=crash_at)
    sched = ProductionScheduler(kv, CONFIG, log=log)
    arrivals = {1: [RuntimeRequest(f"q{i}", tuple(range(10 * i + 1, 10 * i + 8)), max_tokens=6)
                    for i in range(3)],
                3: [RuntimeRequest("q3", (99, 98, 97), max_tokens=3)]}
    try:
        drive(sched, arrivals=arrivals, aborts={4: ["q1"]})
    except SimulatedCrash:
        pass
    else:
        raise ValueError(f"the run ended before event {crash_at}; pick a smaller index")
    return list(log.events), kv


def check_orphans(answer, crash_at: int = 37) -> str:
    """``answer``: the set of request ids whose KV recovery must free in ``crash_scenario``."""
    require_answer(answer, "a set of request ids")
    events, kv = crash_scenario(crash_at)
    _, report = recover(events, kv, lambda kv, log: ProductionScheduler(kv, CONFIG, log=log))
    want = set(report.freed)
    got = set(answer)
    if got != want:
        extra, missed = sorted(got - want), len(want - got)
        parts = [f"{rid!r} is not an orphan" for rid in extra]
        if missed:
            parts.append(f"you missed {missed} orphan{'s' if missed > 1 else ''}")
        raise AssertionError("; ".join(parts) + ". An orphan is a request the manager still "
                             "holds KV for while its last logged status is not running.")
    return f"Correct: {sorted(want) or 'nothing'} to free; {report.summary()}."


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


#: Exercise 1: the tight run, with request "q2" aborted just before this step.
ABORT_STEP = 8


def _status_path(rid: str, log: EventLog) -> list[str]:
    path = ["waiting"]
    for e in log.events:
        if e.request_id == rid and e.kind == "transition":
            path.append(e.data[1])
    return path


def check_status_path(path, finish_reason) -> str:
    """Exercise 1: the statuses ``q2`` passes through in the tight run when its client aborts
    it just before step :data:`ABORT_STEP`, starting with ``"waiting"``, and its finish
    reason."""
    require_answer(path, "the list of statuses")
    require_answer(finish_reason, "the finish reason")
    log = EventLog()
    sched = tight_scheduler(log=log)
    drive(sched, arrivals=tight_arrivals(), aborts={ABORT_STEP: ["q2"]}, check=True)
    truth = _status_path("q2", log)
    path = [str(p).strip().lower() for p in path]
    for i, (got, want) in enumerate(zip(path, truth, strict=False)):
        if got != want:
            raise AssertionError(f"entry {i} ({got!r}) diverges from what the scheduler did; "
                                 "the entries before it are right.")
    if len(path) != len(truth):
        raise AssertionError("your path is right as far as it goes but "
                             + ("stops too early." if len(path) < len(truth)
                                else "goes on after the request ended."))
    reason = sched.get_request("q2").finish_reason
    if str(finish_reason).strip().lower() != reason.value:
        raise AssertionError(f"{finish_reason!r} is not the finish reason; the reasons are "
                             f"{[f.value for f in FinishReason]}.")
    return (f"Correct: {' -> '.join(truth)}, finish reason {reason.value!r}. A preempted "
            "request holds no KV, so the abort has nothing to release.")


def preemptions_with(num_blocks: int) -> int:
    """Preemptions in the tight run on a pool of ``num_blocks`` blocks."""
    sched = tight_scheduler(num_blocks)
    drive(sched, arrivals=tight_arrivals(), check=True)
    return sum(r.num_preemptions for r in sched.requests())


def check_no_preemption_blocks(num_blocks) -> str:
    """Exercise 2: the smallest pool (in blocks) on which the tight run preempts nothing."""
    require_answer(num_blocks, "the number of blocks")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 4:
        raise AssertionError("give a whole number of blocks, at least 4 (one request's prompt "
                             "needs some)")
    if preemptions_with(num_blocks) > 0:
        raise AssertionError(f"with {num_blocks} blocks the run still preempts: too low.")
    if preemptions_with(num_blocks - 1) == 0:
        raise AssertionError(f"{num_blocks} blocks avoid preemption, but so does one fewer: "
                             "too high.")
    return (f"Correct: {num_blocks} blocks. Every request ends holding prompt + outputs "
            "rounded up to whole blocks, and all three run at once.")


def check_crash_design(crash_at) -> str:
    """Exercise 4: a crash point of the tight run at which recovery (the manager survives) both
    frees at least one orphan and resumes at least one request, and the run then completes."""
    require_answer(crash_at, "the crash point")
    full = EventLog()
    drive(tight_scheduler(log=full), arrivals=tight_arrivals())
    n = len(full.events)
    if isinstance(crash_at, bool) or not isinstance(crash_at, int) or not 0 <= crash_at < n:
        raise AssertionError(f"crash_at must be an event index from 0 to {n - 1}")
    log = EventLog(crash_at=crash_at)
    sched = tight_scheduler(log=log)
    with contextlib.suppress(SimulatedCrash):
        drive(sched, arrivals=tight_arrivals())
    recovered, report = recover(log.events, sched.kv,
                                lambda kv, lg: ProductionScheduler(kv, TIGHT_CONFIG, log=lg))
    drive(recovered, check=True)
    if not report.freed:
        raise AssertionError(f"crashing before event {crash_at} leaves no orphan: every table "
                             "the manager holds belongs to a request the log calls running.")
    if not report.resumed:
        raise AssertionError(f"crashing before event {crash_at} frees an orphan, but no request "
                             "is left running to resume.")
    return (f"Correct: recovery {report.summary()}. The crash fell between a transition out "
            "of RUNNING and the release it implies, while another request was running.")
