"""Overlap ("async") scheduling against the synchronous engine it must equal.

``async_scheduling=True`` plans step n+1 while step n executes; every output a user can see must
be the synchronous engine's: a differential test over a random workload (prefix sharing,
chunked prefill, n > 1, preemption; through ``LLM.generate`` and through ``LLMEngine.step``
with arrivals and aborts at random steps, invariants checked after every step), each sampling
feature (stop strings, logprobs, prompt logprobs, structured outputs, min_tokens and penalties),
a failing step, what it refuses, the extra step of latency to the first token, and the server.
No test here reads a clock.
"""

from __future__ import annotations

import json
import random

import pytest

from kvlab import LLM, SamplingParams
from kvlab.core.engine_core import StepObserver
from kvlab.core.request import PLACEHOLDER
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.invariants import check_engine, check_every_step

MODEL = "kvlab-tiny"
#: a small pool, short prefill chunks and a tight token budget: preemption and chunked prefill
TIGHT = dict(block_size=16, num_blocks=14, max_num_seqs=8, max_num_batched_tokens=48,
             max_prefill_chunk=16)


def random_workload(seed: int, count: int) -> list[tuple[list[int], SamplingParams]]:
    """``count`` requests: a third to two thirds open with one of three shared prefixes, n of 1
    to 3, greedy or seeded sampling (with top-k / top-p), EOS honoured or ignored."""
    rng = random.Random(seed)
    shared = [[rng.randrange(2, 1024) for _ in range(rng.choice((16, 24, 40)))]
              for _ in range(3)]
    work = []
    for _ in range(count):
        prompt = [rng.randrange(2, 1024) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.5:
            prompt = rng.choice(shared) + prompt
        greedy = rng.random() < 0.5
        params = SamplingParams(
            max_tokens=rng.randint(1, 28), n=rng.choice((1, 1, 2, 3)),
            temperature=0.0 if greedy else rng.choice((0.6, 1.0)),
            top_k=0 if greedy else rng.choice((0, 20)), top_p=1.0 if greedy else 0.9,
            seed=None if greedy else rng.randrange(10_000), ignore_eos=rng.random() < 0.5)
        work.append((prompt, params))
    return work


def _seen(outputs) -> list:
    """What a user sees of each request: per sample, tokens, finish and stop reasons."""
    return [[(c.index, list(c.token_ids), c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outputs]


@pytest.fixture(scope="module")
def pair():
    """A synchronous and an overlapped LLM with the same tight configuration."""
    return LLM(MODEL, **TIGHT), LLM(MODEL, async_scheduling=True, **TIGHT)


# ------------------------------------------------------------------ differential, generate()
def test_generate_gives_the_synchronous_tokens_over_a_random_workload(pair):
    sync, overlap = pair
    work = random_workload(1, 28)
    prompts, params = [p for p, _ in work], [s for _, s in work]
    a = sync.generate(prompts, params, use_tqdm=False)
    b = overlap.generate(prompts, params, use_tqdm=False)
    assert _seen(b) == _seen(a)
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cy.cumulative_logprob == pytest.approx(cx.cumulative_logprob, abs=1e-4)
    # the workload exercised what it is meant to: preemption, prefix hits, n > 1, chunking
    assert sum(o.metrics.num_preemptions for o in b) > 0
    assert sum(o.num_cached_tokens for o in b) > 0
    assert any(len(o.outputs) > 1 for o in b)
    assert any(len(p) > TIGHT["max_prefill_chunk"] for p in prompts)
    for llm in pair:
        check_engine(llm.engine)


# ------------------------------------------------------------------ differential, step()
def _drive(engine: LLMEngine, seed: int) -> dict[str, list]:
    """Arrivals at random steps; some requests are aborted once they show a drawn number of
    tokens (the same point in both engines, whatever their step numbering). Invariants after
    every step; the last output of each request."""
    rng = random.Random(seed)
    work = random_workload(seed, 24)
    arrivals = sorted(rng.randrange(0, 30) for _ in work)
    abort_at = {f"s{seed}r{i}": rng.randint(1, 6) for i in range(len(work))
                if rng.random() < 0.3 and work[i][1].n == 1}
    last: dict[str, object] = {}
    preempted = [0]
    step, i = 0, 0
    while i < len(work) or engine.has_unfinished_requests():
        while i < len(work) and arrivals[i] <= step:
            engine.add_request(f"s{seed}r{i}", *work[i])
            i += 1
        for out in engine.step():
            last[out.request_id] = out
            preempted[0] += out.finished and out.metrics.num_preemptions
            m = abort_at.get(out.request_id)
            if not out.finished and m is not None and len(out.outputs[0].token_ids) >= m:
                last[out.request_id] = engine.abort_request(out.request_id)
        check_engine(engine)
        step += 1
    assert {r for r in abort_at if last[r].outputs[0].finish_reason == "abort"}, \
        "no request was aborted: the test lost its point"
    assert preempted[0] > 0, "no request was preempted: the test lost its point"
    assert any(o.num_cached_tokens for o in last.values()), "no prefix was shared"
    return {rid: _seen([o]) for rid, o in last.items()}


def test_step_loop_with_arrivals_and_aborts_gives_the_synchronous_outputs():
    sync = LLMEngine(EngineArgs(MODEL, **TIGHT))
    overlap = LLMEngine(EngineArgs(MODEL, async_scheduling=True, **TIGHT))
    hook = check_every_step(overlap)      # the spec's nine invariants, every step
    for seed in (2, 3):
        assert _drive(overlap, seed) == _drive(sync, seed)
    assert hook.monitor.checks > 0
    for engine in (sync, overlap):        # nothing is left of the requests that ran
        _nothing_left(engine)


def _nothing_left(engine: LLMEngine) -> None:
    """No request, KV table or step in flight; the runner keeps only the requests the next
    output will tell it to drop (the synchronous engine's last finished ones)."""
    assert not engine.kv.requests() and not engine.scheduler.requests()
    assert not engine.core.has_steps_in_flight()
    leaving = set(engine.scheduler.pending_finished_ids)
    assert set(engine.executor.requests) <= leaving
    assert engine.executor.input_batch.row_ids() <= leaving
    assert engine.kv.num_allocatable_blocks() == engine.num_blocks


# ------------------------------------------------------------------ features
def _both(pair, prompts, params):
    return [llm.generate(prompts, params, use_tqdm=False) for llm in pair]


PROMPTS = ["Once upon a time", "The river", "In the town of", "She said"]


def test_stop_strings_end_the_same_samples_with_the_same_text(pair):
    params = SamplingParams(max_tokens=40, temperature=0, stop=["the", " a"], n=1)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=2, stop=[" a"])
    for p in (params, seeded):
        a, b = _both(pair, PROMPTS, p)
        assert _seen(b) == _seen(a)
        assert [[c.text for c in o.outputs] for o in b] == \
            [[c.text for c in o.outputs] for o in a]
        assert any(c.stop_reason in ("the", " a") for o in b for c in o.outputs)


def test_logprobs_and_prompt_logprobs_are_the_synchronous_ones(pair):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=3,
                            prompt_logprobs=2)
    a, b = _both(pair, PROMPTS, params)
    assert _seen(b) == _seen(a)
    for x, y in zip(a, b, strict=True):
        assert len(y.prompt_logprobs) == len(x.prompt_logprobs)
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
            assert px.keys() == py.keys()
            assert all(py[t] == pytest.approx(px[t], abs=1e-4) for t in px)
        lx, ly = x.outputs[0].logprobs, y.outputs[0].logprobs
        assert [d.keys() for d in ly] == [d.keys() for d in lx]


def test_min_tokens_and_penalties_are_the_synchronous_ones(pair):
    params = [SamplingParams(max_tokens=24, temperature=t, seed=5, min_tokens=10,
                             repetition_penalty=1.3, frequency_penalty=0.5,
                             presence_penalty=0.3) for t in (0.0, 0.9)]
    prompts = PROMPTS[:2]
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in pair)
    assert _seen(b) == _seen(a)
    assert all(len(o.outputs[0].token_ids) >= 10 for o in b)


