"""Schedulers: reference differential, admission, stop rules, preemption, aborts, policy."""

from __future__ import annotations

import copy
import random

import pytest

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler, starvation_bound
from kvlab.core.request import FinishReason, RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import SchedulerOutput
from kvlab.labs.invariants import check_scheduler
from kvlab.labs.recovery.event_log import EventLog
from kvlab.reference import Phase, Request, build_batch
from kvlab.sim.tokens import drive, greedy_tokens, hash_token

S = RequestStatus
SCHEDULERS = [BaselineScheduler, ProductionScheduler]


def req(rid, prompt, max_tokens=4, **kw) -> RuntimeRequest:
    if isinstance(prompt, int):
        prompt = tuple(range(1, prompt + 1))
    return RuntimeRequest(rid, tuple(prompt), max_tokens=max_tokens, **kw)


def expected_outputs(prompt, n, eos=None) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        t = hash_token(tokens, avoid=eos)
        out.append(t)
        tokens.append(t)
    return out


def random_requests(seed, n, shared_prefix=True):
    rng = random.Random(seed)
    shared = tuple(rng.randrange(1, 500) for _ in range(24))
    out = []
    for i in range(n):
        head = shared[: rng.choice([0, 8, 16, 24])] if shared_prefix else ()
        tail = tuple(rng.randrange(1, 500) for _ in range(rng.randint(1, 30)))
        out.append(req(f"r{i}", head + tail, rng.randint(1, 16)))
    return out


# ---------------------------------------------------------------- the spec's reference

def test_spec_build_batch_asserts():
    decode = Request("d0", 0, phase=Phase.DECODE)
    prefill = Request("p0", 3, phase=Phase.PREFILL)
    batch = build_batch([prefill, decode], 3, 2, 2)
    assert [request_id for request_id, _, _ in batch] == ["d0", "p0"]
    with pytest.raises(ValueError):
        build_batch([decode, decode], 3, 2, 2)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_baseline_batch_equals_reference_build_batch(seed, caching):
    """Where build_batch is defined (KV never short), the baseline's batch is build_batch's."""
    rng = random.Random(seed)
    seqs = rng.randint(1, 6)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=max(seqs, rng.randint(1, 24)),
                          prefill_chunk=rng.randint(1, 12))
    kv = KVCacheManager(400, 4, enable_prefix_caching=caching)
    sched = BaselineScheduler(kv, cfg)
    arrivals: dict[int, list] = {}
    for r in random_requests(seed, 14):
        arrivals.setdefault(rng.randint(1, 30), []).append(r)
    compared = 0

    def before_schedule():
        return build_batch(sched.reference_view(), cfg.max_num_batched_tokens,
                           cfg.max_num_seqs, cfg.prefill_chunk) if (
            sched.running or sched.waiting) else []

    step = 0
    while sched.has_unfinished_requests() or arrivals:
        step += 1
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        expected = before_schedule()
        out = sched.schedule()
        got = [(c.request_id, c.num_tokens) for c in out.chunks]
        assert got == [(rid, n) for rid, _, n in expected]
        phases = [p for _, p, _ in expected]
        assert [c.is_prefill for c in out.chunks] == [p != Phase.DECODE for p in phases]
        compared += bool(got)
        kv.complete_copies(out.copies)
        sched.update_from_output(out, {c.request_id: greedy_tokens(sched.get_request(c.request_id))
                                       for c in out.chunks if c.sample})
        check_scheduler(sched)
    assert compared > 5


# ---------------------------------------------------------------- input validation

@pytest.mark.parametrize("cls", SCHEDULERS)
def test_bad_requests_raise_and_change_nothing(cls):
    sched = cls(KVCacheManager(16, 4), log=EventLog())
    sched.add_request(req("a", 3))
    before = (list(sched.waiting), len(sched.log), [copy.deepcopy(r) for r in sched.requests()])
    bad = [
        req("a", 3),                                   # duplicate id
        req("", 3),                                    # empty id
        RuntimeRequest("b", (), max_tokens=3),         # empty prompt
        req("c", 3, max_tokens=0),                     # no output allowed
        req("d", 3, status=S.RUNNING),                 # not fresh
        req("e", 3, output_token_ids=[5]),             # not fresh
    ]
    for r in bad:
        with pytest.raises(ValueError):
            sched.add_request(r)
    with pytest.raises(TypeError):
        sched.add_request(Request("x", 3))             # type: ignore[arg-type]
    assert (list(sched.waiting), len(sched.log), sched.requests()) == before


