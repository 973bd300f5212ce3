"""Request lifecycle: the transition table, idempotent ends, write-ahead event log."""

from __future__ import annotations

import copy

import pytest

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import (
    TRANSITIONS,
    FinishReason,
    IllegalTransition,
    Lifecycle,
    RequestStatus,
    RuntimeRequest,
    holds_kv,
)
from kvlab.labs.invariants import check_kv_manager
from kvlab.labs.recovery.event_log import EventLog, SimulatedCrash, canonical
from kvlab.reference import ALLOWED, Phase, Request

S = RequestStatus


def make(status: RequestStatus = S.WAITING) -> RuntimeRequest:
    return RuntimeRequest("r", (1, 2, 3), max_tokens=4, status=status)


def test_reference_request_asserts_of_the_spec():
    request = Request("r0", 3)
    request.transition(Phase.PREFILL)
    request.transition(Phase.DECODE)
    request.transition(Phase.FINISHED)
    request.transition(Phase.FINISHED)  # idempotent
    with pytest.raises(ValueError):
        request.transition(Phase.CANCELLED)
    assert request.phase == Phase.FINISHED


def _runtime(phase: Phase) -> RequestStatus:
    """The runtime status of a spec phase: PREFILL and DECODE are both RUNNING (derived from
    the token counts at runtime), the others map by name."""
    return S.RUNNING if phase in (Phase.PREFILL, Phase.DECODE) else S(phase.value)


def test_runtime_table_extends_the_reference_table():
    """Every move the spec allows is allowed at runtime (PREFILL -> DECODE is no move)."""
    for src, targets in ALLOWED.items():
        for dst in targets:
            if _runtime(src) != _runtime(dst):
                assert _runtime(dst) in TRANSITIONS[_runtime(src)], (src, dst)
    for status in S:
        assert status in TRANSITIONS
        if status.is_terminal:
            assert not TRANSITIONS[status]


def test_preempted_returns_to_running_and_holds_no_kv():
    assert S.RUNNING in TRANSITIONS[S.PREEMPTED] and S.PREEMPTED in TRANSITIONS[S.RUNNING]
    assert [s for s in S if holds_kv(s)] == [S.RUNNING]


def test_prefill_and_decode_are_derived_from_token_counts():
    r = RuntimeRequest("r", (1, 2, 3), max_tokens=4, status=S.RUNNING)
    assert (r.is_decoding, r.phase) == (False, "prefill")       # prompt not computed
    r.num_computed_tokens = 3
    r.output_token_ids.append(9)
    assert (r.is_decoding, r.phase) == (True, "decode")         # only the sampled token behind
    r.num_computed_tokens = 2
    assert (r.is_decoding, r.phase) == (False, "prefill")       # recomputing after preemption
    r.status = S.PREEMPTED
    assert (r.is_decoding, r.phase) == (False, "preempted")


@pytest.mark.parametrize("src", list(S))
@pytest.mark.parametrize("dst", list(S))
def test_every_pair_is_allowed_or_raises_and_changes_nothing(src, dst):
    life = Lifecycle(EventLog())
    request = make(src)
    before = copy.deepcopy(request)
    reason = {S.FINISHED: FinishReason.STOP}.get(dst)
    if dst in TRANSITIONS[src]:
        assert life.transition(request, dst, reason) is True
        assert request.status == dst
        assert len(life.log) == 1
        assert life.log.events[0].data == (src.value, dst.value, reason.value if reason else (
            None if not dst.is_terminal else request.finish_reason.value))
    elif src == dst and dst.is_terminal:
        assert life.transition(request, dst, reason) is False
        assert request == before and len(life.log) == 0
    else:
        with pytest.raises(IllegalTransition):
            life.transition(request, dst, reason)
        assert request == before and len(life.log) == 0


def test_finish_and_cancel_are_idempotent():
    life = Lifecycle(EventLog())
    request = make(S.RUNNING)
    assert life.finish(request, FinishReason.LENGTH)
    n = len(life.log)
    assert not life.finish(request, FinishReason.LENGTH)
    assert not life.cancel(request)           # a late abort of a finished request is a no-op
    assert request.status == S.FINISHED and request.finish_reason == FinishReason.LENGTH
    assert len(life.log) == n

    other = make(S.WAITING)
    assert life.cancel(other) and other.finish_reason == FinishReason.ABORT
    assert not life.cancel(other)
    assert not life.fail(other, "late")
    assert other.status == S.CANCELLED


def test_finish_reason_must_fit_status():
    life = Lifecycle(EventLog())
    request = make(S.RUNNING)
    with pytest.raises(ValueError, match="does not fit"):
        life.transition(request, S.FINISHED, FinishReason.ABORT)
    with pytest.raises(ValueError, match="does not fit"):
        life.transition(request, S.FINISHED)      # FINISHED needs STOP or LENGTH
    with pytest.raises(ValueError, match="no finish reason"):
        life.transition(request, S.PREEMPTED, FinishReason.STOP)
    with pytest.raises(TypeError):
        life.transition(request, "finished")      # type: ignore[arg-type]
    assert request.status == S.RUNNING and len(life.log) == 0


def test_reject_records_reason_and_message():
    life = Lifecycle(EventLog())
    request = make()
    life.reject(request, "queue full")
    assert request.status == S.REJECTED
    assert request.finish_reason == FinishReason.REJECTED
    assert request.status_message == "queue full"


