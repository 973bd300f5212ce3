"""CUDA-graph decode (kvlab.engine.cuda_graphs) on CPU: the ladder, and the real padding and
static-buffer code driven through the engine with the CPU stand-in for a graph
(``EagerCapture``: each "replay" reruns the captured callable on the same buffers).

The engine turns graphs on for CUDA only; here ``engine_build.use_decode_graphs`` is forced
True (unless ``enforce_eager``, which the eager references set), so the build takes the CUDA
path otherwise unchanged (the scratch block past the KV
manager's, the capture of every ladder size, the runner's hook)."""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.engine import cuda_graphs, engine_build
from kvlab.engine.cuda_graphs import EagerCapture, capture_sizes, counter, padded_size
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.quantization.setup import EngineQuantization

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42], [7] * 19, [100, 3], [8, 9, 10, 11, 12, 13, 14]]
ENGINE = dict(max_model_len=96, max_num_seqs=8, block_size=4)


def graphed_llm(monkeypatch, **kwargs) -> LLM:
    monkeypatch.setattr(engine_build, "use_decode_graphs", lambda a, *rest: not a.enforce_eager)
    return LLM("kvlab-tiny", **{**ENGINE, **kwargs})


def generate(llm: LLM, max_tokens=(9, 14, 6, 11, 3)):
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2)
              for m in max_tokens]
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_ladder_is_vllms_pattern_cut_at_max_num_seqs():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(5) == (1, 2, 4, 5)        # the top size itself is captured
    assert capture_sizes(1) == (1,)
    big = capture_sizes(10_000)
    assert big[-1] == 512 and 248 in big and 256 in big and 272 in big and 264 not in big
    assert capture_sizes(300, limit=300)[-3:] == (272, 288, 300)
    with pytest.raises(ValueError, match="largest size"):
        capture_sizes(0)
    sizes = capture_sizes(64)
    assert [padded_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 63, 64, 65)] == [
        1, 2, 4, 8, 8, 16, 16, 24, 64, 64, None]


def test_engine_turns_graphs_on_for_cuda_only():
    quant = EngineQuantization.resolve(None, 64, "auto")
    args = EngineArgs("kvlab-tiny")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert engine_build.use_decode_graphs(args, cuda, quant, None)
    assert not engine_build.use_decode_graphs(args, cpu, quant, None)
    assert not engine_build.use_decode_graphs(EngineArgs("kvlab-tiny", enforce_eager=True),
                                              cuda, quant, None)
    assert not engine_build.use_decode_graphs(args, cuda, quant, object())   # speculative
    assert not engine_build.use_decode_graphs(
        args, cuda, EngineQuantization.resolve(None, 64, "int8"), None)        # quantized KV
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineArgs("kvlab-tiny", enforce_eager="yes")


def test_graphs_are_captured_per_size_with_a_scratch_block(monkeypatch):
    llm = graphed_llm(monkeypatch)
    eng = llm.engine
    graphs = eng.executor.graphs
    assert graphs is not None and graphs.sizes == (1, 2, 4, 8)
    assert set(graphs.graphs) == {1, 2, 4, 8}
    assert all(isinstance(g, EagerCapture) for g in graphs.graphs.values())
    # the scratch block is the cache's last, one past what the KV manager hands out
    assert graphs.scratch_block == eng.num_blocks == eng.cache.num_blocks - 1
    assert graphs.block_tables.shape == (8, 96 // 4)


def test_padded_decode_matches_eager_token_for_token(monkeypatch):
    eager = generate(LLM("kvlab-tiny", enforce_eager=True, **ENGINE))
    before = counter.replayed
    graphed = generate(graphed_llm(monkeypatch))
    # 5 requests -> batch 5 padded to 8, then 4, 3, 2, 1 as they finish: every decode replays
    assert counter.replayed - before >= 13
    for a, b in zip(eager, graphed, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert max(abs(la[t] - lb[t]) for t in la) < 1e-4


def test_static_buffers_are_reused_and_padding_is_restored(monkeypatch):
    eng = graphed_llm(monkeypatch).engine
    graphs = eng.executor.graphs
    buffers = [graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.block_tables,
               graphs.seq_lens, graphs.hidden]
    ptrs = [b.data_ptr() for b in buffers]
    for i, (p, m) in enumerate(zip(PROMPTS, (9, 14, 6, 11, 3), strict=True)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0,
                                                   ignore_eos=True))
    seen = set()
    while eng.has_unfinished_requests():
        replays = counter.replayed
        eng.step()
        meta = eng.last_trace.metadata
        if meta is None or counter.replayed == replays:
            continue
        n = meta.num_tokens
        seen.add(n)
        assert [b.data_ptr() for b in buffers] == ptrs          # same storage every step
        assert torch.equal(graphs.input_ids[:n], meta.input_ids)  # ... this step's contents
        assert torch.equal(graphs.positions[:n], meta.positions)
        assert torch.equal(graphs.slot_mapping[:n], meta.slot_mapping)
        assert torch.equal(graphs.seq_lens[:n], meta.paged_lens)
        w = meta.paged_tables.shape[1]
        assert torch.equal(graphs.block_tables[:n, :w], meta.paged_tables)
        # rows past the batch are padding: token 0, position 0, the scratch slot and table
        assert not graphs.input_ids[n:].any() and not graphs.positions[n:].any()
        assert (graphs.slot_mapping[n:] == graphs.scratch_slot).all()
        assert (graphs.block_tables[n:] == graphs.scratch_block).all()
        assert (graphs.seq_lens[n:] == 1).all()
    assert {5, 3, 1} <= seen      # the batch shrank: rows were handed back to padding


def test_padded_rows_never_write_a_live_block(monkeypatch):
    eng = graphed_llm(monkeypatch).engine
    graphs, cache = eng.executor.graphs, eng.cache
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True))
    checked = 0
    while eng.has_unfinished_requests():
        before = cache.data.clone()
        replays = counter.replayed
        eng.step()
        if counter.replayed == replays:
            continue
        meta = eng.last_trace.metadata
        assert padded_size(graphs.sizes, meta.num_tokens) > meta.num_tokens   # 3 -> 4
        per_slot = (cache.data != before).flatten(start_dim=4).any(-1).any(0).any(0)
        changed = set(per_slot.flatten().nonzero()[:, 0].tolist())
        allowed = set(meta.slot_mapping.tolist()) | set(
            range(graphs.scratch_slot, graphs.scratch_slot + cache.block_size))
        assert changed <= allowed and changed >= set(meta.slot_mapping.tolist())
        checked += 1
    assert checked >= 5


