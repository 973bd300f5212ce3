"""Chapter 5 exercises: the transition table, who holds KV, and recovery after a crash.

Each check computes the truth with :mod:`kvlab.core.lifecycle` / :mod:`kvlab.core.recovery`
and raises ``AssertionError`` with a hint when the answer differs.
"""

from __future__ import annotations

from kvlab.core.kv_manager import KVCacheManager
from kvlab.core.lifecycle import TRANSITIONS, EventLog, SimulatedCrash, holds_kv
from kvlab.core.recovery import recover
from kvlab.core.scheduler import ProductionScheduler, SchedulerConfig
from kvlab.core.scheduler_api import RequestStatus, RuntimeRequest
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
        raise AssertionError(
            f"expected {sorted(want) or 'no orphans'}, got {sorted(got) or 'none'}: an orphan is "
            "a request the manager still holds KV for while its last logged status is not "
            "running")
    return f"Correct: {sorted(want) or 'nothing'} to free; {report.summary()}."