def test_preemption_counts_and_keeps_outputs():
    life = Lifecycle(EventLog())
    request = make(S.RUNNING)
    request.output_token_ids = [7, 8]
    life.transition(request, S.PREEMPTED)
    assert request.num_preemptions == 1 and request.output_token_ids == [7, 8]
    life.transition(request, S.RUNNING)
    assert request.status == S.RUNNING


def test_release_is_idempotent_and_logged_write_ahead():
    kv = KVCacheManager(8, 4)
    life = Lifecycle(EventLog())
    request = make(S.RUNNING)
    life.acquire(request, "admit", lambda: kv.admit("r", (), (1, 2, 3), 3))
    assert kv.has("r")
    assert life.release(request, kv) is True
    state = kv.state_tuple()
    n = len(life.log)
    assert life.release(request, kv) is False
    assert kv.state_tuple() == state and len(life.log) == n
    kinds = [e.kind for e in life.log]
    assert kinds == ["acquire", "acquired", "release", "released"]
    check_kv_manager(kv)


def test_failed_acquisition_logs_the_compensating_outcome():
    """A refused acquisition ends with ``acquire_failed`` (no dangling intent): the log and
    its replay agree with the manager that the request holds no KV."""
    from kvlab.labs.recovery import replay

    kv = KVCacheManager(1, 4)
    life = Lifecycle(EventLog())
    request = make()
    life.add(request)
    state = kv.state_tuple()
    with pytest.raises(OutOfBlocks):
        life.acquire(request, "admit", lambda: kv.admit("r", (), tuple(range(9)), 9))
    assert [e.kind for e in life.log] == ["add", "acquire", "acquire_failed"]
    assert life.log.events[-1].data == ("admit", "OutOfBlocks")
    assert not kv.has("r") and kv.state_tuple() == state
    assert replay(life.log.events)["r"].kv == "none"


def test_event_log_crash_at_stops_before_the_event():
    log = EventLog(crash_at=2)
    log.append("add", "a", ())
    log.append("release", "a")
    with pytest.raises(SimulatedCrash):
        log.append("released", "a", (True,))
    assert len(log) == 2 and [e.index for e in log] == [0, 1]
    with pytest.raises(ValueError, match="unknown event kind"):
        EventLog().append("bogus", "a")


def test_records_carry_index_per_request_seq_and_checksum():
    log = EventLog()
    for rid in ("a", "b", "a", "a", "b"):
        log.append("release", rid)
    assert [e.index for e in log] == [0, 1, 2, 3, 4]
    assert [(e.request_id, e.seq) for e in log] == [("a", 0), ("b", 0), ("a", 1), ("a", 2),
                                                    ("b", 1)]
    assert all(e.checksum == e.expected_checksum() for e in log)
    assert log.events[0].checksum != log.events[1].checksum   # the request id is covered


def test_canonical_encoding_tells_types_apart_and_sorts_sets():
    assert len({canonical(v) for v in (1, True, "1", 1.0, None, (1,), [1])}) == 7
    assert canonical(frozenset({3, 1, 2})) == canonical({2, 3, 1})
    assert canonical(("a,b",)) != canonical(("a", "b"))
    assert canonical(S.RUNNING) == canonical(S.RUNNING) != canonical("running")
    request = make()
    assert canonical(request) == canonical(copy.deepcopy(request))
    with pytest.raises(TypeError):
        canonical(object())


def test_append_refuses_what_the_log_cannot_hold():
    log = EventLog()
    with pytest.raises(ValueError, match="compact only"):
        log.append("checkpoint", "a", (0,))
    with pytest.raises(ValueError, match="non-empty str"):
        log.append("release", "")
    with pytest.raises(ValueError, match="plain values"):
        log.append("progress", "a", (1, object()))
    assert len(log) == 0 and log.next_index == 0


def test_add_logs_a_fresh_copy_that_later_progress_does_not_change():
    life = Lifecycle(EventLog())
    request = make()
    life.add(request)
    request.output_token_ids.append(7)       # the live request moves on; the log does not
    request.num_computed_tokens = 3
    (event,) = life.log.events
    logged = event.data[0]
    assert logged is not request and logged.status == S.WAITING
    assert logged.output_token_ids == [] and logged.num_computed_tokens == 0


def test_compact_drops_whole_requests_and_keeps_only_the_latest_checkpoint():
    log = EventLog()
    for rid in ("a", "b", "c", "a", "b"):
        log.append("release", rid, (), step=3)
    assert log.compact({"a", "nobody"}) == 2
    assert [(e.index, e.request_id) for e in log] == [(1, "b"), (2, "c"), (4, "b"), (5, "")]
    checkpoint = log.events[-1]
    assert (checkpoint.kind, checkpoint.data, checkpoint.seq, checkpoint.step) == (
        "checkpoint", (2,), 0, 3)
    log.append("release", "c")
    assert log.compact({"b", ""}) == 2             # the old checkpoint goes too
    assert [(e.index, e.kind, e.data) for e in log] == [
        (2, "release", ()), (6, "release", ()), (7, "checkpoint", (5,))]
    assert log.events[-1].seq == 1 and log.compact({"zzz"}) == 0 and len(log) == 3


def test_a_crash_while_writing_the_checkpoint_leaves_the_log_as_it_was():
    log = EventLog()
    log.append("release", "a")
    log.append("release", "b")
    log.crash_at = 2
    before = list(log.events)
    with pytest.raises(SimulatedCrash):
        log.compact({"a"})
    assert log.events == before and log.next_index == 2
    rebuilt = EventLog(events=list(before))          # recovery continues the numbering
    assert rebuilt.append("release", "a").seq == 1 and rebuilt.next_index == 3
