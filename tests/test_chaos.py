"""The invariant set under fault injection (torch-free: kvlab.labs.chaos.soak's executor).

A sweep of seeded chaos runs checks all nine invariants after every step; each invariant is
then broken on purpose by a mutated component and the checker must name it and the culprit.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.engine_core import EngineCore, StepObserver
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import ScheduledChunk, SchedulerOutput
from kvlab.labs.chaos.soak import OVERLAP_FAULTS, ChaosConfig, ChaosExecutor, run_chaos
from kvlab.labs.faults.step_faults import STEP_FAULTS, StepFault, StepFaultSchedule
from kvlab.labs.invariants.spec_invariants import (
    SPEC_INVARIANTS,
    EngineView,
    InvariantMonitor,
    InvariantViolation,
)

SEEDS = range(120)


def test_chaos_sweep_all_invariants_every_step():
    steps, faults, checks = 0, Counter(), 0
    for seed in SEEDS:
        for method in ("draft", "ngram"):
            r = run_chaos(seed, ChaosConfig(steps=60), method=method)  # raises on a violation
            assert r.mismatches == [], (seed, method, r.mismatches)
            assert r.leaked_blocks == 0, (seed, method)
            steps += r.steps
            faults.update(r.faults)
            checks += r.checks
    assert steps >= 10_000
    assert checks >= 9 * steps
    expected = set(STEP_FAULTS) - {"late_copy"}   # no copy-on-write without forks (docs/engine.md)
    assert expected <= set(faults), expected - set(faults)


def test_chaos_sweep_with_overlap_scheduling():
    """The same run with the next step planned while one executes (placeholders for the
    tokens in flight, an executor on a worker thread that reads the outputs only, aborts from
    it mid-step): every invariant after every step, every finished request its solo tokens,
    no leak, every fault that needs neither the event log nor speculation struck."""
    steps, faults, checks = 0, Counter(), 0
    for seed in range(60):
        r = run_chaos(seed, ChaosConfig(steps=60, async_scheduling=True))
        assert r.mismatches == [], (seed, r.mismatches)
        assert r.leaked_blocks == 0, seed
        assert r.finished and r.drafted == 0
        steps += r.steps
        faults.update(r.faults)
        checks += r.checks
    assert checks >= 9 * steps
    assert set(OVERLAP_FAULTS) - {"late_copy"} <= set(faults), set(OVERLAP_FAULTS) - set(faults)
    assert not {"crash", "corrupt_log", "truncated_log", "spec_reject_all"} & set(faults)


def test_chaos_replays_exactly_from_seed_and_from_schedule_data():
    a = run_chaos(7, ChaosConfig(steps=80))
    b = run_chaos(7, ChaosConfig(steps=80))
    c = run_chaos(7, ChaosConfig(steps=80),
                  schedule=StepFaultSchedule.from_data(a.schedule))
    for other in (b, c):
        assert (a.finished, a.faults, a.checks, a.statuses) == \
            (other.finished, other.faults, other.checks, other.statuses)


def test_fault_schedule_rejects_bad_data():
    with pytest.raises(ValueError, match="unknown fault kind"):
        StepFault(1, "execute", "meteor")
    with pytest.raises(ValueError, match="strikes at point"):
        StepFault(1, "schedule", "crash")
    with pytest.raises(ValueError, match="step"):
        StepFault(0, "update", "crash")


def test_the_set_has_nine_numbered_invariants_with_statements():
    assert [i.number for i in SPEC_INVARIANTS] == list(range(1, 10))
    assert all(i.statement and i.name for i in SPEC_INVARIANTS)


# ------------------------------------------------------------------------- mutations
SCOPE = (("model", "m"),)


def _req(rid, prompt, max_tokens=4, scope=SCOPE):
    return RuntimeRequest(rid, tuple(prompt), max_tokens, scope=scope)


def _run(scheduler, requests, steps=30, executor=None):
    """Step a core with the full monitor after every step; returns the monitor."""
    monitor = InvariantMonitor()
    core = EngineCore(scheduler, executor or ChaosExecutor(scheduler.get_request),
                      forget_ended=False)

    class Obs(StepObserver):
        def before_execute(self, c, output):
            monitor.before_execute(EngineView(c.scheduler, c.scheduler.kv), output)

        def after_step(self, c, result):
            monitor.check(EngineView(c.scheduler, c.scheduler.kv, c.scheduler.step_count,
                                     result))
    core.add_observer(Obs())
    for r in requests:
        core.add_request(r)
    for _ in range(steps):
        if not core.has_unfinished_requests():
            break
        core.step()
    return monitor, core


def _sched(blocks=32, cls=BaselineScheduler, **kw):
    kv = KVCacheManager(blocks, 4)
    return cls(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                   prefill_chunk=8, **kw))


def _expect(number, subject, fn):
    with pytest.raises(InvariantViolation) as info:
        fn()
    assert info.value.invariant.number == number, str(info.value)
    assert subject in info.value.subject, str(info.value)
    return info.value


def test_correct_components_pass():
    monitor, _ = _run(_sched(), [_req(f"r{i}", [9, 8, 7, 6, 5 + i]) for i in range(4)])
    assert monitor.checks > 0


def test_invariant_1_catches_a_release_that_skips_a_block(monkeypatch):
    s = _sched()
    release = s.kv.pool.release
    monkeypatch.setattr(s.kv.pool, "release",
                        lambda blocks, owner: release(list(blocks)[1:], owner))
    _expect(1, "block", lambda: _run(s, [_req("a", range(10, 19), 2)]))


def test_invariant_2_catches_a_write_into_a_shared_block_without_copy():
    kv = KVCacheManager(16, 4)
    kv.admit("a", SCOPE, list(range(6)), 6)
    kv.fork("a", "b")
    copies = kv.grow("b", 7, write_from=7)   # the mutated scheduler: write_from off by one
    good = EngineView(None, kv)
    ok = KVCacheManager(16, 4)
    ok.admit("a", SCOPE, list(range(6)), 6)
    ok.fork("a", "b")
    fine = ok.grow("b", 7, write_from=6)     # the correct call copies block 1 first
    InvariantMonitor().before_execute(EngineView(None, ok), SchedulerOutput(
        1, (ScheduledChunk("b", (99,), 6, tuple(ok.block_table("b")), True, False),),
        tuple(fine)))
    chunk = ScheduledChunk("b", (99,), 6, tuple(kv.block_table("b")), True, False)
    out = SchedulerOutput(1, (chunk,), tuple(copies))
    e = _expect(2, "block", lambda: InvariantMonitor().before_execute(good, out))
    assert "b writes" in e.detail


def test_invariant_3_catches_a_request_reported_finished_twice():
    class Twice(BaselineScheduler):
        previous: list = []  # noqa: RUF012 (the mutation's memory)

        def update_from_output(self, output, sampled):
            ended = super().update_from_output(output, sampled)
            again, Twice.previous = Twice.previous, list(ended)
            return ended + again
    _expect(3, "request r0", lambda: _run(_sched(cls=Twice), [_req("r0", [1, 2, 3], 1),
                                                             _req("r1", [4, 5, 6], 6)]))


def test_invariant_4_catches_an_abort_that_leaves_the_request_queued():
    class Sticky(BaselineScheduler):
        def abort_request(self, request_id):
            r = super().abort_request(request_id)
            self.waiting.append(request_id)
            return r
    s = _sched(cls=Sticky)
    monitor, core = _run(s, [_req("a", [1, 2, 3])], steps=1)
    core.abort_request("a")
    _expect(4, "request a", lambda: monitor.check(EngineView(s, s.kv, s.step_count)))


def test_invariant_5_catches_an_output_token_rewritten():
    class Rewrite(BaselineScheduler):
        def update_from_output(self, output, sampled):
            ended = super().update_from_output(output, sampled)
            for r in self.requests():
                if len(r.output_token_ids) >= 2:
                    r.output_token_ids[0] += 1
            return ended
    _expect(5, "request a", lambda: _run(_sched(cls=Rewrite), [_req("a", [1, 2, 3], 6)]))


def test_invariant_6_catches_a_cache_that_ignores_the_security_domain():
    class Unscoped(KVCacheManager):
        def lookup(self, scope, token_ids):
            return super().lookup(SCOPE, token_ids)

        def find_prefix(self, scope, token_ids):
            return super().find_prefix(SCOPE, token_ids)

        def admit(self, request_id, scope, token_ids, num_tokens, hit=None):
            return super().admit(request_id, SCOPE, token_ids, num_tokens, hit)
    kv = Unscoped(32, 4)
    s = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                              prefill_chunk=8))
    other = (("model", "m"), ("security_domain", "tenant-b"))
    _expect(6, "request", lambda: _run(s, [_req("a", range(20, 29), 3),
                                           _req("b", range(20, 29), 3, scope=other)]))


def test_invariant_7_catches_a_rollback_that_keeps_the_rejected_tail(monkeypatch):
    s = _sched(num_lookahead_tokens=6)
    monkeypatch.setattr(s.kv, "truncate", lambda rid, n: [])
    executor = ChaosExecutor(s.get_request, "draft")
    _expect(7, "request a", lambda: _run(s, [_req("a", [11, 12, 13], 10)],
                                         executor=executor))


def test_invariant_8_catches_an_install_accepted_despite_a_bad_descriptor():
    monitor = InvariantMonitor()
    s = _sched()
    view = EngineView(s, s.kv, installs=[("r3", "e3", "its model_version is stale")])
    _expect(8, "request r3", lambda: monitor.check(view, only=[8]))


def test_invariant_9_catches_admission_without_a_reservation(monkeypatch):
    s = _sched(blocks=12, cls=ProductionScheduler, admission="reserve")
    monkeypatch.setattr(s, "reserved_blocks", lambda: 0)   # the mutation: forgets running claims
    reqs = [_req(f"r{i}", [3 * i + 1, 3 * i + 2, 3 * i + 3], 12) for i in range(4)]
    _expect(9, "engine", lambda: _run(s, reqs))


def test_check_every_step_runs_the_set_on_a_real_engine_and_validates_its_argument():
    from kvlab import LLM, SamplingParams
    from kvlab.labs.invariants import check_every_step

    with pytest.raises(TypeError, match="check_every_step takes an LLMEngine"):
        check_every_step(LLM("kvlab-tiny", num_blocks=32))      # the LLM, not its engine
    llm = LLM("kvlab-tiny", num_blocks=64, block_size=8, max_num_seqs=4, scheduler="production",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert llm.engine.core.observers == []                      # off by default
    hook = check_every_step(llm.engine)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 2
    outs = llm.generate([prompt, [*prompt, 4]], SamplingParams(max_tokens=10, n=2),
                        use_tqdm=False)
    assert all(len(c.token_ids) == 10 for o in outs for c in o.outputs)
    steps = llm.engine.stats.steps
    assert llm.engine.core.observers == [hook]
    assert hook.monitor.checks >= 9 * steps > 0