def _sched_state(sched):
    return (list(sched.waiting), list(sched.running), sched.step_count, len(sched.log),
            sched.log.next_index, [copy.deepcopy(r) for r in sched.requests()],
            sched.kv.state_tuple())


@pytest.mark.parametrize("cls", SCHEDULERS)
@pytest.mark.parametrize(("fields", "names"), [
    ({"prompt_token_ids": [1, 2, 3]}, "prompt_token_ids must be a tuple"),
    ({"prompt_token_ids": ("x", "y")}, r"prompt_token_ids\[0\]"),
    ({"prompt_token_ids": (1, 2.0)}, r"prompt_token_ids\[1\]"),
    ({"prompt_token_ids": (1, True)}, r"prompt_token_ids\[1\]"),
    ({"prompt_token_ids": (1, -2, 3)}, r"prompt_token_ids\[1\]"),
    ({"prompt_token_ids": ()}, "empty prompt"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_model_len": 8.5}, "max_model_len"),
    ({"stop_token_ids": frozenset({-1})}, "stop_token_ids"),
    ({"stop_token_ids": [3]}, "stop_token_ids"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"eos_token_id": False}, "eos_token_id"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"priority": 1.5}, "priority"),
    ({"deadline": "soon"}, "deadline"),
    ({"deadline": float("nan")}, "deadline"),
    ({"scope": 7}, "scope"),
    ({"finish_reason": FinishReason.STOP}, "fresh"),
])
def test_bad_request_fields_are_named_and_change_nothing(cls, fields, names):
    """A malformed request is refused at add_request (ValueError naming the field or element)
    with the scheduler unchanged; it used to be queued and make every schedule() raise."""
    sched = cls(KVCacheManager(16, 4), log=EventLog())
    sched.add_request(req("a", 3))
    sched.schedule()
    before = _sched_state(sched)
    base = {"request_id": "b", "prompt_token_ids": (1, 2, 3), "max_tokens": 3}
    with pytest.raises(ValueError, match=names):
        sched.add_request(RuntimeRequest(**{**base, **fields}))
    assert _sched_state(sched) == before
    check_scheduler(sched)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_update_validates_before_mutating(cls):
    kv = KVCacheManager(16, 4)
    sched = cls(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), log=EventLog())
    sched.add_request(req("a", 3))
    sched.add_request(req("b", 3))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()
    snapshot = ([copy.deepcopy(r) for r in sched.requests()], kv.state_tuple(), len(sched.log))
    for sampled in ({"a": 1}, {"a": 1, "b": 2, "zz": 3}, {"a": -1, "b": 2}, {"a": 1.5, "b": 2}):
        with pytest.raises(ValueError):
            sched.update_from_output(out, sampled)
        assert ([r for r in sched.requests()], kv.state_tuple(), len(sched.log)) == snapshot
    stale = copy.copy(out)
    with pytest.raises(ValueError, match="not the step in flight"):
        sched.update_from_output(stale, {"a": 1, "b": 2})
    sched.update_from_output(out, {"a": 1, "b": 2})
    assert sched.get_request("a").output_token_ids == [1]
    check_scheduler(sched)


# ---------------------------------------------------------------- admission and overload

