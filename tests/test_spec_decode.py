"""Speculative decoding: exactness, greedy identity, rollback, configuration, metrics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.llm import LLM
from kvlab.engine.spec_decode import SpeculativeConfig, ngram_lookup, verify
from kvlab.engine.spec_decode import verifier as verifier_module
from kvlab.engine.spec_decode.rng import TARGET, position_generator
from kvlab.labs.invariants import check_engine
from kvlab.labs.kv_snapshot import snapshot_of
from kvlab.labs.speculation.exactness import chi_square_test, power_against_tv
from kvlab.reference import speculative_step

DRAFT = {"method": "draft_model", "model": "kvlab-tiny-draft"}
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny ops on a shared 2-core machine: threads only add waiting
    yield
    torch.set_num_threads(old)


def _llm(spec=None, k=4, **kw):
    kw.setdefault("num_blocks", 512)
    kw.setdefault("max_num_seqs", 32)
    cfg = None if spec is None else {**spec, "num_speculative_tokens": k}
    return LLM("kvlab-tiny", speculative_config=cfg, **kw)


PROMPTS = ["The town of", "Once upon a time, the river", "Question: where does",
           "The town of Harrow is", "The town of Harrow has a", "In the Vale, the people",
           "A storm came to", "Her friend said that the", "The festival of lanterns",
           "The town of Harrow is known for"]


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("bad, msg", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({**DRAFT, "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({**DRAFT, "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({**DRAFT, "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({**NGRAM, "num_speculative_tokens": 2, "model": "x"}, "unknown keys"),
    ({**NGRAM, "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({**NGRAM, "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
])
def test_bad_speculative_config_is_refused_at_the_boundary(bad, msg):
    with pytest.raises(ValueError, match=msg):
        LLM("kvlab-tiny", num_blocks=64, speculative_config=bad)
    with pytest.raises(TypeError, match="speculative_config"):
        SpeculativeConfig.from_user(["ngram"])


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    import shutil

    from kvlab.models import shipped_model_path
    src = shipped_model_path("kvlab-tiny-draft")
    dst = tmp_path / "draft"
    shutil.copytree(src, dst)
    tok = (dst / "tokenizer.json").read_text()
    (dst / "tokenizer.json").write_text(tok.replace('"<|eos|>"', '"<|end|>"', 1))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM("kvlab-tiny", num_blocks=64,
            speculative_config={**DRAFT, "model": str(dst), "num_speculative_tokens": 2})


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 4, 1, 2], 3, 1, 3) == (3, 4, 1)
    assert ngram_lookup([5, 1, 9, 1, 2, 7, 1], 2, 1, 1) == (2, 7)      # latest occurrence
    assert ngram_lookup([1, 2, 3], 2, 1, 3) == ()
    assert ngram_lookup([4, 4], 5, 1, 1) == (4,)


# --------------------------------------------------------------------------- the verifier
def _random_case(gen, vocab, k, point_mass):
    p = torch.rand(k + 1, vocab, generator=gen, dtype=torch.float64) ** 3
    p /= p.sum(-1, keepdim=True)
    if point_mass:
        drafts = torch.randint(0, vocab, (k,), generator=gen).tolist()
        return p, None, drafts
    q = torch.rand(k, vocab, generator=gen, dtype=torch.float64) ** 3
    q /= q.sum(-1, keepdim=True)
    drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
    return p, q, drafts


@pytest.mark.parametrize("point_mass", [False, True])
def test_verifier_equals_reference_step_by_step(point_mass):
    """The batched verifier = ``speculative_step`` applied position by position (float64),
    with position i's stream given to both."""
    gen = torch.Generator().manual_seed(11)
    rejections = 0
    for trial in range(300):
        k = 1 + trial % 8
        p, q, drafts = _random_case(gen, 7 + trial % 5, k, point_mass)
        got = verify(p, drafts, q, lambda j, t=trial: position_generator(t, j, TARGET))
        want: list[int] = []
        for i in range(k):
            qi = q[i] if q is not None else torch.nn.functional.one_hot(
                torch.tensor(drafts[i]), p.shape[1]).double()
            token, accepted = speculative_step(p[i], qi, drafts[i],
                                               generator=position_generator(trial, i, TARGET))
            want.append(token)
            if not accepted:
                rejections += 1
                break
        else:
            want.append(int(torch.multinomial(p[k], 1,
                                              generator=position_generator(trial, k, TARGET))))
        assert got.tokens == tuple(want), trial
        assert got.num_accepted == len(want) - 1
    assert rejections > 100     # both branches exercised


