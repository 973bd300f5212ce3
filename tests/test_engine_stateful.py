"""A Hypothesis state machine over a real LLMEngine (tiny random Llama) under KV pressure.

Rules: add a greedy request (prompt of 1-12 tokens, often sharing a prefix with others so the
prefix cache is hit; max_tokens 1-8; n in {1, 2}), abort a live request between steps, abort a
live request while a step executes (the abort is issued from inside the executor's
``execute``), and step. The cache is small (block_size 2, 24 blocks) and so is the step budget,
so requests are chunked, preempted and recomputed. After every rule the engine's invariants
hold. Every output is checked as it arrives (tokens only grow; an aborted request's tokens are
a prefix of its solo run, and the next step repeats its final output once), and at teardown
the engine runs dry: every block ends free or
cached, and every completed request's tokens (both samples when n=2) equal the same request
run alone on a fresh engine with a roomy cache.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

pytest.importorskip("transformers")

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.invariants import check_engine
from kvlab.labs.kv_snapshot import snapshot_of
from kvlab.labs.parity.hf import save_random_hf_model

VOCAB = 128
BLOCK_SIZE = 2
NUM_BLOCKS = 24            # a request needs up to 10 blocks (12 + 8 - 1 = 19 slots)
BUDGET = 12                # max_num_batched_tokens
MAX_LIVE = 8               # live requests at once (16 sequences at most)
PREFIXES = ((), (5, 17, 99, 42, 8, 61), (5, 17, 99, 42, 120, 3, 77, 30))

SETTINGS = settings(max_examples=20, stateful_step_count=30, deadline=None,
                    derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)


class EngineMachine(RuleBasedStateMachine):
    """One LLMEngine per example; ``model_dir`` and the reference cache are set by the test."""

    model_dir: ClassVar = None
    reference: ClassVar[dict[tuple[tuple[int, ...], int], list[int]]] = {}
    stats: ClassVar[dict[str, int]] = dict.fromkeys(
        ("preemptions", "completed", "aborted", "mid_step_aborts", "steps", "references"), 0)

    def __init__(self):
        super().__init__()
        self.eng = LLMEngine(EngineArgs(self.model_dir, block_size=BLOCK_SIZE,
                                        num_blocks=NUM_BLOCKS, max_num_batched_tokens=BUDGET))
        self.counter = 0
        self.live: dict[str, tuple[tuple[int, ...], int, int]] = {}  # rid -> prompt, max, n
        self.last: dict[str, list[list[int]]] = {}    # rid -> token ids per sample, so far
        self.completed: dict[str, tuple[tuple[int, ...], int, list[list[int]]]] = {}
        self.abort_reports: dict[str, object] = {}   # rid -> the output the next step repeats

    # ------------------------------------------------------------------ references
    def alone(self, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        """Greedy tokens of the request run alone on a fresh, roomy engine (cached)."""
        key = (prompt, max_tokens)
        if key not in self.reference:
            self.stats["references"] += 1
            eng = LLMEngine(EngineArgs(self.model_dir, block_size=BLOCK_SIZE, num_blocks=128,
                            max_num_batched_tokens=BUDGET))
            eng.add_request("alone", list(prompt), _params(max_tokens))
            out = None
            while eng.has_unfinished_requests():
                for o in eng.step():
                    out = o
            assert out is not None and out.finished
            self.reference[key] = out.outputs[0].token_ids
        return self.reference[key]

    # ------------------------------------------------------------------ output bookkeeping
    def _seen(self, out) -> None:
        """Fold one step output in: tokens only grow; a finished request is complete."""
        rid = out.request_id
        if rid in self.abort_reports:   # an abort's final output, reported once more by a step
            assert out == self.abort_reports.pop(rid)
            return
        assert rid in self.live, f"output for {rid}, which is not live"
        prompt, max_tokens, n = self.live[rid]
        assert out.prompt_token_ids == list(prompt)
        assert [c.index for c in out.outputs] == list(range(n))
        tokens = [c.token_ids for c in out.outputs]
        for old, new in zip(self.last[rid], tokens, strict=True):
            assert new[:len(old)] == old, f"{rid}: tokens changed"
            assert len(new) <= max_tokens
        self.last[rid] = tokens
        if out.finished:
            assert [c.finish_reason for c in out.outputs] == ["length"] * n
            assert all(len(t) == max_tokens for t in tokens)
            self.completed[rid] = (prompt, max_tokens, tokens)
            del self.live[rid]
            self.stats["completed"] += 1

    def _aborted(self, rid: str, out) -> None:
        """An abort's output: finished, every unfinished sample "abort", tokens a prefix of the
        solo run (greedy), the request gone from the engine's books."""
        prompt, max_tokens, n = self.live.pop(rid)
        assert out.request_id == rid and out.finished
        assert [c.index for c in out.outputs] == list(range(n))
        ref = self.alone(prompt, max_tokens)
        for c, old in zip(out.outputs, self.last.pop(rid), strict=True):
            assert c.finish_reason in ("abort", "length")
            assert c.finish_reason == "abort" or len(c.token_ids) == max_tokens
            assert c.token_ids[:len(old)] == old
            assert c.token_ids == ref[:len(c.token_ids)]
        self.abort_reports[rid] = out
        self.stats["aborted"] += 1

    def _step(self):
        self.stats["steps"] += 1
        outs = self.eng.step()
        trace = self.eng.last_trace
        self.stats["preemptions"] += len(trace.scheduler_output.preempted)
        assert len({o.request_id for o in outs}) == len(outs), "a request reported twice"
        for out in outs:
            self._seen(out)
        return outs

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(batch=st.lists(st.tuples(st.sampled_from(PREFIXES),
                                   st.lists(st.integers(0, VOCAB - 1), max_size=12),
                                   st.integers(1, 8), st.sampled_from([1, 2])),
                         min_size=1, max_size=3))
    def add(self, batch):
        """Add 1-3 requests (bursts keep enough of them live for KV pressure)."""
        for prefix, tail, max_tokens, n in batch[:MAX_LIVE - len(self.live)]:
            prompt = (prefix + tuple(tail))[:12] or (1,)
            rid = f"r{self.counter}"
            self.counter += 1
            self.eng.add_request(rid, list(prompt), _params(max_tokens, n))
            self.live[rid] = (prompt, max_tokens, n)
            self.last[rid] = [[] for _ in range(n)]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self._aborted(rid, self.eng.abort_request(rid))
        assert not self.eng.has_request(rid)    # nothing in flight: gone at once

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_mid_step(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        eng = self.eng
        sids = [rid] + [f"{rid}#{i}" for i in range(1, self.live[rid][2])]
        live_before = [s for s in sids if eng.scheduler.find_request(s) is not None
                       and not eng.scheduler.find_request(s).status.is_terminal]
        orig = eng.executor.execute
        got = {}

        def execute(output):
            got["out"] = eng.abort_request(rid)
            got["live"] = [s for s in sids if eng.scheduler.find_request(s) is not None
                           and not eng.scheduler.find_request(s).status.is_terminal]
            return orig(output)

        eng.executor.execute = execute
        try:
            outs = eng.step()
        finally:
            eng.executor.execute = orig
        assert got["live"] == live_before           # deferred: nothing cancelled yet
        assert all(eng.scheduler.find_request(s) is None for s in sids)  # applied at step end
        assert not eng.has_request(rid)
        self._aborted(rid, got["out"])   # this step's outputs repeat it (checked in _seen)
        assert rid in {o.request_id for o in outs}
        self.stats["preemptions"] += len(eng.last_trace.scheduler_output.preempted)
        for out in outs:
            self._seen(out)
        self.stats["mid_step_aborts"] += 1

    @rule(steps=st.integers(1, 3))
    def step(self, steps):
        for _ in range(steps):   # several: steps must outnumber aborts for requests to finish
            self._step()
            check_engine(self.eng)

    # ------------------------------------------------------------------ checks
    @invariant()
    def consistent(self):
        check_engine(self.eng)
        assert self.eng.get_num_unfinished_requests() == len(self.live)

    def teardown(self):
        for _ in range(500):
            if not self.eng.has_unfinished_requests():
                break
            self._step()
            check_engine(self.eng)
        assert not self.live and not self.abort_reports
        assert not self.eng.has_unfinished_requests()
        snap = snapshot_of(self.eng.kv)
        assert snap.tables == {} and snap.pending_copies == ()
        assert set(snap.block_states) <= {"free", "cached"}
        assert snap.free_blocks + snap.evictable_blocks == NUM_BLOCKS
        assert self.eng.scheduler.requests() == []
        for rid, (prompt, max_tokens, tokens) in self.completed.items():
            ref = self.alone(prompt, max_tokens)
            assert tokens == [ref] * len(tokens), rid


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_hf_model(tmp_path_factory.mktemp("stateful") / "llama", "llama", seed=9)


def test_engine_state_machine(model_dir, monkeypatch):
    """Runs the machine (derandomized) and checks the run really covered what it claims:
    preemptions, completions, aborts between and during steps."""
    monkeypatch.setattr(EngineMachine, "model_dir", model_dir)
    monkeypatch.setattr(EngineMachine, "reference", {})
    stats = {k: 0 for k in EngineMachine.stats}
    monkeypatch.setattr(EngineMachine, "stats", stats)
    was = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny model; two OpenMP threads thrash on a loaded machine
    try:
        run_state_machine_as_test(EngineMachine, settings=SETTINGS)
    finally:
        torch.set_num_threads(was)
    assert stats["preemptions"] > 0, stats
    assert stats["completed"] > 20 and stats["aborted"] > 5 and stats["mid_step_aborts"] > 2, stats
