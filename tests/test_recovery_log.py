"""Recovery refuses a log it cannot trust, and never leaves the KV manager half-changed.

Each corruption is applied to the durable log of a crashed run; ``recover`` must raise
:class:`CorruptLog` naming the bad record and leave the manager and the log exactly as they were.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import FinishReason, RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.labs.invariants import check_scheduler
from kvlab.labs.recovery import plan_recovery, recover, replay
from kvlab.labs.recovery.event_log import CorruptLog, Event, EventLog, SimulatedCrash, seal
from kvlab.sim.tokens import drive

S = RequestStatus
CFG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=6,
                      admission="watermark")
SHARED = tuple(range(100, 108))


def arrivals(stop_token_ids=frozenset()):
    def r(rid, tail, n):
        return RuntimeRequest(rid, SHARED + tail, max_tokens=n, stop_token_ids=stop_token_ids)

    return {1: [r("a", (1, 2, 3), 6), r("b", (4, 5), 7)], 3: [r("c", (6,), 5)],
            4: [r("d", (7, 8, 9), 4)]}


def make(kv, log):
    return ProductionScheduler(kv, CFG, log=log)


def reference(stop_token_ids=frozenset()):
    sched = make(KVCacheManager(8, 4), EventLog())
    drive(sched, arrivals=arrivals(stop_token_ids), check=check_scheduler)
    return sched


def crashed(k, stop_token_ids=frozenset()):
    """The durable events and surviving KV manager of the scripted run crashed before ``k``."""
    kv = KVCacheManager(8, 4)
    log = EventLog(crash_at=k)
    with pytest.raises(SimulatedCrash):
        drive(make(kv, log), arrivals=arrivals(stop_token_ids))
    return list(log.events), kv


def busy_crash():
    """A crash point where two requests hold KV (so a wrong recovery would show) and every
    kind of record has been written."""
    total = len(reference().log)
    for k in range(total // 3, total):
        events, kv = crashed(k)
        if (len(kv.requests()) >= 2 and events[-1].kind == "progress"
                and any(e.kind == "released" for e in events)):
            return events, kv
    raise AssertionError("no crash point with two tables")


def renumber(events):
    """Give ``events`` contiguous global and per-request numbers and fresh checksums: the
    result has perfect integrity data, so only the semantic checks can catch what is wrong."""
    seqs: dict[str, int] = {}
    out = []
    for i, e in enumerate(events):
        seq = seqs.get(e.request_id, 0)
        seqs[e.request_id] = seq + 1
        out.append(seal(replace(e, index=i, seq=seq)))
    return out


def splice(events, i, *new):
    """``events`` with ``events[i]`` replaced by the records ``new`` (none: dropped)."""
    return [*events[:i], *new, *events[i + 1:]]


def next_of(events, i):
    """The next event of the same request as ``events[i]`` (StopIteration if none)."""
    return next(e for e in events[i + 1:] if e.request_id == events[i].request_id)


def at(events, kind, nth=0, where=lambda e: True):
    """Position of the ``nth`` event of ``kind`` satisfying ``where``."""
    return [i for i, e in enumerate(events) if e.kind == kind and where(e)][nth]


def refused(events, kv, bad_index, request_id, kind, problem):
    """recover(events) raises CorruptLog naming the record; manager and log are unchanged."""
    state, kept = kv.state_tuple(), copy.deepcopy(events)
    with pytest.raises(CorruptLog, match=problem) as info:
        recover(events, kv, make)
    error = info.value
    assert (error.index, error.request_id, error.kind) == (bad_index, request_id, kind)
    assert f"event {bad_index}" in str(error) and repr(request_id) in str(error)
    assert kv.state_tuple() == state, "recover changed the KV manager before refusing"
    assert events == kept, "recover changed the log"
    return error


# ------------------------------------------------------------------ corruptions, one by one


def test_intact_log_has_contiguous_numbers_and_valid_checksums():
    events = reference().log.events
    assert [e.index for e in events] == list(range(len(events)))
    for rid in {e.request_id for e in events}:
        assert [e.seq for e in events if e.request_id == rid] == list(range(
            sum(e.request_id == rid for e in events)))
    assert all(e.checksum == e.expected_checksum() for e in events)
    assert replay(busy_crash()[0])              # the crashed prefix is valid too


def test_duplicated_progress_is_refused():
    events, kv = busy_crash()
    i = at(events, "progress", -1, lambda e: e.data[1] is not None)
    dup = splice(events, i, events[i], events[i])
    refused(dup, kv, events[i].index, events[i].request_id, "progress", "duplicate index")
    # Renumbered and resealed, the copy is still a token sampled twice for one position.
    dup = renumber(dup)
    refused(dup, kv, i + 1, events[i].request_id, "progress", "computed count reaches")


def test_dropped_event_is_refused():
    events, kv = busy_crash()
    i = next(i for i, e in enumerate(events) if e.kind == "progress" and e.data[1] is not None
             and next_of(events, i).kind == "progress")
    gone = splice(events, i)
    refused(gone, kv, events[i + 1].index, events[i + 1].request_id, events[i + 1].kind,
            "index gap")
    # Renumbered, the request's next progress claims KV for a token it never sampled.
    nxt = next_of(events, i)
    refused(renumber(gone), kv, nxt.index - 1, nxt.request_id, "progress",
            "computed tokens, but the request has")
    # A dropped acquisition intent leaves an outcome without an intent.
    j = at(events, "acquire", 1)
    gone = renumber(events[:j] + events[j + 1:])
    refused(gone, kv, j, events[j].request_id, "acquired", "without an open acquire intent")


def test_per_request_gap_is_refused():
    """An event lost and the global numbering closed over it: the per-request seq shows it."""
    events, kv = busy_crash()
    i = at(events, "progress", 3)
    nxt = next_of(events, i)
    gone = [seal(replace(e, index=n)) for n, e in enumerate(events[:i] + events[i + 1:])]
    refused(gone, kv, nxt.index - 1, nxt.request_id, nxt.kind, "per-request gap")


def test_unknown_kind_is_refused():
    events, kv = busy_crash()
    i = at(events, "progress", 1)
    bad = splice(events, i, seal(replace(events[i], kind="progresss")))
    refused(bad, kv, events[i].index, events[i].request_id, "progresss", "unknown kind")


def test_flipped_checksum_or_edited_record_is_refused():
    events, kv = busy_crash()
    i = at(events, "transition", 2)
    e = events[i]
    flipped = splice(events, i, replace(e, checksum=e.checksum ^ 0x10))
    refused(flipped, kv, e.index, e.request_id, "transition", "bad checksum")
    j = at(events, "progress", 1, lambda e: e.data[1] is not None)
    p = events[j]
    edited = splice(events, j, replace(p, data=(p.data[0], p.data[1] + 1)))
    refused(edited, kv, p.index, p.request_id, "progress", "bad checksum")
    moved = splice(events, j, replace(p, request_id="b" if p.request_id != "b" else "a"))
    refused(moved, kv, p.index, moved[j].request_id, "progress", "bad checksum")


def _resealed(events, i, **changes):
    return splice(events, i, seal(replace(events[i], **changes)))


MALFORMED = {
    # name: (kind of the record to change, which one, changes, expected problem); the
    # transitions picked are the first admission (waiting -> running) and a later one
    "token not an int": ("progress", 1, lambda e: {"data": (e.data[0], "7")}, "progress data"),
    "token a bool": ("progress", 1, lambda e: {"data": (e.data[0], True)}, "progress data"),
    "negative computed": ("progress", 1, lambda e: {"data": (-1, e.data[1])}, "progress data"),
    "progress arity": ("progress", 1, lambda e: {"data": e.data[:1]}, "progress data"),
    "transition source": ("transition", -1, lambda e: {"data": ("waiting", *e.data[1:])},
                          "is not the replayed status"),
    "transition forbidden": ("transition", 0, lambda e: {"data": ("waiting", "finished",
                                                                  "length")},
                             "TRANSITIONS forbids waiting -> finished"),
    "bad finish reason": ("transition", 0, lambda e: {"data": ("waiting", "cancelled", "stop")},
                          "does not fit"),
    "unknown status": ("transition", 0, lambda e: {"data": ("waiting", "sleeping", None)},
                       "transition data"),
    "never added": ("progress", 1, lambda e: {"request_id": "ghost", "seq": 1},
                    "never added"),
    "acquire kind": ("acquire", 0, lambda e: {"data": ("steal",)}, "acquire data"),
    "acquired count": ("acquired", 0, lambda e: {"data": (e.data[0], 10**6)},
                       "computed tokens, but the request has"),
    "released arity": ("released", 0, lambda e: {"data": ()}, "released data"),
    "add template": ("add", 0, lambda e: {"data": ("not a request",)}, "add data"),
    "add not fresh": ("add", 0, lambda e: {"data": (replace(e.data[0], output_token_ids=[1]),)},
                      "must be fresh"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_data_is_refused(name):
    events, kv = busy_crash()
    kind, nth, changes, problem = MALFORMED[name]
    not_waiting = (lambda e: e.data[0] != "waiting") if nth == -1 else (lambda e: True)
    i = at(events, kind, nth, not_waiting)
    bad = _resealed(events, i, **changes(events[i]))
    refused(bad, kv, bad[i].index, bad[i].request_id, bad[i].kind, problem)


def test_computed_count_going_back_within_an_admission_is_refused():
    events, kv = busy_crash()

    def after_progress(e, events=events):
        earlier = [x for x in events[:e.index] if x.request_id == e.request_id]
        return earlier[-1].kind == "progress"

    i = at(events, "progress", 0, after_progress)
    e = events[i]
    previous = [x for x in events[:i] if x.request_id == e.request_id][-1]
    bad = _resealed(events, i, data=(previous.data[0] - 1, e.data[1]))
    refused(bad, kv, e.index, e.request_id, "progress", "goes back")


def test_second_add_and_out_of_order_records_are_refused():
    events, kv = busy_crash()
    add = events[0]
    last = events[-1]
    again = seal(Event(last.index + 1, "add", add.request_id, add.data, last.step, seq=0))
    refused([*events, again], kv, again.index, add.request_id, "add", "second add")
    swapped = splice(splice(events, 5, events[6]), 6, events[5])
    refused(swapped, kv, events[6].index, events[6].request_id, events[6].kind, "index gap")


# ------------------------------------------------------------------ compaction checkpoints


class CheckpointIndexLog(EventLog):
    """An EventLog that remembers the index of every checkpoint it wrote."""

    def __init__(self):
        super().__init__()
        self.checkpoints = []

    def compact(self, request_ids, step=None):
        dropped = super().compact(request_ids, step)
        if dropped:
            self.checkpoints.append(self.next_index - 1)
        return dropped


def compacted_crash():
    """A crash after compactions: its log has gaps, explained by one checkpoint record."""
    def build(kv, log):
        sched = make(kv, log)
        sched.compact_min_events = sched._compact_at = 40
        return sched

    work = {s: [RuntimeRequest(f"s{s}", (*SHARED, s), max_tokens=3 + s % 4)] for s in range(1, 25)}
    probe = CheckpointIndexLog()
    drive(build(KVCacheManager(8, 4), probe), arrivals=copy.deepcopy(work))
    assert len(probe.checkpoints) >= 3
    k = probe.checkpoints[len(probe.checkpoints) // 2] + 10   # 10 events after a checkpoint
    kv, log = KVCacheManager(8, 4), EventLog(crash_at=k)
    with pytest.raises(SimulatedCrash):
        drive(build(kv, log), arrivals=copy.deepcopy(work))
    return list(log.events), kv, build


def test_compaction_gaps_are_accounted_for_by_the_checkpoint():
    events, kv, build = compacted_crash()
    cps = [i for i, e in enumerate(events) if e.kind == "checkpoint"]
    assert len(cps) == 1 and events[0].index > 0
    c = cps[0]
    assert events[c].data == (events[c].index - c,)        # the gaps below it, counted
    recover(copy.deepcopy(events), copy.deepcopy(kv), build)   # a valid log recovers
    # An event lost below the checkpoint: the count no longer matches (if no request shows it).
    i = next(i for i in range(c) if events[i].kind == "progress")
    gone = splice(events, i)
    with pytest.raises(CorruptLog, match=r"per-request gap|missing below this checkpoint"):
        recover(gone, kv, build)
    # The checkpoint's own count edited (resealed): refused at the checkpoint.
    bad = _resealed(events, c, data=(events[c].data[0] + 1,))
    refused(bad, kv, events[c].index, "", "checkpoint", "missing below this checkpoint")
    # A gap above the checkpoint is never legitimate.
    j = c + 2
    refused(splice(events, j), kv, events[j + 1].index, events[j + 1].request_id,
            events[j + 1].kind, "index gap")
    # Below the checkpoint gaps are fine, but never a lower index after a higher one.
    g = next(g for g in range(1, c) if events[g].index > events[g - 1].index + 1)
    swapped = splice(splice(events, g - 1, events[g]), g, events[g - 1])
    refused(swapped, kv, events[g - 1].index, events[g - 1].request_id, events[g - 1].kind,
            "out-of-order")
    # Two checkpoints: compaction keeps only the latest.
    twice = [*events, seal(replace(events[c], index=events[-1].index + 1, seq=events[c].seq + 1,
                                   step=events[-1].step))]
    refused(twice, kv, events[-1].index + 1, "", "checkpoint", "second checkpoint")


# ------------------------------------------------------------------ never half-changed


def test_a_scheduler_that_is_not_fresh_is_refused_before_any_change():
    events, kv = busy_crash()
    state = kv.state_tuple()
    used = make(kv, EventLog())
    used.add_request(RuntimeRequest("zz", (1, 2), max_tokens=1))
    with pytest.raises(ValueError, match="new, empty scheduler"):
        recover(events, kv, lambda kv, log: used)
    with pytest.raises(ValueError, match="on that kv and log"):
        recover(events, kv, lambda kv, log: make(kv, EventLog()))
    assert kv.state_tuple() == state


def test_plan_is_pure_and_matches_what_recover_does():
    events, kv = busy_crash()
    state = kv.state_tuple()
    plan = plan_recovery(replay(events), {rid: kv.num_slots(rid) for rid in kv.requests()})
    assert kv.state_tuple() == state
    _, report = recover(events, kv, make)
    assert (report.resumed, report.requeued, report.freed) == (plan.resume, plan.requeue,
                                                                plan.free)


def test_a_log_that_would_break_the_scheduler_is_refused_before_any_change():
    """The old recovery replayed this log, freed the orphans, and only then failed its final
    ``check_invariants`` (more outputs than max_tokens): the manager was left half-changed."""
    events, kv = busy_crash()
    rid, entry = next((rid, x) for rid, x in replay(events).items()
                      if x.request.is_decoding)
    n = entry.request.num_tokens
    step = events[-1].step
    more = [Event(0, "progress", rid, (n + j, 1), step) for j in range(entry.request.max_tokens)]
    state = kv.state_tuple()
    with pytest.raises(CorruptLog, match="past max_tokens"):
        recover(renumber(events + more), kv, make)
    assert kv.state_tuple() == state


# ------------------------------------------------------------------ stop condition at recovery


@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop-token"])
def test_running_request_without_table_that_met_its_stop_is_finished(stop):
    """Crash right after the progress record of a request's last token, and the manager lost
    its table: the request must be FINISHED with its outputs, not requeued to sample more."""
    want_ref = reference()
    victim = "b"
    want = want_ref.get_request(victim).output_token_ids
    stops = frozenset({want[2]}) if stop else frozenset()
    ref = reference(stops)
    target = ref.get_request(victim)
    expected_reason = FinishReason.STOP if stop else FinishReason.LENGTH
    assert target.finish_reason == expected_reason
    last = max(e.index for e in ref.log if e.request_id == victim and e.kind == "progress")
    events, kv = crashed(last + 1, stops)
    assert events[-1].request_id == victim and events[-1].kind == "progress"
    kv.free(victim)                                  # the table is gone: no resume possible
    recovered, report = recover(events, kv, make)
    assert victim in report.finished and victim not in report.requeued
    request = recovered.get_request(victim)
    assert request.status == S.FINISHED and request.finish_reason == expected_reason
    assert request.output_token_ids == target.output_token_ids
    drive(recovered, check=check_scheduler)
    assert recovered.get_request(victim).output_token_ids == target.output_token_ids
    for r in recovered.requests():
        assert r.output_token_ids == ref.get_request(r.request_id).output_token_ids


# ------------------------------------------------------------------ crash during recovery's run


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.7])
def test_recovered_log_survives_a_second_crash(fraction):
    """Recovery's own records are valid log records: crash again later, recover again."""
    ref = reference()
    events, kv = crashed(int(fraction * len(ref.log)))
    first, _ = recover(events, kv, make)
    known = {r.request_id for r in first.requests()}
    resubmit = [q for qs in arrivals().values() for q in qs if q.request_id not in known]
    first.log.crash_at = first.log.next_index + 7
    with pytest.raises(SimulatedCrash):
        drive(first, arrivals={1: resubmit})
    second, _ = recover(first.log.events, kv, make)
    known = {r.request_id for r in second.requests()}
    drive(second, arrivals={1: [q for q in resubmit if q.request_id not in known]},
          check=check_scheduler)
    assert not kv.requests()
    for r in second.requests():
        assert r.output_token_ids == ref.get_request(r.request_id).output_token_ids