def test_one_position_is_exactly_p():
    """Σ over outcomes: q(x)·min(1, p/q) + P(reject)·residual(x) equals p(x) (the derivation
    of chapter 9, checked numerically), and the sampler's frequencies pass a χ² test."""
    gen = torch.Generator().manual_seed(3)
    p, q, _ = _random_case(gen, 6, 1, False)
    p0, q0 = p[0], q[0]
    accept = torch.minimum(p0, q0)
    residual = (p0 - q0).clamp_min(0)
    total = accept + (1 - accept.sum()) * residual / residual.sum()
    assert torch.allclose(total, p0, atol=1e-12)
    counts = [0] * 6
    n = 6000
    for s in range(n):
        draft = int(torch.multinomial(q0, 1, generator=position_generator(s, 0, 1)))
        got = verify(p[:1].repeat(2, 1), [draft], q[:1],
                     lambda j, s=s: position_generator(s, j, TARGET))
        counts[got.tokens[0]] += 1
    stat, df, pval = chi_square_test(dict(enumerate(counts)), dict(enumerate(p0.tolist())))
    assert pval > 1e-3, (stat, df, pval)


# --------------------------------------------------------------------------- greedy identity
@pytest.fixture(scope="module")
def greedy_reference():
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in _llm().generate(PROMPTS, sp, use_tqdm=False)]


@pytest.mark.parametrize("spec", [DRAFT, NGRAM], ids=["draft", "ngram"])
def test_greedy_identity_for_every_k(spec, greedy_reference):
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    for k in range(1, 9):
        llm = _llm(spec, k)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        assert got == greedy_reference, k
        m = {x.name.removeprefix("vllm:"): x for x in llm.get_metrics()}  # vLLM's shape
        assert m["spec_decode_num_draft_tokens"].value >= m["spec_decode_num_accepted_tokens"].value
        per_pos = m["spec_decode_num_accepted_tokens_per_pos"].values
        assert len(per_pos) == k
        assert all(a >= b for a, b in itertools.pairwise(per_pos))
        assert sum(per_pos) == m["spec_decode_num_accepted_tokens"].value
        check_engine(llm.engine)
        snap = snapshot_of(llm.engine.kv)
        assert snap.free_blocks + snap.evictable_blocks \
            == llm.engine.num_blocks
    if spec is DRAFT:
        assert m["spec_decode_num_accepted_tokens"].value > 0


@pytest.mark.parametrize("spec", [DRAFT, NGRAM], ids=["draft", "ngram"])
def test_greedy_identity_with_preemption_n_and_prefix_cache(spec):
    """A pool too small for the batch (recompute preemption), n = 2 samples, shared prefixes."""
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=2)
    kw = dict(num_blocks=40, block_size=4, max_num_seqs=8)
    system = "The Vale has six regions and twelve rivers. Answer briefly. "
    prompts = [system + p for p in PROMPTS[:6]]
    base = _llm(**kw)
    want = [[c.token_ids for c in o.outputs] for o in base.generate(prompts, sp,
                                                                      use_tqdm=False)]
    for k in range(1, 9):
        llm = _llm(spec, k, **kw)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == want, k
        assert sum(o.metrics.num_preemptions for o in outs) > 0, k
        assert llm.engine.stats.cached_prompt_tokens > 0, k
        check_engine(llm.engine)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    alone = _llm(DRAFT, 3).generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    crowd = _llm(DRAFT, 3).generate(PROMPTS, [sp] + [SamplingParams(max_tokens=30)] * 9,
                                    use_tqdm=False)[0].outputs[0].token_ids
    assert alone == crowd


