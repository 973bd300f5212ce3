"""LLM / LLMEngine behaviour: equivalences that must hold whatever the batching or caching."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.checkpoint import load_checkpoint
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm import LLM
from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.invariants import check_engine
from kvlab.labs.parity.hf import save_random_hf_model

VOCAB = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_hf_model(tmp_path_factory.mktemp("engine") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, VOCAB, (37,), generator=gen).tolist()  # shared "system prompt"
    out = [system + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 20)]
    out += [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 6, 50)]
    return out


def _llm(model_dir, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 256)
    return LLM(model_dir, **kw)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=11,
                         ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_prefix_caching_does_not_change_outputs(model_dir, prompts, params):
    on = _llm(model_dir, enable_prefix_caching=True)
    first = _tokens(on.generate(prompts, params))
    again = _tokens(on.generate(prompts, params))  # now served from the cache
    off = _tokens(_llm(model_dir, enable_prefix_caching=False).generate(prompts, params))
    assert first == off == again
    assert on.engine.stats.prefix_hit_rate > 0.3
    check_engine(on.engine)


def test_batched_equals_one_at_a_time(model_dir, prompts):
    batched = _tokens(_llm(model_dir).generate(prompts, SAMPLED))
    single = _llm(model_dir, enable_prefix_caching=False)
    alone = [_tokens(single.generate([p], SAMPLED))[0] for p in prompts]
    assert batched == alone


def test_chunked_prefill_equals_whole_prefill(model_dir, prompts):
    whole = _tokens(_llm(model_dir, max_num_batched_tokens=512).generate(prompts, GREEDY))
    chunked_llm = _llm(model_dir, max_num_batched_tokens=16, max_prefill_chunk=5)
    assert _tokens(chunked_llm.generate(prompts, GREEDY)) == whole


def test_forks_equal_separate_requests_with_same_seeds(model_dir, prompts):
    n = 3
    forked_llm = _llm(model_dir)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=n, ignore_eos=True)
    forked = forked_llm.generate(prompts[:3], params)
    sep = _llm(model_dir, enable_prefix_caching=False)
    for prompt, out in zip(prompts[:3], forked, strict=True):
        assert [c.index for c in out.outputs] == list(range(n))
        for c in out.outputs:
            alone = sep.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0,
                                                          seed=5 + c.index, ignore_eos=True))
            assert c.token_ids == alone[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in forked[0].outputs}) > 1  # samples do differ
    check_engine(forked_llm.engine)


def test_seed_reproducible_and_independent_of_batch(model_dir, prompts):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    a = _llm(model_dir).generate([prompts[0]], p)[0].outputs[0].token_ids
    noisy = [SamplingParams(max_tokens=5, temperature=1.5, seed=i) for i in range(5)]
    b = _llm(model_dir).generate([*prompts[1:], prompts[0]], [*noisy, p])[-1].outputs[0].token_ids
    assert a == b
    c = _llm(model_dir).generate([prompts[0]], SamplingParams(
        max_tokens=12, temperature=1.0, seed=43, ignore_eos=True))[0].outputs[0].token_ids
    assert c != a


def test_topk1_and_tiny_topp_are_greedy(model_dir, prompts):
    greedy = _tokens(_llm(model_dir).generate(prompts, GREEDY))
    k1 = SamplingParams(max_tokens=10, temperature=1.3, top_k=1, seed=0, ignore_eos=True)
    p0 = SamplingParams(max_tokens=10, temperature=1.3, top_p=1e-6, seed=0, ignore_eos=True)
    assert _tokens(_llm(model_dir).generate(prompts, k1)) == greedy
    assert _tokens(_llm(model_dir).generate(prompts, p0)) == greedy


def test_logprobs_are_raw_log_softmax(model_dir, prompts):
    llm = _llm(model_dir)
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=6, temperature=2.0, seed=1,
                                                    logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 6
    ckpt = load_checkpoint(model_dir)
    ids = prompts[4] + out.token_ids
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    total = 0.0
    for t, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompts[4]) - 1 + t]
        top3 = row.topk(3).indices.tolist()
        assert set(lp) == set(top3) | {tok}  # the top-3 and the sampled token
        for tid, v in lp.items():
            assert abs(v - row[tid].item()) < 1e-4  # before temperature
        total += lp[tok]
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-4)
    assert ckpt.config.vocab_size == VOCAB


def test_stop_tokens_max_tokens_and_ignore_eos(model_dir, prompts):
    llm = _llm(model_dir)
    free = llm.generate([prompts[3]], GREEDY)[0].outputs[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate([prompts[3]], SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    # the model's eos ends a request unless ignore_eos
    eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=64))
    eng.eos_token_ids = (stop_at,)
    eng.config = eng.config.__class__(**{**eng.config.__dict__, "eos_token_ids": (stop_at,)})
    eng.add_request("a", prompts[3], SamplingParams(max_tokens=10, temperature=0))
    eng.add_request("b", prompts[3], SamplingParams(max_tokens=10, temperature=0,
                                                    ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    assert done["a"].finish_reason == "stop" and len(done["a"].token_ids) == first + 1
    assert done["b"].token_ids == free.token_ids


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_preemption_under_kv_pressure_keeps_outputs(model_dir, prompts, params):
    """A preempted request (recomputed after re-admission) yields exactly the tokens it would
    have yielded unpreempted: greedy trivially, seeded sampling because the sequence's private
    generator survives preemption and advances once per sampled token, however often the
    request is rescheduled (a stream restarted at re-admission fails the "sampled" case)."""
    ample_outs = _llm(model_dir).generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in ample_outs) == 0
    tight = _llm(model_dir, num_blocks=24, enable_prefix_caching=False)
    tight_outs = tight.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in tight_outs) > 0  # the pressure is real
    assert _tokens(tight_outs) == _tokens(ample_outs)
    check_engine(tight.engine)


def test_step_api_abort_and_snapshot(model_dir, prompts):
    eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=128))
    eng.add_request("a", prompts[0], SamplingParams(max_tokens=20, temperature=0))
    eng.add_request("b", prompts[1], SamplingParams(max_tokens=3, temperature=0, n=2, seed=1))
    eng.step()
    snap = eng.snapshot()
    assert {r.request_id for r in snap.requests} >= {"a", "b", "b#1"}
    assert {e.request_id for e in snap.last_batch} == {"a", "b", "b#1"}  # n=2 fans out
    for entry in snap.last_batch:
        view = next(r for r in snap.requests if r.request_id == entry.request_id)
        bs = snap.block_size
        assert entry.slots == tuple(view.block_table[p // bs] * bs + p % bs for p in range(
            entry.start_pos, entry.start_pos + entry.num_tokens))
    # samples admitted in one step each compute the prompt (nothing was cached yet); a later
    # request with the same prompt shares their full blocks through the prefix cache
    first = next(r for r in snap.requests if r.request_id == "b")
    second = next(r for r in snap.requests if r.request_id == "b#1")
    assert first.block_table[0] != second.block_table[0]
    heads = {r.block_table[0] for r in snap.requests}
    eng.add_request("c", prompts[1], SamplingParams(max_tokens=2, temperature=0))
    eng.step()
    snap = eng.snapshot()
    later = next(r for r in snap.requests if r.request_id == "c")
    assert later.num_cached_tokens == (len(prompts[1]) - 1) // 4 * 4 > 0
    assert later.block_table[0] in heads    # the first writer's copy (a shares the prefix)
    assert snap.refcounts[later.block_table[0]] >= 3    # its writer, c and the prefix cache
    out = eng.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    check_engine(eng)
    while eng.has_unfinished_requests():
        eng.step()
    check_engine(eng)
    snap = eng.snapshot()
    assert all(s in ("free", "cached") for s in snap.block_states)  # nothing leaked


def test_generate_returns_a_request_aborted_by_another_thread(model_dir, prompts):
    """Another thread aborts one of generate()'s requests: generate returns, that request
    finished with reason "abort", the others complete (it used to spin forever on empty
    steps, since the abort's output went only to the aborting thread)."""
    import threading

    llm = _llm(model_dir)
    engine = llm.engine
    real_step = engine.step
    steps = []

    def step(**kw):
        steps.append(1)
        if len(steps) == 2:   # abort from another thread while generate() waits
            worker = threading.Thread(target=engine.abort_request, args=("gen-0",))
            worker.start()
            worker.join()
        assert len(steps) < 500, "generate() did not return after the abort"
        return real_step(**kw)

    engine.step = step
    outs = llm.generate(prompts[:2], SamplingParams(max_tokens=40, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert len(outs[0].outputs[0].token_ids) < 40
    assert outs[1].outputs[0].finish_reason == "length"
    assert len(outs[1].outputs[0].token_ids) == 40
    assert not engine.has_unfinished_requests()
    check_engine(engine)


def test_get_metrics_has_vllms_shape(model_dir, prompts):
    """LLM.get_metrics() returns vLLM's metric objects (name, labels, value) with its names,
    and the counts agree with the outputs."""
    from kvlab.engine.metrics import Counter, Gauge

    llm = _llm(model_dir)
    outs = llm.generate(prompts[:3], SamplingParams(max_tokens=5, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)
    metrics = llm.get_metrics()
    by_name = {}
    for m in metrics:
        assert m.name.startswith("vllm:") and isinstance(m.labels, dict)
        by_name.setdefault(m.name, []).append(m)
    counter = {n: ms[0].value for n, ms in by_name.items() if isinstance(ms[0], Counter)}
    assert counter["vllm:generation_tokens"] == 15
    assert counter["vllm:prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert counter["vllm:prefix_cache_hits"] <= counter["vllm:prefix_cache_queries"]
    success = {m.labels["finished_reason"]: m.value for m in by_name["vllm:request_success"]}
    assert success == {"length": 3}
    gauges = {n: ms[0].value for n, ms in by_name.items() if isinstance(ms[0], Gauge)}
    assert gauges["vllm:num_requests_running"] == gauges["vllm:num_requests_waiting"] == 0
    assert 0.0 <= gauges["vllm:kv_cache_usage_perc"] <= 1.0
    assert not any(n.startswith("vllm:spec_decode") for n in by_name)   # not speculating


def test_text_prompts_need_a_tokenizer(model_dir):
    llm = _llm(model_dir)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", GREEDY)


def _run_one(eng, rid, prompt, **kw):
    eng.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0), **kw)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o if o.request_id == rid else out
    return out


def test_prefix_cache_is_scoped_by_security_domain(model_dir, prompts):
    eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=128))
    assert _run_one(eng, "a1", prompts[0], security_domain="tenant-a").num_cached_tokens == 0
    assert _run_one(eng, "b1", prompts[0], security_domain="tenant-b").num_cached_tokens == 0
    hit = _run_one(eng, "a2", prompts[0], security_domain="tenant-a").num_cached_tokens
    assert hit == (len(prompts[0]) - 1) // 4 * 4  # every full block but the last token's
    assert eng.cache_scope("tenant-a") != eng.cache_scope("tenant-b")
    check_engine(eng)


# bf16 vs fp32 log-probabilities on this model: measured max |difference| 0.0225 over the top-5
# entries of every position of prompts[:3] (bf16 keeps 8 significant bits: ~0.4% of a logit of
# a few units). The tolerance leaves a factor > 2 of margin.
BF16_LOGPROB_TOL = 0.05


def test_bfloat16_matches_float32(model_dir, prompts):
    """The bf16 engine runs the same code: its greedy tokens and log-probabilities track the
    fp32 engine's. Where both logprob vectors are within TOL of each other, a top-1 margin
    above 2 * TOL cannot flip, so tokens must agree there; a flip is only allowed at a near-tie,
    after which the contexts differ and the comparison of that request stops."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    ref = _llm(model_dir).generate(prompts[:3], params)
    llm = _llm(model_dir, dtype=torch.bfloat16)
    outs = llm.generate(prompts[:3], params)
    assert llm.engine.cache.data.dtype == torch.bfloat16
    assert dict(llm.engine.cache_scope()).get("kv_dtype") == "bfloat16"
    compared = 0
    for r, o in zip(ref, outs, strict=True):
        a, b = r.outputs[0], o.outputs[0]
        assert len(b.token_ids) == 10
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            shared = a.logprobs[pos].keys() & b.logprobs[pos].keys()
            assert ta in shared and tb in shared
            for tid in shared:
                assert abs(a.logprobs[pos][tid] - b.logprobs[pos][tid]) < BF16_LOGPROB_TOL, (
                    r.request_id, pos, tid)
            compared += 1
            if ta != tb:
                top = sorted(a.logprobs[pos].values(), reverse=True)
                assert top[0] - top[1] < 2 * BF16_LOGPROB_TOL, f"flipped a clear argmax at {pos}"
                break
    assert compared >= 20  # 30 on this seed: the run did not diverge early


def test_rejected_request_with_n_samples_finishes(model_dir, prompts):
    """A request the scheduler refuses (here: an overload policy with no queue) ends with
    finish_reason 'rejected' on every one of its n samples."""
    import dataclasses

    from kvlab.core.production_scheduler import ProductionScheduler

    def no_queue(kv, config):
        return ProductionScheduler(kv, dataclasses.replace(config, max_waiting=0))

    llm = _llm(model_dir, scheduler=no_queue, max_num_seqs=2)
    outs = llm.generate(prompts[:2], SamplingParams(max_tokens=4, n=2, seed=0))
    # the first request's two samples take the two free slots; the second finds none
    assert [c.finish_reason for c in outs[1].outputs] == ["rejected"] * 2
    assert "rejected" not in [c.finish_reason for c in outs[0].outputs]
    assert all(o.finished for o in outs)
    assert not llm.engine.has_unfinished_requests()
    check_engine(llm.engine)


def test_delta_outputs_add_up_to_the_cumulative_ones(model_dir, prompts):
    """``output_kind=DELTA`` (vLLM's RequestOutputKind.DELTA, what the server streams with):
    each step's output holds only the tokens and logprobs after the previous output's, so
    concatenated they equal the CUMULATIVE run's (same seeds), and an abort's output holds
    only what no output carried yet. CUMULATIVE outputs are unchanged (each holds all)."""
    from kvlab.core.sampling_params import RequestOutputKind

    delta = RequestOutputKind.DELTA
    kw = dict(max_tokens=12, temperature=0.9, seed=5, n=2, logprobs=2, ignore_eos=True)

    def run(kind: RequestOutputKind, abort_after: int | None = None):
        eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=128))
        for i, p in enumerate(prompts[:3]):
            eng.add_request(f"r{i}", p, SamplingParams(**kw, output_kind=kind))
        got: dict[str, list] = {}
        steps = 0
        while eng.has_unfinished_requests():
            outs = eng.step()
            steps += 1
            if steps == abort_after:
                outs.append(eng.abort_request("r1"))
            for out in outs:
                got.setdefault(out.request_id, []).append(out)
        return got

    cumulative, deltas = run(RequestOutputKind.CUMULATIVE), run(delta)
    for rid, outs in cumulative.items():
        final = outs[-1]
        for k, c in enumerate(final.outputs):
            per_step = [o.outputs[k] for o in deltas[rid]]
            assert [t for d in per_step for t in d.token_ids] == c.token_ids
            assert [e for d in per_step for e in d.logprobs] == c.logprobs
            assert [len(d.token_ids) for d in per_step] == [1] * len(c.token_ids)
            assert per_step[-1].finish_reason == c.finish_reason == "length"
            assert per_step[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob)
        # cumulative outputs still hold every token so far
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(outs) + 1))
    aborted = run(delta, abort_after=4)["r1"]
    assert aborted[-1].finished and aborted[-1].outputs[0].finish_reason == "abort"
    tokens = [t for o in aborted[:-1] for t in o.outputs[0].token_ids]
    assert tokens == cumulative["r1"][-1].outputs[0].token_ids[:len(tokens)]
    assert len(tokens) == 4 and aborted[-1].outputs[0].token_ids == []  # nothing owed
    with pytest.raises(ValueError, match=r"SamplingParams\.output_kind"):
        SamplingParams(output_kind="delta")

