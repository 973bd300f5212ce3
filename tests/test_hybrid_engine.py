"""The engine on a model with sliding-window layers: a block table per KV cache group (the
hybrid manager), checked against the same model run with one full table for all layers
(``disable_hybrid_kv_cache_manager``) under KV pressure, forks and prefix hits, with every
invariant after every step; what a request holds per group while it runs; what is refused.
Parity with transformers is in ``test_hf_parity.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvlab.core.kv_cache_groups import window_blocks
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.llm import LLM
from kvlab.labs.invariants import check_engine, check_every_step
from kvlab.labs.parity.hf import save_random_hf_model

WINDOW, BS = 8, 4


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Qwen2, 4 layers: layer 0 full attention, layers 1-3 a window of 8 (4 groups of 1)."""
    return save_random_hf_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", seed=1,
                                num_hidden_layers=4, use_sliding_window=True,
                                sliding_window=WINDOW, max_window_layers=1)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 17, 23))
    return [a, b, a + c, a + b, c, b + a, a[:30]]


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=2 if i == 2 else 1)


def _run(llm: LLM, checked: bool = True) -> dict[str, list[list[int]]]:
    engine = llm.engine
    if checked:
        check_every_step(engine)
    for i, p in enumerate(_prompts()):
        engine.add_request(str(i), p, _params(i))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [c.token_ids for c in out.outputs]
        if checked:
            check_engine(engine)
    return outs


def test_per_group_tables_give_the_full_tables_tokens_under_pressure(qwen2):
    """A small pool (preemptions, evictions), forks (n=2) and prefix hits: the hybrid
    manager's run equals the one-table run token for token; invariants hold every step."""
    hybrid = LLM(qwen2, block_size=BS, num_blocks=48, max_num_seqs=3, max_prefill_chunk=8)
    assert isinstance(hybrid.engine.kv, HybridKVCacheManager)
    assert [g.window for g in hybrid.engine.cache.groups] == [0, WINDOW, WINDOW, WINDOW]
    got = _run(hybrid)
    assert hybrid.engine.kv.hit_tokens > 0
    full = LLM(qwen2, block_size=BS, max_num_seqs=3, max_prefill_chunk=8,
               disable_hybrid_kv_cache_manager=True)
    assert isinstance(full.engine.kv, KVCacheManager)
    assert got == _run(full, checked=False)


def test_a_request_holds_its_windows_blocks_only(qwen2):
    llm = LLM(qwen2, block_size=BS, max_num_batched_tokens=8, max_num_seqs=1)
    engine, kv = llm.engine, llm.engine.kv
    engine.add_request("a", _prompts()[0], SamplingParams(max_tokens=60, temperature=0,
                                                          ignore_eos=True))
    bound = window_blocks(WINDOW, 100, BS, 8)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        if kv.has("a"):
            tables = kv.block_tables("a")
            assert None not in tables[0]               # full attention keeps every block
            held = [sum(b is not None for b in t) for t in tables[1:]]
            assert max(held) <= bound
            peak = max(peak, *held)
    assert 0 < peak < -(-100 // BS)                    # bounded well below the 25 of 100 tokens


def test_one_block_freed_too_early_changes_the_tokens(qwen2, monkeypatch):
    """The comparison above is not vacuous: releasing one block more than the window allows
    lets another request overwrite KV that is still read."""
    plan = HybridKVCacheManager._plan_grow

    def one_too_many(self, rid, num_tokens, write_from):
        return plan(self, rid, num_tokens, write_from + BS)

    monkeypatch.setattr(HybridKVCacheManager, "_plan_grow", one_too_many)
    early = _run(LLM(qwen2, block_size=BS, num_blocks=48, max_num_seqs=3, max_prefill_chunk=8),
                 checked=False)
    monkeypatch.undo()
    right = _run(LLM(qwen2, block_size=BS, num_blocks=48, max_num_seqs=3, max_prefill_chunk=8),
                 checked=False)
    assert early != right


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative_config"),
])
def test_what_the_per_group_layout_does_not_support_is_refused(qwen2, kwargs, named):
    with pytest.raises(ValueError, match=named):
        LLM(qwen2, **kwargs)
    LLM(qwen2, disable_hybrid_kv_cache_manager=True, **kwargs)    # one table: it runs


def test_kv_events_with_per_group_tables_are_refused_by_name(qwen2):
    """The KV-event publisher follows the single-layout radix cache; a windowed model's
    per-group tables are refused with the way out named, not failed on later."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://127.0.0.1:0", "topic": "kv-events"}
    with pytest.raises(ValueError, match=r"kv_events_config.*disable_hybrid_kv_cache_manager"):
        LLM(qwen2, kv_events_config=config)


def test_the_cli_flag_keeps_one_table(qwen2):
    """``--disable-hybrid-kv-cache-manager`` (vLLM's flag) reaches the engine: one full table
    for all layers instead of a table per group."""
    import argparse

    from kvlab.engine.engine_args import EngineArgs
    from kvlab.engine.llm_engine import LLMEngine

    ap = argparse.ArgumentParser()
    EngineArgs.add_cli_args(ap)
    grouped = LLMEngine(EngineArgs.from_cli_args(ap.parse_args(["--model", str(qwen2)])))
    one = LLMEngine(EngineArgs.from_cli_args(ap.parse_args(
        ["--model", str(qwen2), "--disable-hybrid-kv-cache-manager"])))
    assert isinstance(grouped.kv, HybridKVCacheManager)
    assert isinstance(one.kv, KVCacheManager)