def test_structured_outputs_are_the_synchronous_ones(pair):
    pytest.importorskip("xgrammar")
    specs = [{"regex": r"(red|green|blue)( (red|green|blue)){0,3}\."},
             {"choice": ["yes", "no", "not sure"]},
             {"json": {"type": "object", "required": ["age"], "properties": {
                 "age": {"type": "integer", "minimum": 0, "maximum": 99}}}}]
    params = [SamplingParams(max_tokens=64, temperature=t, seed=11, structured_outputs=spec)
              for spec in specs for t in (0.0, 1.0)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in pair)
    assert _seen(b) == _seen(a)
    # every grammar ended (at EOS) while the step after was in flight: that step's row was
    # sampled past the grammar's end and discarded
    assert all(o.outputs[0].finish_reason == "stop" for o in b)
    check_engine(pair[1].engine)          # grammar states agree with the known outputs


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("name, value", [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ("speculative_config", {"method": "draft_model", "model": "kvlab-tiny-draft",
                            "num_speculative_tokens": 2}),
    ("kv_transfer_config", {"kv_connector": "inprocess", "kv_role": "kv_producer"}),
])
def test_refused_combinations_name_the_option(name, value):
    with pytest.raises(ValueError, match=rf"async_scheduling=True .* {name}"):
        EngineArgs(MODEL, async_scheduling=True, **{name: value})


