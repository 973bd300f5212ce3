"""Schedulers on the real engine: preemption by recompute does not change any output.

Greedy and seeded sampling; a KV pool small enough to force preemptions against one large
enough to need none. Skipped until the engine (kvlab.engine.llm_engine) is importable.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("kvlab.engine.llm_engine")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvlab.core.baseline_scheduler import BaselineScheduler  # noqa: E402
from kvlab.core.production_scheduler import ProductionScheduler  # noqa: E402
from kvlab.core.sampling_params import SamplingParams  # noqa: E402
from kvlab.engine.llm import LLM  # noqa: E402
from kvlab.labs.invariants import check_scheduler  # noqa: E402
from kvlab.labs.parity.hf import save_random_hf_model  # noqa: E402

VOCAB = 128
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_hf_model(tmp_path_factory.mktemp("sched") / "llama", "llama", seed=5)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    out = [shared + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (2, 7, 13)]
    out += [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    return out


def baseline(kv, cfg):
    return BaselineScheduler(kv, cfg)


def production_watermark(kv, cfg):
    return ProductionScheduler(kv, dataclasses.replace(cfg, admission="watermark"))


def production_reserve(kv, cfg):
    return ProductionScheduler(kv, cfg)


def generate(model_dir, prompts, params, factory, num_blocks):
    llm = LLM(model_dir, block_size=4, num_blocks=num_blocks, max_num_seqs=6,
              max_num_batched_tokens=16, max_prefill_chunk=8, scheduler=factory)
    outs = llm.generate(prompts, params)
    sched = llm.engine.scheduler
    preemptions = sum(o.metrics.num_preemptions for o in outs)
    check_scheduler(sched)
    assert not llm.engine.kv.requests()
    assert not sched.requests()   # every reported request was forgotten
    return [[c.token_ids for c in o.outputs] for o in outs], preemptions


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("factory", [baseline, production_watermark], ids=["baseline", "prod"])
def test_preemption_does_not_change_outputs(model_dir, prompts, params, factory):
    roomy, none = generate(model_dir, prompts, params, factory, num_blocks=200)
    tight, some = generate(model_dir, prompts, params, factory, num_blocks=10)
    assert none == 0 and some > 0
    assert tight == roomy


def test_reserve_admission_matches_and_never_preempts(model_dir, prompts):
    roomy, _ = generate(model_dir, prompts, GREEDY, baseline, num_blocks=200)
    tight, preemptions = generate(model_dir, prompts, GREEDY, production_reserve, num_blocks=10)
    assert preemptions == 0 and tight == roomy


def test_parallel_samples_fork_and_match(model_dir, prompts):
    params = dataclasses.replace(SAMPLED, n=3)
    roomy, _ = generate(model_dir, prompts[:3], params, baseline, num_blocks=200)
    tight, _ = generate(model_dir, prompts[:3], params, production_watermark, num_blocks=24)
    assert tight == roomy and all(len(o) == 3 for o in roomy)
