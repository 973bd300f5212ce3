"""``SamplingParams.min_p``: vLLM's min-p filter in kvlab's sampler.

vLLM 0.32 (``vllm/v1/sample/logits_processor/builtin.py``, ``MinPLogitsProcessor.apply``;
the order in ``vllm/v1/sample/sampler.py``, ``Sampler.sample``): after temperature and before
top-k/top-p, a token whose probability under the temperature-scaled distribution is below
``min_p`` times the most likely token's is set to -inf; greedy rows ignore it
(``SamplingParams.__post_init__`` in ``vllm/sampling_params.py`` zeroes it).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab import LLM
from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.sampler import SamplerState, filter_logits, sample


def _reference(logits: list[float], p: SamplingParams) -> list[float]:
    """The filtered, temperature-scaled logits in float64 Python, straight from vLLM's
    description: min-p on softmax(logits / T), then top-k, then top-p (kvlab's top-p rule:
    drop a token once the mass strictly before it reaches top_p, keep the most likely)."""
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    z = sum(math.exp(x - top) for x in scaled)
    probs = [math.exp(x - top) / z for x in scaled]
    keep = [q >= p.min_p * max(probs) for q in probs]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if p.top_k > 0:
        for rank, i in enumerate(order):
            keep[i] = keep[i] and rank < p.top_k
    if p.top_p < 1.0:
        kept = [i for i in order if keep[i]]
        mass = sum(math.exp(scaled[i] - top) for i in kept)
        before = 0.0
        for j, i in enumerate(kept):
            if j and before >= p.top_p:
                keep[i] = False
            before += math.exp(scaled[i] - top) / mass
    return [x if k else -math.inf for x, k in zip(scaled, keep, strict=True)]


def _logits(seed: int, vocab: int = 48) -> torch.Tensor:
    """Distinct, well-separated logits: no token's probability lies within 1e-4 (relative) of
    a min-p threshold used below, so float32 and float64 agree on every kept set."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g).to(torch.float32) * 0.173 - 4.0


PARAMS = [SamplingParams(temperature=1.0, min_p=0.05),
          SamplingParams(temperature=0.7, min_p=0.2),
          SamplingParams(temperature=1.5, min_p=0.01, top_k=12),
          SamplingParams(temperature=1.0, min_p=0.1, top_p=0.8),
          SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.9, top_p=0.9)]


@pytest.mark.parametrize("seed", range(4))
def test_min_p_equals_a_float64_reference(seed):
    logits = torch.stack([_logits(seed * 10 + i) for i in range(len(PARAMS))])
    got = filter_logits(logits, PARAMS)
    for row, p in enumerate(PARAMS):
        want = _reference(logits[row].tolist(), p)
        probs = torch.tensor(logits[row].tolist(), dtype=torch.float64).div(p.temperature)
        probs = probs.softmax(-1)
        if p.uses_min_p:   # the data keeps every token away from the threshold
            margin = (probs / (p.min_p * probs.max()) - 1).abs().min().item()
            assert margin > 1e-4, (seed, row, margin)
        for j, w in enumerate(want):
            if w == -math.inf:
                assert got[row, j].item() == -math.inf, (seed, row, j)
            else:
                assert got[row, j].item() == pytest.approx(w, rel=1e-6), (seed, row, j)
        assert any(w == -math.inf for w in want) == (p.uses_min_p or p.uses_top_k
                                                     or p.uses_top_p)


def test_a_row_without_min_p_is_unaffected_by_a_row_with_it():
    logits = torch.stack([_logits(1), _logits(2), _logits(3)])
    plain = SamplingParams(temperature=0.8, top_k=7)
    mixed = filter_logits(logits, [SamplingParams(temperature=1.0, min_p=0.3), plain,
                                   SamplingParams(temperature=1.0)])
    assert torch.equal(mixed[1], filter_logits(logits[1:2], [plain])[0])
    assert torch.equal(mixed[2], logits[2])          # no filter: only divided by T = 1


def test_min_p_zero_is_off_and_min_p_one_keeps_the_most_likely_token():
    logits = torch.stack([_logits(5)])
    assert torch.equal(filter_logits(logits, [SamplingParams(temperature=0.5, min_p=0.0)]),
                       filter_logits(logits, [SamplingParams(temperature=0.5)]))
    one = filter_logits(logits, [SamplingParams(temperature=2.0, min_p=1.0)])[0]
    assert torch.isfinite(one).nonzero().flatten().tolist() == [int(logits[0].argmax())]


def test_sampled_tokens_stay_above_the_threshold_and_greedy_ignores_min_p():
    logits = _logits(7)[None].expand(32, -1).contiguous()
    p = SamplingParams(temperature=1.0, min_p=0.25, seed=0)
    probs = logits[0].softmax(-1)
    allowed = set((probs >= 0.25 * probs.max()).nonzero().flatten().tolist())
    states = [SamplerState.create(p, i) for i in range(32)]
    drawn = set()
    for _ in range(20):
        drawn.update(sample(logits, states).token_ids)
    assert drawn <= allowed and len(drawn) > 1
    greedy = SamplingParams(temperature=0.0, min_p=0.9)
    assert sample(logits[:1], [SamplerState.create(greedy, 0)]).token_ids \
        == [int(logits[0].argmax())]


@pytest.mark.parametrize("bad", [-0.01, 1.01, float("nan"), True, "0.1", None])
def test_bad_min_p_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"SamplingParams\.min_p"):
        SamplingParams(min_p=bad)


def test_engine_min_p_one_samples_the_greedy_text():
    """End to end: at min_p = 1 only the most likely token survives, so a seeded sample at
    temperature 1 is the greedy continuation."""
    llm = LLM("kvlab-tiny")
    prompt = "The lamplighter of Vale"
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    sampled = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                    min_p=1.0))[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=3))[0]
    assert sampled.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert free.outputs[0].token_ids != greedy.outputs[0].token_ids   # the filter did the work