@pytest.mark.parametrize("cls", SCHEDULERS)
def test_request_that_can_never_fit_is_rejected_with_reason(cls):
    kv = KVCacheManager(4, 4)                       # 16 slots
    sched = cls(kv)
    sched.add_request(req("big", 10, max_tokens=8))  # needs 17 slots -> 5 blocks
    sched.add_request(req("ctx", 10, max_tokens=8, max_model_len=10))
    sched.add_request(req("ok", 10, max_tokens=7))   # exactly 16 slots
    big, ctx = sched.get_request("big"), sched.get_request("ctx")
    assert big.status == S.REJECTED and "can never fit" in big.status_message
    assert ctx.status == S.REJECTED and "max_model_len" in ctx.status_message
    out = sched.schedule()
    assert out.rejected == ("big", "ctx")
    ended = sched.update_from_output(out, {c.request_id: 1 for c in out.chunks if c.sample})
    assert [r.request_id for r in ended] == ["big", "ctx"]
    assert all(r.finish_reason == FinishReason.REJECTED for r in ended)
    drive(sched, check=check_scheduler)
    assert sched.get_request("ok").finish_reason == FinishReason.LENGTH


def test_overload_policy_rejects_beyond_queue_limit():
    """max_waiting counts the requests waiting beyond the free sequence slots: with 3 slots and
    a limit of 2, a burst of 7 keeps 5 (3 that the running set takes, 2 queued)."""
    sched = ProductionScheduler(KVCacheManager(64, 4), SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=32, max_waiting=2))
    for i in range(7):
        sched.add_request(req(f"r{i}", 3))
    statuses = [sched.get_request(f"r{i}").status for i in range(7)]
    assert statuses == [S.WAITING] * 5 + [S.REJECTED] * 2
    assert "queue full" in sched.get_request("r5").status_message
    out = sched.schedule()
    assert len(out.admitted) == 3                 # the slots fill; two still wait
    sched.update_from_output(out, {c.request_id: 1 for c in out.chunks if c.sample})
    sched.add_request(req("late", 3))             # 2 wait beyond 0 free slots: full
    assert sched.get_request("late").status == S.REJECTED
    drive(sched, check=check_scheduler)
    assert [r.status for r in sched.requests()].count(S.FINISHED) == 5


def test_reserve_admission_reserves_for_max_tokens():
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)
    sched = ProductionScheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    sched.add_request(req("a", 4, max_tokens=13))   # 16 slots: 4 blocks reserved
    sched.add_request(req("b", 4, max_tokens=13))   # would need 4 more: waits
    out = sched.schedule()
    assert out.admitted == ("a",)
    assert sched.reserved_blocks() == 3  # 1 block allocated, 3 still claimable
    sched.update_from_output(out, {"a": greedy_tokens(sched.get_request("a"))})
    result = drive(sched, check=check_scheduler)
    assert not any(o.preempted for o in result.outputs)
    assert sched.get_request("b").admitted_step > sched.get_request("a").finished_step - 1


@pytest.mark.parametrize("cls", [BaselineScheduler, ProductionScheduler])
def test_config_needs_budget_for_every_batch_entry(cls):
    with pytest.raises(ValueError, match="max_num_seqs <= max_num_batched_tokens"):
        cls(KVCacheManager(4, 4), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4))
    cls(KVCacheManager(4, 4), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4))


def test_config_validation():
    for bad in (dict(max_num_seqs=0), dict(admission="lru"), dict(watermark=1.0),
                dict(max_waiting=-1), dict(prefill_chunk=True),
                dict(admission_scan_limit=0)):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


# ---------------------------------------------------------------- stop conditions

@pytest.mark.parametrize("cls", SCHEDULERS)
def test_stop_conditions(cls):
    sched = cls(KVCacheManager(64, 4))
    prompt = (5, 6, 7)
    first = hash_token(prompt)
    second = expected_outputs(prompt, 2)[1]
    sched.add_request(req("stop", prompt, 10, stop_token_ids=frozenset({second})))
    sched.add_request(req("eos", prompt, 10, eos_token_id=first))
    sched.add_request(req("ign", prompt, 3, eos_token_id=first, ignore_eos=True))
    sched.add_request(req("ctx", prompt, 10, max_model_len=5))
    sched.add_request(req("len", prompt, 2))
    drive(sched, token_fn=lambda r: hash_token(r.all_token_ids), check=check_scheduler)
    got = {r.request_id: (r.finish_reason, len(r.output_token_ids)) for r in sched.requests()}
    assert got == {
        "stop": (FinishReason.STOP, 2),
        "eos": (FinishReason.STOP, 1),
        "ign": (FinishReason.LENGTH, 3),
        "ctx": (FinishReason.LENGTH, 2),
        "len": (FinishReason.LENGTH, 2),
    }
    assert not sched.kv.requests()