def test_the_scheduler_and_the_core_refuse_what_overlap_cannot_keep():
    from kvlab.core.engine_core import EngineCore
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.production_scheduler import ProductionScheduler
    from kvlab.core.scheduler_config import SchedulerConfig
    from kvlab.labs.recovery.event_log import EventLog

    kv = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match=r"async scheduling.*write-ahead log"):
        ProductionScheduler(kv, SchedulerConfig(async_scheduling=True), log=EventLog())
    with pytest.raises(ValueError, match=r"overlap=True.*async_scheduling=True"):
        EngineCore(ProductionScheduler(kv, SchedulerConfig()), executor=None, overlap=True)
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        SchedulerConfig(async_scheduling=True, num_lookahead_tokens=2)


def test_async_scheduling_must_be_a_bool():
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineArgs(MODEL, async_scheduling="yes")


# ------------------------------------------------------------------ a failing step
class _FailAt:
    """The executor raises on its ``at``-th call (on the worker thread)."""

    def __init__(self, fn, at):
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, output):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("device lost (test)")
        return self.fn(output)


def test_a_failing_step_fails_its_requests_and_the_step_planned_on_it_and_nothing_else(
        monkeypatch):
    work = [([i + 2] * (3 + i), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            for i in range(8)]
    reference = LLM(MODEL, max_num_seqs=4).generate([p for p, _ in work], work[0][1],
                                                    use_tqdm=False)
    engine = LLMEngine(EngineArgs(MODEL, async_scheduling=True, max_num_seqs=4))
    steps = {}                             # step number -> request ids, as planned

    class Planned(StepObserver):
        def before_execute(self, core, output):
            steps[output.step] = {c.request_id for c in output.chunks}

    engine.core.add_observer(Planned())
    for i, (p, sp) in enumerate(work):
        engine.add_request(f"r{i}", p, sp)
    failing = _FailAt(engine.executor.execute, 4)
    monkeypatch.setattr(engine.executor, "execute", failing)
    finals, raised = {}, 0
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0]
        except RuntimeError as error:
            assert "device lost" in str(error)
            raised += 1
            check_engine(engine)           # released once, nothing in flight left behind
    assert raised == 1
    doomed = steps[4] | steps[5]           # the failed step and the one planned on it
    failed = {rid for rid, c in finals.items() if c.finish_reason == "error"}
    assert failed == doomed and doomed
    for i, ref in enumerate(reference):    # everyone else: the synchronous tokens
        if f"r{i}" not in doomed:
            assert finals[f"r{i}"].token_ids == ref.outputs[0].token_ids
    _nothing_left(engine)


