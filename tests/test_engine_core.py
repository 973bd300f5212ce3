"""EngineCore under concurrency, reuse and long runs: late aborts, EngineBusy, requests added
while a step executes, LLM.generate beside direct requests, forgetting ended requests, id reuse,
the progress bar off a terminal, and an executor whose result the scheduler refuses.

"Another thread" is simulated two ways: by wrapping the executor's ``execute`` so that it calls
into the engine (the call lands exactly between ``schedule()`` and ``update_from_output()``),
and by real threads synchronised with :class:`threading.Event` (no sleeps, no timing: the
events' timeouts are only a safety net against a hang).
"""

from __future__ import annotations

import dataclasses
import gc
import io
import threading
import tracemalloc
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.engine_core import EngineBusy, EngineCore
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import FinishReason, RequestStatus, RuntimeRequest
from kvlab.core.sampling_params import SamplingParams
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm import LLM
from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.invariants import check_engine, check_scheduler
from kvlab.labs.kv_snapshot import snapshot_of
from kvlab.labs.parity.hf import save_random_hf_model
from kvlab.labs.recovery.event_log import EventLog
from kvlab.sim.executor import CostModelExecutor
from kvlab.sim.tokens import greedy_tokens, hash_token

VOCAB = 128
WAIT = 30.0  # seconds; a safety net against a deadlock, never reached when the test passes


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The model is tiny: one intra-op thread. On a loaded 2-core machine, two OpenMP threads
    waiting for each other made each step ~100x slower (measured: 13 s instead of 0.1 s for
    the 300-request test)."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_hf_model(tmp_path_factory.mktemp("core") / "llama", "llama", seed=5)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i + 3) % VOCAB for i in range(n)]


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)


def _engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    return LLMEngine(EngineArgs(model_dir, **kw))


_ALONE: dict[tuple, list[int]] = {}