# ---------------------------------------------------------------- preemption

def run_all(cls, requests, num_blocks, cfg, caching=True):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=caching)
    sched = cls(kv, cfg)
    for r in requests:
        sched.add_request(copy.deepcopy(r))
    result = drive(sched, check=check_scheduler)
    assert not kv.requests()
    return sched, result


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("cls,admission", [(BaselineScheduler, "reserve"),
                                           (ProductionScheduler, "watermark")])
def test_preempted_outputs_equal_unpreempted(cls, admission, caching):
    requests = random_requests(3, 14)
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, prefill_chunk=8,
                          admission=admission)
    tight, result = run_all(cls, requests, 14, cfg, caching)
    assert sum(len(o.preempted) for o in result.outputs) > 0
    for r in tight.requests():
        original = next(q for q in requests if q.request_id == r.request_id)
        assert r.output_token_ids == expected_outputs(original.prompt_token_ids, r.max_tokens)
        assert r.finish_reason == FinishReason.LENGTH


def test_reserve_admission_never_preempts():
    for seed in range(4):
        requests = random_requests(seed, 16)
        cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, prefill_chunk=8)
        _, result = run_all(ProductionScheduler, requests, 14, cfg)
        assert not any(o.preempted for o in result.outputs)


def test_production_victim_is_least_important_newest():
    kv = KVCacheManager(12, 2, enable_prefix_caching=False)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, admission="watermark")
    sched = ProductionScheduler(kv, cfg)
    sched.add_request(req("hi", 2, 14, priority=0))
    sched.add_request(req("lo-old", 2, 14, priority=1))
    sched.add_request(req("lo-new", 2, 14, priority=1))
    result = drive(sched, check=check_scheduler, max_steps=200)
    first = next(o.preempted for o in result.outputs if o.preempted)
    assert first == ("lo-new",)
    assert sched.get_request("hi").num_preemptions == 0


def test_baseline_victim_is_newest_admitted():
    kv = KVCacheManager(12, 2, enable_prefix_caching=False)
    sched = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8))
    for rid in ("a", "b", "c"):
        sched.add_request(req(rid, 2, 14))
    result = drive(sched, check=check_scheduler, max_steps=200)
    assert next(o.preempted for o in result.outputs if o.preempted) == ("c",)
    assert sched.waiting == [] and sched.get_request("a").num_preemptions == 0


# ---------------------------------------------------------------- aborts

@pytest.mark.parametrize("cls", SCHEDULERS)
def test_abort_waiting_running_inflight_and_idempotent(cls):
    kv = KVCacheManager(32, 4)
    sched = cls(kv, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8), log=EventLog())
    for rid in "abc":
        sched.add_request(req(rid, 3, 5))
    assert sched.abort_request("nope") is None
    out = sched.schedule()                            # a, b running; c waiting
    assert sched.abort_request("c").status == S.CANCELLED
    before = _sched_state(sched)
    with pytest.raises(RuntimeError, match="during the step"):   # in flight: the engine core
        sched.abort_request("a")                                  # holds it to the step's end
    assert _sched_state(sched) == before
    sched.update_from_output(out, {"a": 1, "b": 2})
    aborted = sched.abort_request("a")
    assert aborted.finish_reason == FinishReason.ABORT and not kv.has("a")
    assert sched.get_request("a").output_token_ids == [1]
    assert sched.abort_request("a") is aborted and aborted.status == S.CANCELLED
    check_scheduler(sched)
    drive(sched, check=check_scheduler)
    assert sched.get_request("b").finish_reason == FinishReason.LENGTH
    assert sched.abort_request("b").status == S.FINISHED   # a late abort changes nothing
    assert not kv.requests()