# ------------------------------------------------------------------ what it costs
def _steps_to_first_token(overlap: bool) -> int:
    """Steps from adding a request to a busy engine until its first token is out."""
    engine = LLMEngine(EngineArgs(MODEL, async_scheduling=overlap))
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.add_request("new", [8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True))
    for steps in range(1, 10):
        if any(o.request_id == "new" and o.outputs[0].token_ids for o in engine.step()):
            return steps
    raise AssertionError("no first token")


def test_overlap_costs_a_request_arriving_mid_run_one_step_to_its_first_token():
    # the step in flight when it arrives was planned without it
    assert _steps_to_first_token(False) == 1
    assert _steps_to_first_token(True) == 2


def test_a_decode_is_planned_on_a_placeholder_the_runner_fills():
    engine = LLMEngine(EngineArgs(MODEL, async_scheduling=True))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()                          # steps 1 (prefill) and 2 (its decode) planned
    with engine.core.lock:
        request = engine.scheduler.get_request("a")
        assert request.output_token_ids[-1] == PLACEHOLDER
        assert request.num_output_placeholders == 1
    check_engine(engine)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    sync = LLM(MODEL).generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True),
                               use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == sync[0].outputs[0].token_ids


# ------------------------------------------------------------------ the server
def test_serve_cli_with_async_scheduling_answers_as_the_synchronous_engine(pair):
    """``kvlab serve --async-scheduling`` in its own process: a greedy completion with
    logprobs, a seeded n=2 one and a streamed one cut by a stop string give the synchronous
    engine's text."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import httpx
    from test_serve import free_port, wait_healthy

    port = free_port()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvlab", "serve", "--port", str(port),
                             "--async-scheduling"], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    bodies = [dict(prompt=PROMPTS[0], max_tokens=20, temperature=0, logprobs=2),
              dict(prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=7, n=2),
              dict(prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=[" a"], stream=True)]
    try:
        wait_healthy(url, proc)
        answers = []
        for body in bodies:
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)
            assert r.status_code == 200, r.text
            if body.get("stream"):
                events = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: {")]
                text = "".join(c["text"] for e in events for c in e["choices"])
                answers.append([(text, events[-1]["choices"][0]["finish_reason"])])
            else:
                answers.append([(c["text"], c["finish_reason"])
                                for c in sorted(r.json()["choices"], key=lambda c: c["index"])])
    finally:
        proc.terminate()
        proc.wait(30)
    sync = pair[0]
    for body, got in zip(bodies, answers, strict=True):
        params = SamplingParams(**{k: v for k, v in body.items()
                                   if k in ("max_tokens", "temperature", "seed", "n", "stop")})
        (want,) = sync.generate([body["prompt"]], params, use_tqdm=False)
        assert got == [(c.text, c.finish_reason) for c in want.outputs]
    assert answers[2][0][1] == "stop"


def test_the_serve_flag_builds_an_overlapped_engine():
    import argparse

    from kvlab.entrypoints.serve import add_server_args

    ap = argparse.ArgumentParser()
    EngineArgs.add_cli_args(ap)
    add_server_args(ap)
    assert EngineArgs.from_cli_args(ap.parse_args(["--async-scheduling"])).async_scheduling
    assert not EngineArgs.from_cli_args(ap.parse_args([])).async_scheduling
    assert LLMEngine(EngineArgs.from_cli_args(
        ap.parse_args(["--async-scheduling", "--max-model-len", "64"]))).core.overlap


def test_sliding_window_groups_under_overlap_give_the_synchronous_tokens(tmp_path):
    """Per-group block tables whose window groups free blocks as the window moves: with the
    next step planned early (its window one token on), the in-flight step still runs first, so
    the tokens are the synchronous engine's; the invariants hold every step."""
    from test_hybrid_engine import BS, WINDOW, _run

    from kvlab.labs.parity.hf import save_random_hf_model

    path = save_random_hf_model(tmp_path / "qwen2", "qwen2", seed=1, num_hidden_layers=4,
                                use_sliding_window=True, sliding_window=WINDOW,
                                max_window_layers=1)
    kw = dict(block_size=BS, num_blocks=48, max_num_seqs=3, max_prefill_chunk=8)
    assert _run(LLM(path, async_scheduling=True, **kw)) == _run(LLM(path, **kw))