def test_prefill_mixed_and_oversized_steps_run_eagerly(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_CAPTURE_SIZE", 2)       # ladder (1, 2)
    llm = graphed_llm(monkeypatch)
    assert llm.engine.executor.graphs.sizes == (1, 2)
    eager = generate(LLM("kvlab-tiny", enforce_eager=True, **ENGINE))
    eng = llm.engine
    for i, (p, m) in enumerate(zip(PROMPTS, (9, 14, 6, 11, 3), strict=True)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0,
                                                   ignore_eos=True, logprobs=2))
    kinds = {"prefill": 0, "too_large": 0, "replayed": 0}
    outs = {}
    while eng.has_unfinished_requests():
        replays, too_large = counter.replayed, counter.too_large
        for o in eng.step():
            outs[o.request_id] = o.outputs[0]
        chunks = eng.last_trace.scheduler_output.chunks
        if any(c.num_tokens > 1 for c in chunks):
            assert counter.replayed == replays     # a prefill or mixed step: eager
            kinds["prefill"] += 1
        elif len(chunks) > 2:
            assert counter.replayed == replays and counter.too_large == too_large + 1
            kinds["too_large"] += 1
        elif chunks:
            assert counter.replayed == replays + 1
            kinds["replayed"] += 1
    assert all(kinds.values()), kinds
    for i, want in enumerate(eager):
        assert outs[f"r{i}"].token_ids == want.token_ids


def test_decode_graphs_refuse_a_bad_ladder(monkeypatch):
    eng = LLM("kvlab-tiny", **ENGINE).engine
    for sizes in ([], [4, 2], [0, 1], [1, 1, 2]):
        with pytest.raises(ValueError, match="ascending positive"):
            cuda_graphs.DecodeGraphs(eng.model, eng.cache.layers, eng.executor.kernels, sizes=sizes,
                                     block_size=4, max_model_len=96, scratch_block=0)


def test_a_failed_capture_leaves_the_engine_eager_and_says_why(monkeypatch):
    def broken(fn, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "EagerCapture", broken)
    with pytest.warns(UserWarning, match="capture failed, decoding eagerly"):
        llm = graphed_llm(monkeypatch)
    assert llm.engine.executor.graphs is None
    assert "stream is capturing" in counter.capture_error
    eager = LLM("kvlab-tiny", enforce_eager=True, **ENGINE)
    assert generate(llm)[0].token_ids == generate(eager)[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_match_eager_on_a_gpu():
    """On a GPU: the captured graphs (fused ops bound) give the eager engine's greedy tokens."""
    kw = dict(ENGINE, device="cuda", dtype=torch.float32)
    eager = generate(LLM("kvlab-tiny", enforce_eager=True, **kw))
    before = counter.replayed
    llm = LLM("kvlab-tiny", **kw)
    assert isinstance(next(iter(llm.engine.executor.graphs.graphs.values())),
                      cuda_graphs.CudaGraphCapture)
    graphed = generate(llm)
    assert counter.replayed - before >= 13
    for a, b in zip(eager, graphed, strict=True):
        assert a.token_ids == b.token_ids
        assert all(abs(la[t] - lb[t]) < 1e-3
                   for la, lb in zip(a.logprobs, b.logprobs, strict=True) for t in la)