# ---------------------------------------------------------------- production policy

def test_priority_classes_and_deadlines_order_admission():
    sched = ProductionScheduler(KVCacheManager(64, 4),
                                SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8))
    sched.add_request(req("low", 3, 2, priority=2))
    sched.add_request(req("late", 3, 2, priority=1, deadline=9.0))
    sched.add_request(req("none", 3, 2, priority=1))
    sched.add_request(req("soon", 3, 2, priority=1, deadline=5.0))
    result = drive(sched, check=check_scheduler)
    order = [rid for o in result.outputs for rid in o.admitted]
    assert order == ["soon", "late", "none", "low"]


def test_cache_affinity_prefers_longest_hit():
    kv = KVCacheManager(64, 4)
    sched = ProductionScheduler(kv, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16))
    base = tuple(range(100, 116))
    sched.add_request(req("warm", (*base, 1), 1))
    drive(sched)
    sched.add_request(req("cold", tuple(range(200, 217)), 1))
    sched.add_request(req("hit8", (*base[:8], 7, 7, 7), 1))
    sched.add_request(req("hit16", (*base, 9), 1))
    result = drive(sched, check=check_scheduler)
    assert [rid for o in result.outputs for rid in o.admitted] == ["hit16", "hit8", "cold"]
    assert sched.get_request("hit16").num_cached_tokens == 16


def stream_of_hits(sched, steps):
    """One long cold request, then a stream of short requests hitting a warm prefix."""
    base = tuple(range(100, 132))
    sched.add_request(req("warm", (*base, 1), 1))
    drive(sched)
    arrivals = {1: [req("cold", tuple(range(300, 316)), 2)]}
    for s in range(1, steps):
        arrivals.setdefault(s, []).append(req(f"hit{s}", (*base, s), 2))
    return drive(sched, arrivals=arrivals, check=check_scheduler, max_steps=10 * steps)


def test_affinity_without_ageing_starves_and_ageing_bounds_it():
    cfg = dict(max_num_seqs=1, max_num_batched_tokens=16, prefill_chunk=16)
    starving = ProductionScheduler(KVCacheManager(64, 4),
                                   SchedulerConfig(max_wait_steps=None, **cfg))
    stream_of_hits(starving, 60)
    cold = starving.get_request("cold")
    hits_served_first = sum(
        1 for r in starving.requests()
        if r.request_id.startswith("hit") and r.admitted_step < cold.admitted_step)
    assert hits_served_first >= 50          # starved while the stream lasted
    aged_cfg = SchedulerConfig(max_wait_steps=5, **cfg)
    aged = ProductionScheduler(KVCacheManager(64, 4), aged_cfg)
    stream_of_hits(aged, 60)
    cold = aged.get_request("cold")
    wait = cold.admitted_step - cold.arrival_step
    older = 0  # nothing older than "cold" was waiting
    assert wait <= starvation_bound(aged_cfg, max_request_tokens=34, older_waiting=older)
    assert wait <= 5 + 3                    # in practice: right after ageing


def test_starvation_bound_needs_ageing_and_reserve():
    with pytest.raises(ValueError):
        starvation_bound(SchedulerConfig(max_wait_steps=None), 10, 0)
    with pytest.raises(ValueError):
        starvation_bound(SchedulerConfig(admission="watermark"), 10, 0)
    assert starvation_bound(SchedulerConfig(max_wait_steps=8), 10, 2) == 8 + 3 * 10