def test_logprobs_and_stop_tokens_with_speculation():
    """Accepted drafts after a stop token are cut; logprobs cover exactly the tokens kept."""
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = _llm().generate(PROMPTS[:3], sp, use_tqdm=False)
    for o in ref:
        toks = o.outputs[0].token_ids
        stop = toks[len(toks) // 2]
        sp2 = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                             stop_token_ids=[stop], logprobs=2)
        got = _llm(DRAFT, 6).generate([o.prompt], sp2, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == toks[:toks.index(stop) + 1]
        assert got.finish_reason == "stop"
        assert len(got.logprobs) == len(got.token_ids)
        assert math.isclose(got.cumulative_logprob,
                            sum(d[t] for d, t in zip(got.logprobs, got.token_ids, strict=True)))


# --------------------------------------------------------------------------- exactness
def _exact_joint_23(prompt: str, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(token 2, token 3) under the target with ``params`` (temperature 1), enumerated from
    the raw log-probabilities of a non-speculative engine."""
    llm = _llm()
    ids = llm.engine.encode_prompt(prompt)[1]

    def dist(prefix):
        probe = SamplingParams(max_tokens=1, temperature=0, logprobs=64, ignore_eos=True)
        raw = llm.generate([list(prefix)], probe, use_tqdm=False)[0].outputs[0].logprobs[0]
        ranked = sorted(((math.exp(v), t) for t, v in raw.items()), reverse=True)
        if params.top_k > 0:
            ranked = ranked[:params.top_k]
        total = sum(pr for pr, _ in ranked)
        ranked = [(pr / total, t) for pr, t in ranked]
        kept, before = [], 0.0
        for pr, t in ranked:
            if kept and before >= params.top_p:
                break
            kept.append((pr, t))
            before += pr
        assert len(kept) < 64, "top-p set larger than the logprobs window"
        z = sum(pr for pr, _ in kept)
        return [(pr / z, t) for pr, t in kept]

    joint: dict[tuple[int, int], float] = {}
    for p1, t1 in dist(ids):
        for p2, t2 in dist((*ids, t1)):
            for p3, t3 in dist((*ids, t1, t2)):
                joint[(t2, t3)] = joint.get((t2, t3), 0.0) + p1 * p2 * p3
    return joint


def _sample_joint_23(llm, prompt, params, n):
    counts: dict[tuple[int, int], int] = {}
    per = 256
    sps = [SamplingParams(max_tokens=3, temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, ignore_eos=True, n=per, seed=7919 * i)
           for i in range(n // per)]
    for out in llm.generate([prompt] * len(sps), sps, use_tqdm=False):
        for c in out.outputs:
            key = tuple(c.token_ids[1:3])
            counts[key] = counts.get(key, 0) + 1
    return counts


N_SAMPLES = 3072
ALPHA = 1e-3


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=3),
                                    SamplingParams(temperature=1.0, top_p=0.6)],
                         ids=["top_k=3", "top_p=0.6"])
def test_tokens_2_3_are_distributed_exactly_as_without_speculation(params, monkeypatch):
    """χ² of the joint (token 2, token 3) sampled with a draft model (k = 2) against the exact
    target distribution. Power: against the least favourable 5 % total-variation error the
    test (N = 3072, α = 1e-3) rejects in >= 80 % of simulated samples (asserted below); a
    real bug injected into the verifier (resampling from p instead of the residual) is
    rejected too (top-k case; under top-p 0.6 almost every draft is accepted)."""
    prompt = "The town of"
    exact = _exact_joint_23(prompt, params)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-9)
    llm = _llm(DRAFT, 2, max_num_seqs=256, num_blocks=2048, max_num_batched_tokens=4096)
    counts = _sample_joint_23(llm, prompt, params, N_SAMPLES)
    drafts = [m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts"]
    assert drafts[0] > 0
    _, _, pval = chi_square_test(counts, exact)
    assert pval > ALPHA, pval
    keys = list(exact)
    power = power_against_tv([exact[k] for k in keys], N_SAMPLES, 0.05, ALPHA, trials=200)
    assert power >= 0.8, power
    if params.top_k != 3:
        return   # top-p 0.6 leaves ~2 tokens per position: the bug below barely shows there

    def biased_verify(p, drafts, q, generators):   # the classic bug: no residual
        got = real_verify(p, drafts, q, generators)
        if got.rejected is None:
            return got
        i = got.num_accepted
        token = int(torch.multinomial(p[i], 1, generator=generators(i)))
        return verifier_module.Verdict((*got.tokens[:-1], token), i, got.rejected)

    from kvlab.engine.spec_decode import executor as executor_module
    real_verify = executor_module.verify
    monkeypatch.setattr(executor_module, "verify", biased_verify)
    bad = _sample_joint_23(_llm(DRAFT, 2, max_num_seqs=256, num_blocks=2048,
                                max_num_batched_tokens=4096), prompt, params, N_SAMPLES)
    assert chi_square_test(bad, exact)[2] < ALPHA


# --------------------------------------------------------------------------- rollback
def _kv_view(engine, rid):
    kv = engine.kv
    snap = snapshot_of(kv)
    request = engine.scheduler.find_request(rid)
    table = len(kv.block_table(rid)) if request is not None and kv.has(rid) else None
    computed = request.num_computed_tokens if request is not None else None
    return (table, computed, snap.cached_blocks, snap.cached_tokens, snap.free_blocks,
            snap.evictable_blocks, tuple(sorted(snap.refcounts)))


@pytest.mark.parametrize("spec", [DRAFT, NGRAM], ids=["draft", "ngram"])
def test_rollback_matches_a_plain_engine_after_every_step(spec):
    """Stateful: after every speculative step, the block table length, computed tokens,
    prefix-cache contents, free/evictable blocks and refcounts equal those of a plain engine
    that generated the same tokens (greedy, so the tokens agree). Requests run one after
    the other on the same two engines, so the cache carries earlier requests' blocks."""
    kw = dict(num_blocks=64, block_size=4, max_num_seqs=4)
    fast, slow = _llm(spec, 5, **kw).engine, _llm(**kw).engine
    sp = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    steps = 0
    for i, prompt in enumerate(PROMPTS[:5]):
        rid = f"r{i}"
        fast.add_request(rid, prompt, sp)
        slow.add_request(rid, prompt, sp)
        done_fast = done_slow = False
        while not done_fast:
            for out in fast.step():
                done_fast = out.finished
            request = fast.scheduler.find_request(rid)
            n_fast = len(request.output_token_ids) if request is not None else sp.max_tokens
            n_slow = -1
            while n_slow < n_fast and not done_slow:
                for out in slow.step():
                    done_slow = out.finished
                r2 = slow.scheduler.find_request(rid)
                n_slow = len(r2.output_token_ids) if r2 is not None else sp.max_tokens
            assert n_slow == n_fast
            assert _kv_view(fast, rid) == _kv_view(slow, rid), (i, n_fast)
            check_engine(fast)
            steps += 1
        assert done_slow
    assert steps < 5 * sp.max_tokens     # speculation did save steps
    if spec is DRAFT:
        assert fast.speculator.metrics.num_accepted_tokens > 0


def test_lookahead_is_skipped_not_preempting_when_blocks_are_short():
    """With a pool that fits the batch but not the lookahead, nobody is preempted for it."""
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(num_blocks=12, block_size=4, max_num_seqs=4, scheduler="production")
    base = _llm(**kw).generate(PROMPTS[:4], sp, use_tqdm=False)
    llm = _llm(DRAFT, 8, **kw)
    outs = llm.generate(PROMPTS[:4], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert sum(o.metrics.num_preemptions for o in outs) == sum(
        o.metrics.num_preemptions for o in base)


def test_abort_mid_run_releases_lookahead_blocks():
    llm = _llm(DRAFT, 4, num_blocks=64, block_size=4)
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.8, seed=1))
    for _ in range(4):
        eng.step()
    eng.abort_request("a")
    eng.abort_request("b")
    while eng.has_unfinished_requests():
        eng.step()
    check_engine(eng)
    snap = snapshot_of(eng.kv)
    assert snap.free_blocks + snap.evictable_blocks == eng.num_blocks
    assert not snap.tables


# --------------------------------------------------------------------------- grammar
GRAMMARS = [{"regex": r"(red|green|blue)( (red|green|blue)){0,5}\."},
            {"regex": r"\(\d{3}\) \d{3}-\d{4}"},
            {"choice": ["yes", "no", "not sure"]},
            {"json": {"type": "object", "properties": {"age": {"type": "integer",
                                                               "minimum": 0, "maximum": 99}},
                      "required": ["age"]}}]


@pytest.mark.parametrize("spec", [DRAFT, NGRAM], ids=["draft", "ngram"])
def test_grammar_greedy_identity_and_state_rollback(spec):
    """Draft and target rows get the same grammar mask; greedy constrained output equals the
    plain engine's; after every step each grammar state has accepted exactly the request's
    output tokens (``check_invariants`` compares them), so rejected drafts were rolled back."""
    pytest.importorskip("xgrammar")
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=g)
              for g in GRAMMARS]
    prompts = ["Colours: red green blue red green blue red green blue red green", *PROMPTS[1:4]]
    want = [o.outputs[0].token_ids for o in _llm().generate(prompts, params, use_tqdm=False)]
    eng = _llm(spec, 4).engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"g{i}", p, sp)
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        check_engine(eng)
    assert [got[f"g{i}"] for i in range(len(params))] == want
    assert eng.speculator.metrics.num_draft_tokens > 0