def _alone(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` run alone on a fresh engine with a roomy cache."""
    key = (tuple(prompt), max_tokens)
    if key not in _ALONE:
        eng = _engine(model_dir, num_blocks=128)
        eng.add_request("alone", prompt, _greedy(max_tokens))
        _ALONE[key] = _run(eng)["alone"].outputs[0].token_ids
    return _ALONE[key]


def _run(eng: LLMEngine, done: dict | None = None) -> dict:
    """Step until nothing is left; the last output of every request, by id."""
    done = {} if done is None else done
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    return done


def _assert_kv_clean(eng: LLMEngine) -> None:
    """No table, no pending copy, every block free or cached (evictable)."""
    snap = snapshot_of(eng.kv)
    assert snap.tables == {}
    assert snap.pending_copies == ()
    assert set(snap.block_states) <= {"free", "cached"}, Counter(snap.block_states)
    assert snap.free_blocks + snap.evictable_blocks == snap.num_blocks
    assert eng.kv.requests() == []


def _assert_refcounts(eng: LLMEngine) -> None:
    """Every block's refcount is its owner count, and its request owners are exactly the
    requests whose table holds it (checked from the public snapshot, not the pool)."""
    snap = snapshot_of(eng.kv)
    for b in range(snap.num_blocks):
        assert snap.refcounts[b] == len(snap.block_owners[b]), b
        holders = sorted(rid for rid, table in snap.tables.items() if b in table)
        assert sorted(o for o in snap.block_owners[b] if o != "<prefix-cache>") == holders, b


class _Hook:
    """Wraps ``eng.executor.execute``: runs ``action(output)`` inside the next ``calls`` steps'
    execute (before the model runs), then executes normally."""

    def __init__(self, eng: LLMEngine, action, calls: int = 1):
        self.orig = eng.executor.execute
        self.action = action
        self.left = calls
        self.outputs = []
        eng.executor.execute = self

    def __call__(self, output):
        if self.left > 0:
            self.left -= 1
            self.outputs.append(output)
            self.action(output)
        return self.orig(output)


def _step_beside_thread(eng: LLMEngine, act, observe) -> tuple[list, dict]:
    """One ``eng.step()`` while a second thread runs ``act()`` inside that step's execute (the
    step waits until ``act`` returned, then records ``observe(output)``). Returns the step's
    outputs and ``{"act": act's result, **observe's dict}``; fails on an error in either."""
    inside, acted = threading.Event(), threading.Event()
    result: dict = {}

    def block(output):
        inside.set()
        assert acted.wait(WAIT), "the other thread never returned"
        result.update(observe(output))

    def other():
        try:
            assert inside.wait(WAIT)
            result["act"] = act()
        except BaseException as error:   # pragma: no cover - reported below
            result["error"] = error
        finally:
            acted.set()

    _Hook(eng, block)
    thread = threading.Thread(target=other)
    thread.start()
    outs = eng.step()
    thread.join(WAIT)
    assert not thread.is_alive() and "error" not in result
    return outs, result


# ------------------------------------------------------------------ 1. aborts during a step
@pytest.mark.parametrize("when", ["decoding", "last_token", "waiting"])
def test_abort_inside_execute_takes_effect_at_step_end(model_dir, when):
    """An abort that lands between schedule() and the end of the step is deferred: during
    execute the request still holds its KV (the executor may be reading it); the abort returns
    at once with finish_reason "abort" (the step reports it too); at the end of the step its
    KV is released and the
    scheduler forgets it; the other request is unaffected and the cache ends clean. Covers a
    decoding victim, one whose last token is being computed in that very step (it finishes
    and is aborted in the same step: still released once), and one still waiting outside the
    step (the batch has room for one request only)."""
    max_seqs = 1 if when == "waiting" else 8
    eng = _engine(model_dir, max_num_seqs=max_seqs, max_num_batched_tokens=16)
    a_max = 2 if when == "last_token" else 8
    eng.add_request("b", _prompt(2, 7), _greedy(5))
    eng.add_request("a", _prompt(1, 9), _greedy(a_max))
    eng.step()                               # b (and a unless "waiting") prefilled: 1 token
    a_before = eng.scheduler.get_request("a")
    tokens_before = list(a_before.output_token_ids)
    assert tokens_before == ([] if when == "waiting" else _alone(model_dir, _prompt(1, 9), 8)[:1])
    seen = {}

    def abort_a(output):
        in_step = "a" in {c.request_id for c in output.chunks}
        assert in_step == (when != "waiting")
        seen["out"] = eng.abort_request("a")
        req = eng.scheduler.find_request("a")
        seen["status_during"] = req.status
        seen["kv_during"] = eng.kv.has("a")

    hook = _Hook(eng, abort_a)
    outs = eng.step()                        # no exception
    assert hook.left == 0
    out = seen["out"]
    assert out.request_id == "a" and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort"]
    assert out.outputs[0].token_ids == tokens_before       # as it was when the abort arrived
    assert not seen["status_during"].is_terminal            # deferred ...
    assert seen["kv_during"] == (when != "waiting")         # ... KV untouched during execute
    # abort_request returned it, and the step reports the same final output (a generate()
    # loop in another thread learns of the abort this way)
    assert [o for o in outs if o.request_id == "a"] == [out]
    assert eng.scheduler.find_request("a") is None          # applied and forgotten at step end
    assert not eng.kv.has("a") and not eng.has_request("a")
    check_engine(eng)
    _assert_refcounts(eng)
    done = _run(eng)
    assert "a" not in done
    assert done["b"].outputs[0].token_ids == _alone(model_dir, _prompt(2, 7), 5)
    check_engine(eng)
    _assert_kv_clean(eng)
    assert eng.scheduler.requests() == []


def test_abort_from_a_real_thread_while_execute_blocks(model_dir):
    """A real second thread aborts while the stepping thread sits inside execute (blocked on
    an Event until the abort returned): same deferred semantics, no exception in either
    thread, and the engine carries on."""
    eng = _engine(model_dir)
    eng.add_request("a", _prompt(3, 6), _greedy(8))
    eng.add_request("b", _prompt(4, 5), _greedy(6))
    eng.step()
    outs, result = _step_beside_thread(eng, lambda: eng.abort_request("a"),
                                       lambda output: {"kv_after_abort": eng.kv.has("a")})
    assert result["kv_after_abort"] is True         # not released while execute ran
    out = result["act"]
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == _alone(model_dir, _prompt(3, 6), 8)[:1]
    assert [o for o in outs if o.request_id == "a"] == [out]   # the step reports it too
    assert eng.scheduler.find_request("a") is None and not eng.kv.has("a")
    check_engine(eng)
    done = _run(eng)
    assert done["b"].outputs[0].token_ids == _alone(model_dir, _prompt(4, 5), 6)
    check_engine(eng)
    _assert_kv_clean(eng)


def test_abort_n2_request_mid_step(model_dir):
    """Aborting an n=2 request mid-step cancels both samples (r and r#1): one output with two
    "abort" completions, both sequences released and forgotten at the step's end, and the
    prefix blocks they shared stay consistent for the request still running."""
    eng = _engine(model_dir)
    eng.add_request("p", _prompt(5, 10), _greedy(8, n=2))
    eng.add_request("q", _prompt(5, 10), _greedy(4))       # same prompt: shares cached blocks
    eng.step()
    eng.step()
    seen = {}

    def abort_p(output):
        assert {"p", "p#1"} <= {c.request_id for c in output.chunks}
        seen["out"] = eng.abort_request("p")

    _Hook(eng, abort_p)
    eng.step()
    out = seen["out"]
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    alone = _alone(model_dir, _prompt(5, 10), 8)
    assert [c.token_ids for c in out.outputs] == [alone[:2], alone[:2]]
    for sid in ("p", "p#1"):
        assert eng.scheduler.find_request(sid) is None and not eng.kv.has(sid)
    check_engine(eng)
    _assert_refcounts(eng)
    done = _run(eng)
    assert done["q"].outputs[0].token_ids == _alone(model_dir, _prompt(5, 10), 4)
    _assert_kv_clean(eng)


# ------------------------------------------------------------------ 2. EngineBusy
def test_second_concurrent_step_raises_engine_busy(model_dir):
    """step() while another thread's step() is inside execute raises EngineBusy and changes
    nothing (no step scheduled, no KV touched); the first step completes normally, the engine
    is consistent and keeps serving, with the same tokens as an undisturbed run."""
    eng = _engine(model_dir)
    eng.add_request("a", _prompt(6, 8), _greedy(6))
    eng.add_request("b", _prompt(7, 3), _greedy(6, n=2))
    eng.step()
    inside, release = threading.Event(), threading.Event()
    result: dict = {}

    def block(output):
        inside.set()
        assert release.wait(WAIT)

    def stepper():
        try:
            result["outs"] = eng.step()
        except BaseException as error:   # pragma: no cover - reported below
            result["error"] = error

    _Hook(eng, block)
    thread = threading.Thread(target=stepper)
    thread.start()
    try:
        assert inside.wait(WAIT)
        step_count, kv_state = eng.scheduler.step_count, eng.kv.state_tuple()
        with pytest.raises(EngineBusy):
            eng.step()
        with pytest.raises(EngineBusy):
            eng.core.step()
        assert eng.scheduler.step_count == step_count
        assert eng.kv.state_tuple() == kv_state
        assert eng.stats.steps == 1
    finally:
        release.set()
        thread.join(WAIT)
    assert not thread.is_alive() and "error" not in result
    assert {o.request_id for o in result["outs"]} == {"a", "b"}
    assert eng.stats.steps == 2
    check_engine(eng)
    _assert_refcounts(eng)
    done = _run(eng)
    assert done["a"].outputs[0].token_ids == _alone(model_dir, _prompt(6, 8), 6)
    assert [c.token_ids for c in done["b"].outputs] == [_alone(model_dir, _prompt(7, 3), 6)] * 2
    check_engine(eng)
    _assert_kv_clean(eng)


# ------------------------------------------------------------------ 3. add_request mid-step
def test_add_request_from_another_thread_during_execute(model_dir):
    """Requests added by another thread while a step executes are queued safely: not part of
    the step in flight, waiting afterwards, then served with the tokens they get alone."""
    eng = _engine(model_dir)
    eng.add_request("a", _prompt(8, 6), _greedy(5))

    def add_five():
        for i in range(5):
            eng.add_request(f"late{i}", _prompt(10 + i, 4 + i), _greedy(3 + i))

    outs, result = _step_beside_thread(
        eng, add_five, lambda output: {"in_flight": {c.request_id for c in output.chunks}})
    assert result["in_flight"] == {"a"}
    assert {o.request_id for o in outs} == {"a"}
    for i in range(5):
        assert eng.scheduler.get_request(f"late{i}").status is RequestStatus.WAITING
    check_engine(eng)
    done = _run(eng)
    for i in range(5):
        assert done[f"late{i}"].outputs[0].token_ids == _alone(model_dir, _prompt(10 + i, 4 + i),
                                                               3 + i)
    assert done["a"].outputs[0].token_ids == _alone(model_dir, _prompt(8, 6), 5)
    _assert_kv_clean(eng)


# ------------------------------------------------------------------ 4. generate beside requests
GEN_PROMPTS = [_prompt(20, 5), _prompt(21, 11), _prompt(22, 2), _prompt(23, 8)]


def test_generate_beside_a_direct_request(model_dir):
    """generate() returns exactly its own outputs, in prompt order, equal to a fresh LLM's;
    a request added to the engine directly ("mine", longer than the batch) is not returned by
    generate and keeps running: the next engine.step() reports it (a prefix of its tokens run
    alone) and it finishes with exactly those tokens. A second direct request that finishes
    during generate is handed back by the next step(). No KV leaks."""
    params = _greedy(4)
    fresh = LLM(model_dir, block_size=4, num_blocks=64).generate(GEN_PROMPTS, params,
                                                                   use_tqdm=False)
    llm = LLM(model_dir, block_size=4, num_blocks=64)
    eng = llm.engine
    eng.add_request("mine", _prompt(30, 6), _greedy(24))
    eng.add_request("quick", _prompt(31, 3), _greedy(1))
    outs = llm.generate(GEN_PROMPTS, params, use_tqdm=False)
    assert len(outs) == len(GEN_PROMPTS)
    assert [o.prompt_token_ids for o in outs] == GEN_PROMPTS
    assert [o.request_id for o in outs] == [f"gen-{i}" for i in range(len(GEN_PROMPTS))]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fresh]
    assert all(o.finished for o in outs)
    assert eng.has_request("mine")
    check_engine(eng)
    mine_alone = _alone(model_dir, _prompt(30, 6), 24)
    first = eng.step()
    by_id = {o.request_id: o for o in first}
    assert set(by_id) == {"mine", "quick"}
    assert by_id["quick"].finished
    assert by_id["quick"].outputs[0].token_ids == _alone(model_dir, _prompt(31, 3), 1)
    so_far = by_id["mine"].outputs[0].token_ids
    assert 0 < len(so_far) < 24 and so_far == mine_alone[:len(so_far)]
    done = _run(eng)
    assert set(done) == {"mine"}
    assert done["mine"].outputs[0].token_ids == mine_alone
    check_engine(eng)
    _assert_kv_clean(eng)


def test_generate_beside_a_user_request_named_gen_0(model_dir):
    """A user request literally named "gen-0" does not collide with generate's ids: generate
    picks ids nobody uses, returns only its own outputs (correct ones), and the user's gen-0
    runs to its own result."""
    llm = LLM(model_dir, block_size=4, num_blocks=64)
    eng = llm.engine
    eng.add_request("gen-0", _prompt(40, 5), _greedy(12))
    outs = llm.generate(GEN_PROMPTS[:2], _greedy(3), use_tqdm=False)
    assert "gen-0" not in {o.request_id for o in outs}
    assert [o.prompt_token_ids for o in outs] == GEN_PROMPTS[:2]
    assert [o.outputs[0].token_ids for o in outs] == [
        _alone(model_dir, p, 3) for p in GEN_PROMPTS[:2]]
    done = _run(eng)
    assert set(done) == {"gen-0"}
    assert done["gen-0"].prompt_token_ids == _prompt(40, 5)
    assert done["gen-0"].outputs[0].token_ids == _alone(model_dir, _prompt(40, 5), 12)
    _assert_kv_clean(eng)


# ------------------------------------------------------------------ 5. ended requests are forgotten
def _sim_core(forget_ended: bool = True, log: EventLog | None = None):
    kv = KVCacheManager(64, 4)
    sched = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                                  prefill_chunk=64), log=log)
    core = EngineCore(sched, CostModelExecutor(sched.get_request, greedy_tokens),
                      forget_ended=forget_ended)
    return core, sched


def _sim_request(i: int) -> RuntimeRequest:
    """Short requests; a third share one of three 8-token prefixes (prefix-cache traffic)."""
    head = (hash_token((i % 3,), VOCAB),) * 8 if i % 3 == 0 else ()
    tail = tuple(hash_token((i, j), VOCAB) for j in range(1 + i % 6))
    return RuntimeRequest(f"r{i}", head + tail, 1 + i % 4)


WAVE = 50


def _run_waves(core, sched, total: int, *, trace_from: int, on_wave=None):
    """Add ``total`` requests in waves of WAVE, stepping each wave to completion; trace memory
    from request ``trace_from`` on (tracemalloc is slow; what happened before is not traced,
    growth after it is). Returns the traced memory after every wave once tracing, as (requests
    so far, bytes after a full garbage collection), the same right after every event-log
    compaction (the log length drops; only with a log), and the largest log length seen."""
    after_wave, after_compaction = [], []
    max_log = 0
    added = 0

    def log_len() -> int:
        return len(sched.log) if sched.log is not None else 0

    try:
        while added < total:
            if added == trace_from:
                gc.collect()
                tracemalloc.start()
            for _ in range(WAVE):
                core.add_request(_sim_request(added))
                added += 1
            while core.has_unfinished_requests():
                before = log_len()
                core.step()
                now = log_len()
                max_log = max(max_log, now)
                if now < before and tracemalloc.is_tracing():
                    gc.collect()   # count what is retained, not garbage awaiting collection
                    after_compaction.append((added, tracemalloc.get_traced_memory()[0]))
            if tracemalloc.is_tracing():
                gc.collect()
                after_wave.append((added, tracemalloc.get_traced_memory()[0]))
            if on_wave is not None:
                on_wave(added)
    finally:
        tracemalloc.stop()
    return after_wave, after_compaction, max_log


def _slope(points: list[tuple[int, int]]) -> float:
    """Least-squares bytes per request of ``(requests, bytes)`` samples."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    return (sum((x - mx) * (y - my) for x, y in points)
            / sum((x - mx) ** 2 for x, _ in points))


# Retained memory per finished request: the engine core keeps nothing of a request once it has
# been reported (no log by default), so memory sampled after each wave (and a full garbage
# collection) is flat. A retained request costs ~680 bytes (the control test measures it); the
# bound, 50 bytes per request, sits between noise and that leak.
RETAINED_BYTES_PER_REQUEST = 50
# With the write-ahead log switched on, memory is sampled right after each compaction: then
# the log holds the events of live requests only (at most one wave of 50). Measured: the
# samples from request 2,000 to 10,000 span ~55 KB with no trend; the bound, 256 KB
# (32 bytes/request), is ~5x the noise and ~20x below a leak of whole requests.
MEMORY_GROWTH_BOUND = 256 * 1024


def test_ten_thousand_requests_are_forgotten():
    """10,000 short requests through EngineCore (simulator executor, no event log): the
    scheduler's registry and the KV manager are empty after every wave, and memory retained
    after each wave grows by at most RETAINED_BYTES_PER_REQUEST per finished request."""
    core, sched = _sim_core()
    assert sched.log is None

    def on_wave(added):
        assert sched.requests() == []            # every ended request was forgotten
        assert sched.kv.requests() == []

    waves, _, _ = _run_waves(core, sched, 10_000, trace_from=2000, on_wave=on_wave)
    assert len(waves) == 8000 // WAVE
    slope = _slope(waves)
    print(f"retained: {slope:.2f} bytes per finished request over {len(waves)} waves")
    assert slope <= RETAINED_BYTES_PER_REQUEST, waves
    mems = [m for _, m in waves]
    assert max(mems) - min(mems) < RETAINED_BYTES_PER_REQUEST * 8000, waves
    check_scheduler(sched)
    assert not core.has_unfinished_requests()


def test_the_opt_in_event_log_stays_bounded():
    """With the write-ahead log on (chapter 5's recovery), the log never exceeds its compaction
    threshold plus one step's events, and memory right after each compaction is flat from
    request 2,000 to 10,000 (growth below MEMORY_GROWTH_BOUND)."""
    core, sched = _sim_core(log=EventLog())
    _, compactions, max_log = _run_waves(core, sched, 10_000, trace_from=2000)
    # one step adds a few events per request of its batch (at most 16 here)
    assert max_log <= sched.compact_min_events + 16 * 8
    points = [mem for _, mem in compactions]
    assert len(points) >= 10, compactions    # enough compactions to see a trend
    assert max(points) - points[0] < MEMORY_GROWTH_BOUND, compactions
    assert max(points[len(points) // 2:]) - min(points) < MEMORY_GROWTH_BOUND, compactions


def test_memory_probe_detects_a_registry_that_keeps_requests():
    """Control for the tests above: with forget_ended=False the registry keeps every ended
    request and the same measurement grows by more than 500 bytes per request, ten times the
    bound. So the flat result is not an artefact of the probe."""
    core, sched = _sim_core(forget_ended=False)
    waves, _, _ = _run_waves(core, sched, 2500, trace_from=0)
    assert len(sched.requests()) == 2500
    per_request = _slope(waves)
    assert per_request > 10 * RETAINED_BYTES_PER_REQUEST, per_request


def test_llm_engine_forgets_finished_requests(model_dir):
    """~300 requests of max_tokens=2 on the real engine, added in batches: at the end the
    scheduler, the KV manager and the engine hold nothing (ids unknown, nothing unfinished)."""
    eng = _engine(model_dir, max_num_seqs=32, max_num_batched_tokens=64)
    done = {}
    for batch in range(10):
        for i in range(30):
            k = batch * 30 + i
            eng.add_request(f"q{k}", _prompt(k, 1 + k % 5), _greedy(2, n=1 + (k % 7 == 0)))
        _run(eng, done)
        assert eng.scheduler.requests() == [] and eng.kv.requests() == []
    assert len(done) == 300
    assert all(o.finished and all(len(c.token_ids) == 2 for c in o.outputs)
               for o in done.values())
    assert not eng.has_unfinished_requests()
    assert eng.get_num_unfinished_requests() == 0
    assert not any(eng.has_request(f"q{k}") for k in range(300))
    assert eng.stats.finished_requests == 300
    check_engine(eng)
    _assert_kv_clean(eng)


def test_request_admitted_and_finished_in_one_step(model_dir):
    """A request admitted and finished in the same step (max_tokens=1; or a stop token as its
    first sample) is already forgotten by the core when the engine folds the step in: step()
    must still return its output and count its prompt (regression: it raised KeyError and
    lost the step's outputs)."""
    eng = _engine(model_dir)
    first = _alone(model_dir, _prompt(70, 9), 1)[0]
    eng.add_request("one", _prompt(70, 9), _greedy(1))
    eng.add_request("stop", _prompt(70, 9), SamplingParams(max_tokens=6, temperature=0,
                                                           stop_token_ids=[first]))
    eng.add_request("other", _prompt(71, 4), _greedy(3))
    outs = {o.request_id: o for o in eng.step()}
    assert set(outs) == {"one", "stop", "other"}
    assert [(c.token_ids, c.finish_reason) for c in outs["one"].outputs] == [([first], "length")]
    assert [(c.token_ids, c.finish_reason) for c in outs["stop"].outputs] == [([first], "stop")]
    assert outs["one"].finished and outs["stop"].finished and not outs["other"].finished
    assert eng.stats.prompt_tokens == 9 + 9 + 4
    check_engine(eng)
    eng.add_request("again", _prompt(70, 9), _greedy(1))      # served from the prefix cache
    again = {o.request_id: o for o in eng.step()}["again"]
    assert again.num_cached_tokens == 8 and again.outputs[0].token_ids == [first]
    done = _run(eng)
    assert done["other"].outputs[0].token_ids == _alone(model_dir, _prompt(71, 4), 3)
    _assert_kv_clean(eng)


# ------------------------------------------------------------------ 6. request id reuse
def _observable(eng: LLMEngine) -> tuple:
    return (eng.kv.state_tuple(), eng.get_num_unfinished_requests(), eng.scheduler.step_count,
            [(r.request_id, r.status, tuple(r.output_token_ids))
             for r in eng.scheduler.requests()])


def test_finished_id_is_reusable_and_a_live_one_is_not(model_dir):
    """Once "x" finished and its output was returned, add_request("x") works at once and the
    new x runs correctly; adding an id that is still running (or an n=2 request's id) raises
    ValueError and leaves the engine exactly as it was."""
    eng = _engine(model_dir)
    eng.add_request("x", _prompt(50, 4), _greedy(3))
    assert _run(eng)["x"].outputs[0].token_ids == _alone(model_dir, _prompt(50, 4), 3)
    eng.add_request("x", _prompt(51, 6), _greedy(5, n=2))      # immediately reusable
    eng.step()
    before = _observable(eng)
    for rid in ("x",):
        with pytest.raises(ValueError, match="duplicate"):
            eng.add_request(rid, _prompt(52, 3), _greedy(2))
    assert _observable(eng) == before
    check_engine(eng)
    out = _run(eng)["x"]
    assert [c.token_ids for c in out.outputs] == [_alone(model_dir, _prompt(51, 6), 5)] * 2
    eng.add_request("x", _prompt(52, 3), _greedy(2))
    assert _run(eng)["x"].outputs[0].token_ids == _alone(model_dir, _prompt(52, 3), 2)
    _assert_kv_clean(eng)


def test_id_aborted_mid_step_is_reusable_after_the_step(model_dir):
    """An id aborted during a step is still ending until the step ends: re-adding it then
    raises ValueError (engine unchanged); right after the step it is accepted."""
    eng = _engine(model_dir)
    eng.add_request("y", _prompt(53, 5), _greedy(6))
    eng.step()
    seen = {}

    def abort_and_readd(output):
        eng.abort_request("y")
        before = _observable(eng)
        with pytest.raises(ValueError, match="still ending"):
            eng.add_request("y", _prompt(54, 3), _greedy(2))
        seen["unchanged"] = _observable(eng) == before
        seen["in_use"] = eng.has_request("y")

    _Hook(eng, abort_and_readd)
    eng.step()
    assert seen == {"unchanged": True, "in_use": True}
    assert not eng.has_request("y")
    eng.add_request("y", _prompt(54, 3), _greedy(2))
    assert _run(eng)["y"].outputs[0].token_ids == _alone(model_dir, _prompt(54, 3), 2)
    _assert_kv_clean(eng)


def test_id_in_use_while_a_later_sample_is_still_ending(model_dir):
    """n=2 request whose sample 0 already finished (and was forgotten) and whose sample 1 is
    aborted mid-step: ``has_request`` stays True (and re-adding is refused) until the step ends,
    then the id is free again — the engine remembers which samples of an aborted id may still
    be ending, not only the first one."""
    eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=64, max_num_seqs=4,
                    max_num_batched_tokens=8))
    eng.add_request("z", _prompt(61, 6), _greedy(3, n=2))
    eng.step()                       # z: whole prompt + 1st token; z#1: 2 of its 6 tokens
    eng.step()
    eng.step()                       # z finishes (3 tokens); z#1 is one token behind
    seen = {}

    def abort_and_probe(output):
        assert [c.request_id for c in output.chunks] == ["z#1"]
        eng.abort_request("z")
        seen["in_use"] = eng.has_request("z")
        with pytest.raises(ValueError, match="still ending"):
            eng.add_request("z", _prompt(62, 3), _greedy(2, n=2))

    _Hook(eng, abort_and_probe)
    eng.step()
    assert seen == {"in_use": True}
    assert not eng.has_request("z")
    eng.add_request("z", _prompt(62, 3), _greedy(2, n=2))
    done = _run(eng)
    assert [c.token_ids for c in done["z"].outputs] == [_alone(model_dir, _prompt(62, 3), 2)] * 2
    _assert_kv_clean(eng)


def test_core_reuses_a_forgotten_id():
    """At the EngineCore level too: once a request ended and was reported, its id is free."""
    core, sched = _sim_core()
    core.add_request(RuntimeRequest("z", (1, 2, 3), 2))
    with pytest.raises(ValueError, match="duplicate"):
        core.add_request(RuntimeRequest("z", (4, 5), 2))
    while core.has_unfinished_requests():
        core.step()
    assert sched.find_request("z") is None
    core.add_request(RuntimeRequest("z", (4, 5), 2))
    ended = []
    while core.has_unfinished_requests():
        ended += core.step().ended
    assert [r.request_id for r in ended] == ["z"]
    assert ended[0].prompt_token_ids == (4, 5) and len(ended[0].output_token_ids) == 2


# ------------------------------------------------------------------ 7. use_tqdm
class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_use_tqdm_off_a_terminal_prints_nothing(model_dir, monkeypatch):
    """generate(use_tqdm=True) with stderr not a TTY draws no bar and returns the same
    outputs as use_tqdm=False; on a (fake) TTY the bar is drawn, so the check can fail."""
    llm = LLM(model_dir, block_size=4, num_blocks=64)
    quiet = llm.generate(GEN_PROMPTS, _greedy(3), use_tqdm=False)
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    piped = llm.generate(GEN_PROMPTS, _greedy(3), use_tqdm=True)
    assert pipe.getvalue() == ""
    tty = _FakeTTY()
    monkeypatch.setattr("sys.stderr", tty)
    shown = llm.generate(GEN_PROMPTS, _greedy(3), use_tqdm=True)
    assert "Processed prompts" in tty.getvalue()
    tokens = [[o.outputs[0].token_ids for o in outs] for outs in (quiet, piped, shown)]
    assert tokens[0] == tokens[1] == tokens[2]


# ------------------------------------------------------------------ 8. a refused executor result
class _Tamper:
    """Wraps an executor; ``tamper(output, sampled)`` edits the sampled dict of the next step."""

    def __init__(self, inner, tamper):
        self.inner, self.tamper = inner, tamper

    def execute(self, output):
        result = self.inner.execute(output)
        sampled = dict(result.sampled)
        if self.tamper is not None:
            self.tamper(output, sampled)
            self.tamper = None
        return dataclasses.replace(result, sampled=sampled)


def _ghost(output, sampled):
    sampled["ghost"] = 5                                    # a request not in the step


def _mid_prefill(output, sampled):
    chunk = next(c for c in output.chunks if not c.sample)
    sampled[chunk.request_id] = 5                           # in the step, did not sample


def _missing(output, sampled):
    sampled.pop(next(iter(sampled)))


def _negative(output, sampled):
    sampled[next(iter(sampled))] = -1


@pytest.mark.parametrize("tamper", [_ghost, _mid_prefill, _missing, _negative])
def test_refused_executor_result_fails_the_step_and_the_core_goes_on(tamper):
    """An executor result that breaks the protocol (a token for a request outside the step,
    for one whose chunk did not sample, a missing or a negative token) is refused by
    update_from_output with ValueError, and the core is not left wedged: the step's requests
    fail (reason ERROR, KV released once, reported by the next step), a late abort that
    arrived during the step is applied, requests outside the step are untouched, and the next
    steps run normally."""
    kv = KVCacheManager(32, 4)
    sched = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=6,
                                                  prefill_chunk=6))
    good = CostModelExecutor(sched.get_request, greedy_tokens)
    core = EngineCore(sched, good)
    core.add_request(RuntimeRequest("a", (1, 2, 3), 4))        # samples in step 2
    core.add_request(RuntimeRequest("b", tuple(range(10, 19)), 4))   # 3 + 6: mid-prefill
    core.add_request(RuntimeRequest("c", (7, 8), 3))           # waits: max_num_seqs=2
    core.add_request(RuntimeRequest("d", (9, 9, 9), 3))        # waits; aborted mid-step
    core.step()                    # a: 3 prompt tokens + sample; b: first 3 prompt tokens
    assert sched.get_request("a").output_token_ids
    late = []

    def abort_d_then(output, sampled):
        late.append(core.abort_request("d"))
        tamper(output, sampled)

    core.executor = _Tamper(good, abort_d_then)
    step_before = sched.step_count
    with pytest.raises(ValueError):
        core.step()
    assert not core._stepping
    assert sched.step_count == step_before + 1
    a, b = sched.get_request("a"), sched.get_request("b")
    assert a.status is b.status is RequestStatus.FAILED
    assert a.finish_reason is b.finish_reason is FinishReason.ERROR
    assert not kv.has("a") and not kv.has("b")
    assert sched.get_request("c").status is RequestStatus.WAITING
    assert late[0].request_id == "d" and sched.find_request("d") is None   # abort applied
    check_scheduler(sched)
    ended = []
    while core.has_unfinished_requests():
        ended.append(core.step())
    assert sorted(r.request_id for r in ended[0].ended) == ["a", "b"]   # reported next step
    finished = [r for step in ended for r in step.ended if r.status is RequestStatus.FINISHED]
    assert [r.request_id for r in finished] == ["c"]
    assert finished[0].output_token_ids == [
        hash_token((7, 8)), hash_token((7, 8, hash_token((7, 8)))),
        hash_token((7, 8, hash_token((7, 8)), hash_token((7, 8, hash_token((7, 8))))))]
    assert sched.requests() == []
    check_scheduler(sched)
    assert kv.requests() == [] and snapshot_of(kv).pending_copies == ()


def test_refused_result_on_the_real_engine_reports_error(model_dir):
    """The same refusal inside LLMEngine: step() raises ValueError, the next step() returns
    the step's request finished with finish_reason "error", and the engine serves new
    requests correctly afterwards."""
    eng = _engine(model_dir)
    eng.add_request("a", _prompt(60, 5), _greedy(4))
    eng.step()
    inner = eng.core.executor
    eng.core.executor = _Tamper(inner, _ghost)
    with pytest.raises(ValueError, match="did not sample"):
        eng.step()
    eng.core.executor = inner
    check_engine(eng)
    outs = eng.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [
        ("a", True, "error")]
    eng.add_request("a", _prompt(60, 5), _greedy(4))
    assert _run(eng)["a"].outputs[0].token_ids == _alone(model_dir, _prompt(60, 5), 4)
    _assert_kv_clean(eng)


# ---------------------------------------------------------------- overlap (async) scheduling

def test_overlap_plans_the_next_step_while_the_executor_runs_this_one():
    """The executor of step 1 waits until step 2 has been planned: the overlapped core gets
    past it (the synchronous one could not, and would time out), the executor runs on another
    thread, and steps run in the order planned."""
    from kvlab.labs.chaos.soak import OverlapChaosExecutor, _request, solo_tokens

    planned, ran = threading.Event(), []
    sched = BaselineScheduler(KVCacheManager(32, 4), SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=True))
    schedule = sched.schedule

    def schedule_and_tell():
        output = schedule()
        if output.step == 2:
            planned.set()
        return output

    sched.schedule = schedule_and_tell
    inner = OverlapChaosExecutor(sched.get_request)

    class Gated:
        def execute(self, output):
            ran.append((output.step, threading.current_thread() is threading.main_thread()))
            if output.step == 1:
                assert planned.wait(WAIT), "step 2 was not planned while step 1 executed"
            return inner.execute(output)

    core = EngineCore(sched, Gated(), overlap=True, forget_ended=False)
    core.add_request(_request("a", (7, 8, 9), 5))
    while core.has_unfinished_requests() or core.has_steps_in_flight():
        core.step()
    assert [s for s, _ in ran] == list(range(1, len(ran) + 1))
    assert not any(main for _, main in ran)
    assert tuple(sched.get_request("a").output_token_ids) == solo_tokens((7, 8, 9), 5)


def test_overlap_abort_from_another_thread_while_a_step_executes(model_dir):
    """A request aborted while its step executes (the runner blocked) ends 'abort' at once in
    the engine's output, its KV is freed when the step ends, and the id is reusable after."""
    engine = LLMEngine(EngineArgs(model_dir, async_scheduling=True))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    executor, started, release = engine.executor, threading.Event(), threading.Event()
    real = executor.execute

    def held(output):
        started.set()
        assert release.wait(WAIT)
        return real(output)

    executor.execute = held
    result: list = []
    stepper = threading.Thread(target=lambda: result.append(engine.step()))
    stepper.start()
    assert started.wait(WAIT)
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    release.set()
    stepper.join(WAIT)
    executor.execute = real
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.kv.requests() and not engine.scheduler.requests()
    engine.add_request("a", [4, 5], SamplingParams(max_tokens=2))    # the id is free again
    check_engine(engine)