def test_every_running_request_advances_every_step():
    kv = KVCacheManager(200, 4)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=8)
    sched = ProductionScheduler(kv, cfg)
    for r in random_requests(5, 10):
        sched.add_request(r)

    def check(out):
        scheduled = {c.request_id for c in out.chunks}
        assert set(sched.running) - set(out.admitted) <= scheduled | set(
            r.request_id for r in sched.requests() if r.status.is_terminal)

    drive(sched, check=check_scheduler, on_step=check)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_forget_drops_only_ended_and_reported_requests(cls):
    kv = KVCacheManager(4, 4)
    sched = cls(kv, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8))
    sched.add_request(req("big", 20, 8))              # rejected: can never fit
    sched.add_request(req("a", 3, 2))
    with pytest.raises(ValueError, match="not ended"):
        sched.forget("a")
    with pytest.raises(ValueError, match="still being reported"):
        sched.forget("big")
    with pytest.raises(KeyError):
        sched.forget("nope")
    drive(sched, check=check_scheduler)
    assert sched.forget("big").status == RequestStatus.REJECTED
    assert sched.forget("a").finish_reason == FinishReason.LENGTH
    assert sched.requests() == [] and not sched.has_unfinished_requests()
    check_scheduler(sched)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_fail_step_fails_the_step_and_releases_its_kv_once(cls):
    """The executor could not run a step: its requests fail with reason ERROR, their KV is
    released exactly once, a request outside the step is untouched, and the scheduler goes on."""
    from kvlab.labs.recovery import replay

    kv = KVCacheManager(32, 4)
    sched = cls(kv, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=11), log=EventLog())
    for rid, n in (("p", 6), ("q", 5), ("w", 9)):
        sched.add_request(req(rid, n, 4))
    out = sched.schedule()                                   # p and q fill the step
    assert [c.request_id for c in out.chunks] == ["p", "q"]
    before = _sched_state(sched)
    with pytest.raises(ValueError, match="not the step in flight"):
        sched.fail_step(SchedulerOutput(step=99, chunks=()), "x")
    assert _sched_state(sched) == before
    frees = []
    real_free = kv.free
    kv.free = lambda rid: frees.append(rid) or real_free(rid)
    failed = sched.fail_step(out, "device lost")
    kv.free = real_free
    assert sorted(r.request_id for r in failed) == ["p", "q"]
    for r in failed:
        assert (r.status, r.finish_reason, r.status_message) == (
            S.FAILED, FinishReason.ERROR, "device lost")
    assert sorted(frees) == ["p", "q"]                       # each exactly once
    assert not kv.requests() and not kv.pending_copies()
    assert sched.get_request("w").status == S.WAITING        # not in the step
    check_scheduler(sched)
    replayed = replay(sched.log.events)
    assert all(replayed[r].kv == "none" for r in ("p", "q"))
    # the failed requests are reported by the next update, and new work runs
    sched.add_request(req("n", 3, 2))
    out = sched.schedule()
    ended = sched.update_from_output(out, {c.request_id: 1 for c in out.chunks if c.sample})
    assert sorted(r.request_id for r in ended) == ["p", "q"]
    drive(sched, arrivals={}, check=check_scheduler)
    assert sched.get_request("n").status == S.FINISHED


# ---------------------------------------------------------------- overlap (async) scheduling