def test_grammar_sampled_outputs_stay_in_language_with_speculation():
    pytest.importorskip("xgrammar")
    regex = pytest.importorskip("regex")
    g = GRAMMARS[0]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=g)
              for s in range(12)]
    llm = _llm(DRAFT, 3)
    for out in llm.generate([PROMPTS[0]] * 12, params, use_tqdm=False):
        assert regex.fullmatch(g["regex"], out.outputs[0].text), out.outputs[0].text
    check_engine(llm.engine)


def test_abort_during_the_step_is_applied_after_verification():
    """An abort that arrives while the step executes (here: from inside the proposer) takes
    effect when the step ends; the lookahead blocks and the rest are released exactly once."""
    eng = _llm(DRAFT, 4, num_blocks=64, block_size=4).engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=30, temperature=0))
    eng.step()
    proposer = eng.executor.proposer
    real = proposer.propose
    calls = []

    def propose(chunks, rows, tables):
        if not calls:
            calls.append(eng.abort_request("a"))   # lands mid-step
        return real(chunks, rows, tables)

    proposer.propose = propose
    eng.step()
    assert calls and calls[0].outputs[0].finish_reason == "abort"
    assert not eng.kv.has("a") and eng.kv.has("b")
    while eng.has_unfinished_requests():
        eng.step()
    check_engine(eng)
    snap = snapshot_of(eng.kv)
    assert snap.free_blocks + snap.evictable_blocks == eng.num_blocks


