"""benchmarks/bench_engine_vs_hf.py's decode-attention floor counts the K/V its paged rows read:
every position each row attends, K and V, over all layers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.llm import LLM

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))   # the script imports _results as top level
    spec = importlib.util.spec_from_file_location("bench_engine_vs_hf",
                                                  BENCHMARKS / "bench_engine_vs_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paged_kv_bytes_counts_each_decode_rows_context(monkeypatch):
    bench = _bench(monkeypatch)
    llm = LLM(BENCHMARKS.parent / "kvlab" / "models" / "kvlab-tiny",
              enable_prefix_caching=False)
    eng = llm.engine
    cfg = eng.model.cfg
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.add_request("a", [3 + i % 50 for i in range(20)], params)
    eng.add_request("b", [7 + i % 40 for i in range(35)], params)
    eng.step()                                  # both prompts, whole: no paged rows
    assert bench.paged_kv_bytes(llm, eng.last_trace.metadata) == 0
    eng.step()                                  # two decodes, at positions 20 and 35
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4   # float32 K, V
    assert bench.paged_kv_bytes(llm, eng.last_trace.metadata) == (21 + 36) * per_position
    assert bench.paged_kv_bytes(llm, None) == 0


def test_stream_read_rate_is_bytes_over_the_best_time(monkeypatch):
    # readings in pairs (start, end): the warm-up sum reads no clock; timings 0.3, 0.1, 0.4,
    # 0.2, 0.5 s, so only the best (0.1 s) gives the rate
    readings = iter([0.0, 0.3, 1.0, 1.1, 2.0, 2.4, 3.0, 3.2, 4.0, 4.5])
    rate = _bench(monkeypatch).stream_read_gbps(clock=lambda: next(readings))
    assert abs(rate - 256 * 2**20 / 0.1 / 1e9) < 1e-6     # 256 MiB in 0.1 s


def test_paged_kv_bytes_counts_a_short_chunk_behind_a_prefix_row_by_row(monkeypatch):
    bench = _bench(monkeypatch)
    llm = LLM(BENCHMARKS.parent / "kvlab" / "models" / "kvlab-tiny")   # prefix caching on
    eng = llm.engine
    if eng.executor.kernels.attention.paged_max_tokens == 0:
        pytest.skip("no compiled row op: short chunks behind a prefix are attended whole")
    cfg = eng.model.cfg
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefix = [5 + i % 30 for i in range(32)]           # two full blocks of 16
    eng.add_request("p", [*prefix, 9], params)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("q", [*prefix, 11, 12, 13, 14], params)   # 4 new tokens at 32..35
    eng.step()
    meta = eng.last_trace.metadata
    assert meta.paged_lens.tolist() == [33, 34, 35, 36]
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert bench.paged_kv_bytes(llm, meta) == (33 + 34 + 35 + 36) * per_position
