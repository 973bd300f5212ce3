"""Crash recovery: crash at every event of a scripted run, recover, finish, compare."""

from __future__ import annotations

import pytest

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RUNNING_STATUSES, FinishReason, RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.labs.invariants import check_kv_manager, check_scheduler
from kvlab.labs.recovery import recover, replay
from kvlab.labs.recovery.event_log import EventLog, SimulatedCrash
from kvlab.sim.tokens import drive, greedy_tokens

S = RequestStatus
SHARED = tuple(range(100, 108))
CFG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=6,
                      admission="watermark")


def script():
    """Arrivals over steps (shared prefixes), an abort, an n=2 request fanned out as the engine
    does ("e" and "e#1"); small KV forces preemptions."""
    def r(rid, tail, n, **kw):
        return RuntimeRequest(rid, SHARED + tail, max_tokens=n, **kw)

    arrivals = {
        1: [r("a", (1, 2, 3), 6), r("b", (4, 5), 7)],
        2: [r("c", (6,), 5, priority=1)],
        4: [r("d", (7, 8, 9, 10), 6), r("e", (11,), 3), r("e#1", (11,), 3)],
        6: [r("f", (12, 13), 4)],
    }
    aborts = {7: ["d"]}
    return arrivals, aborts


class RefusingKV(KVCacheManager):
    """Refuses the first admission of "c" with OutOfBlocks (unchanged, as the contract says),
    although the scheduler's capacity check passed: a failed acquisition in the log."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refused = False

    def admit(self, request_id, scope, token_ids, num_tokens, hit=None):
        if request_id == "c" and not self.refused:
            self.refused = True
            raise OutOfBlocks("refused once (test)", 1, 0)
        return super().admit(request_id, scope, token_ids, num_tokens, hit)


def build(cls, log, kv_cls=KVCacheManager):
    kv = kv_cls(8, 4)
    return cls(kv, CFG, log=log)


def finish_run(sched, arrivals, aborts, start_step):
    """Continue a (recovered) scheduler: resubmit what it never saw, abort what is due."""
    known = {r.request_id for r in sched.requests()}
    pending = [q for step in sorted(arrivals) for q in arrivals[step] if q.request_id not in known]
    later_aborts = {1: [rid for step, ids in aborts.items() if step > start_step for rid in ids]}
    return drive(sched, arrivals={1: [copy_request(q) for q in pending]}, aborts=later_aborts,
                 check=check_scheduler)


def copy_request(r):
    return RuntimeRequest(r.request_id, r.prompt_token_ids, r.max_tokens, priority=r.priority)


def fresh(d):
    return {k: [copy_request(q) for q in v] for k, v in d.items()}


def reference(cls, kv_cls=KVCacheManager):
    arrivals, aborts = script()
    sched = build(cls, EventLog(), kv_cls)
    result = drive(sched, arrivals=fresh(arrivals), aborts=aborts, check=check_scheduler)
    return sched, result


@pytest.mark.parametrize("cls", [BaselineScheduler, ProductionScheduler])
def test_reference_run_exercises_every_path(cls):
    sched, result = reference(cls)
    kinds = {e.kind for e in sched.log}
    assert kinds == {"add", "transition", "acquire", "acquired", "release", "released", "progress"}
    assert sum(len(o.preempted) for o in result.outputs) > 0
    assert sched.get_request("d").status == S.CANCELLED
    assert sched.get_request("e#1").output_token_ids == sched.get_request("e").output_token_ids
    # replaying the whole log reproduces every request
    replayed = replay(sched.log.events)
    for r in sched.requests():
        again = replayed[r.request_id].request
        assert (again.status, again.output_token_ids, again.finish_reason) == (
            r.status, r.output_token_ids, r.finish_reason)


@pytest.mark.parametrize("cls", [BaselineScheduler, ProductionScheduler])
def test_refused_admission_is_logged_with_its_outcome(cls):
    """A failed admission ends with the compensating ``acquire_failed`` right after its
    intent; the request stays waiting, holds no KV, and is admitted later."""
    sched, _ = reference(cls, RefusingKV)
    events = [e for e in sched.log.events if e.request_id == "c"]
    kinds = [e.kind for e in events]
    i = kinds.index("acquire_failed")
    assert kinds[i - 1] == "acquire" and kinds[i + 1:].count("acquire_failed") == 0
    assert events[i].data == ("admit", "OutOfBlocks")
    assert kinds[i + 1] == "acquire" and kinds[i + 2] == "acquired"
    assert sched.get_request("c").status == S.FINISHED


@pytest.mark.parametrize("kv_cls", [KVCacheManager, RefusingKV], ids=["kv", "refusing-kv"])
@pytest.mark.parametrize("cls", [BaselineScheduler, ProductionScheduler])
def test_crash_at_every_event_then_recover(cls, kv_cls):
    ref_sched, _ = reference(cls, kv_cls)
    n_events = len(ref_sched.log)
    want = {r.request_id: r.output_token_ids for r in ref_sched.requests()
            if r.status == S.FINISHED}
    arrivals, aborts = script()
    outcomes = {"freed": 0, "requeued": 0, "resumed": 0}
    for k in range(n_events):
        log = EventLog(crash_at=k)
        sched = build(cls, log, kv_cls)
        kv = sched.kv
        with pytest.raises(SimulatedCrash):
            drive(sched, arrivals=fresh(arrivals), aborts=aborts)
        crash_step = sched.step_count
        # Oracle from the dead scheduler's memory (statuses change only after being logged).
        orphans = sorted(r.request_id for r in sched.requests()
                         if kv.has(r.request_id) and r.status not in RUNNING_STATUSES)
        frees = []
        real_free = kv.free

        def counting_free(rid, real_free=real_free, frees=frees):
            frees.append(rid)
            return real_free(rid)

        kv.free = counting_free
        recovered, report = recover(log.events, kv, lambda kv, log: cls(kv, CFG, log=log))
        kv.free = real_free
        assert sorted(report.freed) == orphans, k
        assert len(frees) == len(set(frees)), f"crash at {k}: freed twice"
        assert not report.unknown_freed
        check_scheduler(recovered)
        check_kv_manager(kv)
        for rid in recovered.running:
            assert kv.has(rid)
        outcomes["freed"] += len(report.freed)
        outcomes["requeued"] += len(report.requeued)
        outcomes["resumed"] += len(report.resumed)
        finish_run(recovered, arrivals, aborts, crash_step)
        check_scheduler(recovered)
        assert not kv.requests(), f"crash at {k}: KV leaked"
        assert kv.num_allocatable_blocks() == kv.num_blocks
        for r in recovered.requests():
            assert r.status.is_terminal and r.finish_reason is not None
            if r.status == S.FINISHED:
                assert r.finish_reason == FinishReason.LENGTH
                if r.request_id in want:
                    assert r.output_token_ids == want[r.request_id], (k, r.request_id)
    # every decision a crash of the scheduler alone can need (requeue needs a lost table: below)
    assert outcomes["freed"] and outcomes["resumed"], outcomes


@pytest.mark.parametrize("cls", [BaselineScheduler, ProductionScheduler])
def test_lost_kv_tables_requeue_running_requests(cls):
    """The KV manager restarted too (every table lost): every request the log says is running
    is requeued to recompute, and the run still ends with the uninterrupted outputs."""
    ref_sched, _ = reference(cls)
    want = {r.request_id: r.output_token_ids for r in ref_sched.requests()
            if r.status == S.FINISHED}
    arrivals, aborts = script()
    n_events = len(ref_sched.log)
    requeued = 0
    for k in range(n_events // 3, n_events, 7):
        log = EventLog(crash_at=k)
        sched = build(cls, log)
        with pytest.raises(SimulatedCrash):
            drive(sched, arrivals=fresh(arrivals), aborts=aborts)
        running = sorted(r.request_id for r in sched.requests()
                         if r.status in RUNNING_STATUSES)
        empty = KVCacheManager(8, 4)
        recovered, report = recover(log.events, empty, lambda kv, log: cls(kv, CFG, log=log))
        assert sorted(report.requeued + report.finished) == running, k
        assert not report.resumed and not report.freed
        requeued += len(report.requeued)
        finish_run(recovered, arrivals, aborts, sched.step_count)
        assert not empty.requests(), f"crash at {k}: KV leaked"
        for r in recovered.requests():
            if r.status == S.FINISHED and r.request_id in want:
                assert r.output_token_ids == want[r.request_id], (k, r.request_id)
    assert requeued


def test_recover_with_no_crash_changes_nothing():
    sched, _ = reference(ProductionScheduler)
    kv = sched.kv
    state = kv.state_tuple()
    recovered, report = recover(sched.log.events, kv,
                                lambda kv, log: ProductionScheduler(kv, CFG, log=log))
    assert kv.state_tuple() == state
    assert report.summary().startswith("resumed 0, requeued 0, orphans freed 0")
    assert not recovered.has_unfinished_requests()


def test_orphan_after_finish_before_release_is_freed_once():
    log = EventLog()
    kv = KVCacheManager(16, 4)
    sched = ProductionScheduler(kv, CFG, log=log)
    sched.add_request(RuntimeRequest("x", (1, 2, 3), max_tokens=1))
    out = sched.schedule()
    # crash right after the FINISHED transition is logged, before the release intent
    finished_at = len(log) + 1   # progress, then transition(FINISHED)
    log.crash_at = finished_at + 1
    with pytest.raises(SimulatedCrash):
        sched.update_from_output(out, {"x": greedy_tokens(sched.get_request("x"))})
    assert log.events[-1].data[1] == "finished" and kv.has("x")
    recovered, report = recover(log.events, kv, lambda kv, log: ProductionScheduler(kv, CFG,
                                                                                     log=log))
    assert report.freed == ("x",) and not kv.has("x")
    assert recovered.get_request("x").finish_reason == FinishReason.LENGTH
    check_scheduler(recovered)


class AddIndexLog(EventLog):
    """An EventLog that also remembers the index of every ``add`` (compaction drops them)."""

    def __init__(self, added_at: dict[str, int]):
        super().__init__()
        self.added_at = added_at

    def append(self, kind, request_id, data=(), step=0):
        event = super().append(kind, request_id, data, step)
        if kind == "add":
            self.added_at[request_id] = event.index
        return event


def test_log_compaction_keeps_recovery_exact():
    """A long run compacts its log (ended, released requests dropped); a crash after that is
    still recovered exactly, and the log stays proportional to the live requests."""
    def workload():
        return {s: [RuntimeRequest(f"s{s}-{i}", (*SHARED, s, i), max_tokens=3 + (s + i) % 5)
                    for i in range(2)] for s in range(1, 40)}

    def build_small(kv, log, compact_at=60):
        sched = ProductionScheduler(kv, CFG, log=log)
        sched.compact_min_events = sched._compact_at = compact_at   # compact early, often
        return sched

    full = build_small(KVCacheManager(8, 4), EventLog(), compact_at=10**9)
    drive(full, arrivals=workload(), check=check_scheduler)
    want = {r.request_id: r.output_token_ids for r in full.requests()}
    added_at: dict[str, int] = {}   # where each request was added in the compacting run
    ref = build_small(KVCacheManager(8, 4), AddIndexLog(added_at))
    drive(ref, arrivals=workload(), check=check_scheduler)
    total = ref.log.next_index
    checkpoints = [e for e in ref.log if e.kind == "checkpoint"]
    assert len(checkpoints) == 1, "compaction keeps only the latest checkpoint"
    assert total - (checkpoints[0].seq + 1) == len(full.log), "compaction changed the run"
    assert {r.request_id: r.output_token_ids for r in ref.requests()} == want
    assert len(ref.log) < total / 2, "the log was never compacted"
    for k in range(total // 2, total, 17):
        kv = KVCacheManager(8, 4)
        log = EventLog(crash_at=k)
        with pytest.raises(SimulatedCrash):
            drive(build_small(kv, log), arrivals=workload())
        assert log.events[0].index > 0                 # compacted before the crash
        assert any(e.kind == "checkpoint" for e in log)
        recovered, _ = recover(log.events, kv, build_small)
        known = {r.request_id for r in recovered.requests()}
        # never submitted before the crash: the client resubmits; compacted ones had ended
        resubmit = [copy_request(q) for qs in workload().values() for q in qs
                    if q.request_id not in known and added_at[q.request_id] >= k]
        drive(recovered, arrivals={1: resubmit}, check=check_scheduler)
        assert not kv.requests() and kv.num_allocatable_blocks() == kv.num_blocks
        for r in recovered.requests():
            assert r.status.is_terminal
            assert r.output_token_ids == want[r.request_id]