def test_kv_budget_pays_for_the_draft_cache():
    """Sized from a byte budget, the pool holds fewer blocks when each block also stores the
    draft's KV (n-gram has no second cache)."""
    budget = 8 * 2**20
    plain = LLM("kvlab-tiny", kv_cache_memory=budget).engine
    draft = _llm(DRAFT, 2, num_blocks=None, kv_cache_memory=budget).engine
    ngram = _llm(NGRAM, 2, num_blocks=None, kv_cache_memory=budget).engine
    t = plain.config.kv_bytes_per_token(4)
    d = draft.speculator.draft.config.kv_bytes_per_token(4)
    assert ngram.num_blocks == plain.num_blocks
    assert draft.num_blocks == budget // ((t + d) * draft.block_size)
    assert draft.executor.proposer.cache.num_blocks == draft.num_blocks


def test_the_draft_writes_the_kv_of_every_chunk_the_target_runs():
    """The draft reads its own cache for every position before the one it drafts from, so it
    must write the KV of every chunk the target runs, prefills included: after a prompt's
    prefill step the draft's cache holds the prompt, and the same greedy requests draft the
    same on a fresh engine and on one that served them before."""
    from kvlab.labs.speculation.acceptance import run_acceptance

    eng = _llm(DRAFT, 4).engine
    eng.add_request("a", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0))
    eng.step()                                   # the prefill step: no chunk has lookahead
    n = eng.scheduler.find_request("a").num_computed_tokens
    table, bs = eng.kv.block_table("a"), eng.block_size
    draft_kv = eng.executor.proposer.cache.data
    unwritten = [t for t in range(n) if not bool(draft_kv[0, 0, table[t // bs], t % bs].any())]
    assert unwritten == []
    own: dict = {}
    first = run_acceptance("draft_model", k=4, temperature=0.0, engines=own)
    again = run_acceptance("draft_model", k=4, temperature=0.0, engines=own)
    assert (again.per_pos, again.mean_length) == (first.per_pos, first.mean_length)