def _overlapped(cls, blocks=16, **kw):
    kv = KVCacheManager(blocks, 4)
    return cls(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=8,
                                   async_scheduling=True, **kw))


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_overlap_plans_a_decode_on_a_placeholder_and_fills_it_on_update(cls):
    from kvlab.core.request import PLACEHOLDER

    sched = _overlapped(cls)
    sched.add_request(req("a", 3, 3))
    first = sched.schedule()                   # the prompt; its first token is in flight
    a = sched.get_request("a")
    assert a.output_token_ids == [PLACEHOLDER] and a.num_computed_tokens == 3
    second = sched.schedule()                  # planned on it: the placeholder is its input
    (chunk,) = second.chunks
    assert chunk.token_ids == (PLACEHOLDER,) and chunk.start_pos == 3
    assert a.output_token_ids == [PLACEHOLDER, PLACEHOLDER] and a.num_output_placeholders == 2
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()                       # two steps in flight at most
    check_scheduler(sched)
    with pytest.raises(ValueError, match="not the step in flight"):
        sched.update_from_output(second, {"a": 9})   # oldest first
    assert sched.update_from_output(first, {"a": 7}) == []
    assert a.output_token_ids == [7, PLACEHOLDER] and a.known_output_token_ids == [7]
    third = sched.schedule()                   # max_tokens 3: one more may be planned
    assert third.chunks[0].token_ids == (PLACEHOLDER,)
    assert sched.update_from_output(second, {"a": 8}) == []
    assert sched.schedule().is_empty           # its three outputs are known or in flight
    (done,) = sched.update_from_output(third, {"a": 9})
    assert done is a and a.output_token_ids == [7, 8, 9]
    assert a.finish_reason == FinishReason.LENGTH and a.num_output_placeholders == 0
    check_scheduler(sched)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_overlap_a_stop_drops_the_step_planned_after_it(cls):
    sched = _overlapped(cls)
    sched.add_request(req("a", 3, 8, stop_token_ids=frozenset({5})))
    first, second = sched.schedule(), sched.schedule()
    (done,) = sched.update_from_output(first, {"a": 5})      # a stop token
    assert done.output_token_ids == [5] and done.num_computed_tokens == 3
    assert not sched.kv.has("a") and "a" in sched.pending_finished_ids
    assert sched.update_from_output(second, {"a": 6}) == []  # sampled past the end: dropped
    assert done.output_token_ids == [5]
    check_scheduler(sched)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_overlap_abort_and_failure_of_a_request_in_flight(cls):
    sched = _overlapped(cls)
    for rid in ("a", "b"):
        sched.add_request(req(rid, 3, 8))
    first, second = sched.schedule(), sched.schedule()
    aborted = sched.abort_request("a")         # in flight: allowed with overlap
    assert aborted.status == S.CANCELLED and aborted.output_token_ids == []
    assert aborted.num_computed_tokens <= aborted.num_tokens and not sched.kv.has("a")
    assert not sched.can_forget("a")           # a step in flight still holds it
    failed = sched.fail_step(first, "device lost")
    assert [r.request_id for r in failed] == ["b"] and failed[0].output_token_ids == []
    check_scheduler(sched)
    assert sched.update_from_output(second, {"a": 1, "b": 2}) == failed
    assert sched.can_forget("a") and sched.can_forget("b")
    check_scheduler(sched)
    sync = BaselineScheduler(KVCacheManager(16, 4), SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=16))
    sync.add_request(req("c", 3, 8))
    sync.schedule()
    with pytest.raises(RuntimeError, match="during the step that runs it"):
        sync.abort_request("c")                # without overlap: after the step


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_overlap_scheduling_gives_every_request_its_solo_tokens(cls):
    """Random arrivals, aborts and a small pool (preemption) on the overlapped core with an
    executor that reads the scheduler's outputs only: every finished request has the tokens it
    has alone, an aborted one a prefix of them; the invariants hold after every step."""
    from kvlab.core.engine_core import EngineCore
    from kvlab.labs.chaos.soak import OverlapChaosExecutor, _request, solo_tokens

    preempted = 0
    for seed in range(8):
        rng = random.Random(seed)
        extra = {"admission": "watermark"} if cls is ProductionScheduler else {}
        sched = _overlapped(cls, blocks=14, **extra)        # watermark: it preempts too
        core = EngineCore(sched, OverlapChaosExecutor(sched.get_request), overlap=True,
                          forget_ended=False)
        prompts = {}
        for step in range(200):
            if step < 40 and rng.random() < 0.5:
                rid = f"r{len(prompts)}"
                prompts[rid] = (tuple(rng.randrange(6, 64) for _ in range(rng.randint(1, 12))),
                                rng.randint(1, 10))
                core.add_request(_request(rid, *prompts[rid]))
            if prompts and rng.random() < 0.08:
                core.abort_request(rng.choice(sorted(prompts)))
            if step >= 40 and not core.has_unfinished_requests() and \
                    not core.has_steps_in_flight():
                break
            preempted += len(core.step().output.preempted)
            check_scheduler(sched)
        for rid, (prompt, max_tokens) in prompts.items():
            r, solo = sched.get_request(rid), solo_tokens(prompt, max_tokens)
            assert r.status.is_terminal, rid
            out = tuple(r.output_token_ids)
            assert out == solo if r.status == S.FINISHED else solo[:len(out)] == out, rid
    assert preempted > 0
