"""The engine's input boundary: sampling parameters, checkpoint files and model names.

Every value :class:`SamplingParams` accepts must sample without error (a bad row would fail
the whole batch), and every value a checkpoint's JSON files hold is checked on load, with an
error naming the file and the field.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.engine.llm import LLM
from kvlab.engine.params import MAX_SEED, MIN_TEMPERATURE, SamplingParams, is_int, is_real
from kvlab.engine.sampling import SamplerState, _filter, sample

VOCAB = 64


# ----------------------------------------------------------------------------- shared checks
def test_is_int_and_is_real():
    assert is_int(3) and is_int(-1) and is_int(2**100)
    assert not any(is_int(v) for v in (True, False, 3.0, "3", None))
    assert is_real(0) and is_real(1.5) and is_real(-2)
    assert not any(is_real(v) for v in (True, math.nan, math.inf, -math.inf, 10**400, "1", None))


# ----------------------------------------------------------------------------- sampling
def _states(params: list[SamplingParams]) -> list[SamplerState]:
    return [SamplerState.create(p, p.seed if p.seed is not None else 100 + i)
            for i, p in enumerate(params)]


NORMAL = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.2, top_k=5, seed=2),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(temperature=1.5, top_k=8, top_p=0.7, seed=4),
    SamplingParams(temperature=MIN_TEMPERATURE, seed=5),  # the smallest sampled temperature
    SamplingParams(temperature=1.0, top_k=2**70, seed=6),  # k beyond any vocabulary: keep all
]
TINY = [  # each must give the argmax
    SamplingParams(temperature=1e-39, seed=7),
    SamplingParams(temperature=1e-300, seed=8),
    SamplingParams(temperature=MIN_TEMPERATURE / 2, seed=9),
    SamplingParams(temperature=5e-324),
    SamplingParams(temperature=1.0, top_p=1e-46, seed=10),
    SamplingParams(temperature=1.0, top_p=1e-300, top_k=3, seed=11),
    SamplingParams(temperature=1e-39, top_p=1e-46, logprobs=2, seed=12),
]


def test_tiny_temperature_and_top_p_rows_take_the_argmax_without_disturbing_the_batch():
    gen = torch.Generator().manual_seed(0)
    batch_params = [p for pair in zip(NORMAL, TINY, strict=False) for p in pair]
    batch_params += TINY[len(NORMAL):]
    batch_states = _states(batch_params)
    alone_states = _states(batch_params)  # same seeds, used one row at a time
    for _ in range(20):  # several steps: the private generators advance identically
        logits = torch.randn(len(batch_params), VOCAB, generator=gen) * 4
        got = sample(logits, batch_states)
        for i, p in enumerate(batch_params):
            alone = sample(logits[i:i + 1], alone_states[i:i + 1])
            assert got.token_ids[i] == alone.token_ids[0], p
            assert got.logprobs[i] == alone.logprobs[0]
            if p in TINY:
                assert got.token_ids[i] == int(logits[i].argmax())
        assert got.top_logprobs[batch_params.index(TINY[-1])] is not None


def test_filter_leaves_rows_without_filters_untouched_by_other_rows():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.7), SamplingParams(top_p=0.5),
              SamplingParams(top_k=3)]
    together = _filter(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(together[i], _filter(logits[i:i + 1], [p])[0])


def test_top_p_keeps_the_most_likely_token_however_small():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    for top_p in (1e-46, 1e-300, 1e-9, 0.01):
        kept = _filter(logits, [SamplingParams(top_p=top_p)])[0]
        assert kept.isfinite().tolist() == [False, True, False, False]
    kept = _filter(logits, [SamplingParams(top_p=0.9)])[0]  # 0.64 + 0.24 < 0.9: three kept
    assert kept.isfinite().tolist() == [False, True, True, True]


def test_greedy_below_min_temperature():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=MIN_TEMPERATURE * 0.999).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    assert SamplerState.create(SamplingParams(temperature=1e-39), 0).generator is None


# ----------------------------------------------------------------------------- SamplingParams
BAD_PARAMS = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf),
     ("temperature", 10**400), ("temperature", True), ("temperature", "0.5"),
     ("temperature", -1e-39),
     ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0), ("top_p", -1e-46),
     ("top_p", 1.0000001), ("top_p", True), ("top_p", "0.5"),
     ("top_k", math.nan), ("top_k", math.inf), ("top_k", 5.0), ("top_k", True), ("top_k", -2),
     ("max_tokens", math.inf), ("max_tokens", True), ("max_tokens", 8.0), ("max_tokens", 0),
     ("n", math.nan), ("n", True), ("n", 2.0),
     ("logprobs", math.inf), ("logprobs", True), ("logprobs", 1.5),
     ("seed", 2**64), ("seed", -1), ("seed", True), ("seed", 1.5), ("seed", math.nan),
     ("stop_token_ids", 5), ("stop_token_ids", "ab"), ("stop_token_ids", b"ab"),
     ("stop_token_ids", {1: 2}), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]),
     ("stop_token_ids", iter(["a"])), ("stop_token_ids", [math.nan]),
     ("ignore_eos", 1), ("ignore_eos", "false")]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS,
                         ids=[f"{f}={v!r}"[:40] if isinstance(v, (int, float, str, bytes))
                              else f"{f}={type(v).__name__}" for f, v in BAD_PARAMS])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_sampling_params_edges_that_are_accepted():
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(seed=MAX_SEED).seed == 2**64 - 1
    p = SamplingParams(temperature=2, top_p=1)
    assert p.temperature == 2.0 and isinstance(p.temperature, float)
    assert isinstance(p.top_p, float) and not p.uses_top_p
    assert SamplingParams(top_p=1e-46).uses_top_p
    assert SamplingParams(temperature=1e300).temperature == 1e300


@pytest.mark.parametrize(
    ("stops", "expected"),
    [(iter([5]), (5,)), ((t for t in (1, 2)), (1, 2)), (range(3), (0, 1, 2)),
     ({7}, (7,)), ([3, 4], (3, 4)), ((), ())],
)
def test_stop_token_ids_iterables_are_materialised(stops, expected):
    assert SamplingParams(stop_token_ids=stops).stop_token_ids == expected


def test_huge_temperature_samples():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1e300, seed=0)
    assert 0 <= sample(logits, _states([p])).token_ids[0] < VOCAB


# ----------------------------------------------------------------------------- seeds
def test_sampler_seed_is_reduced_modulo_2_64():
    p = SamplingParams(temperature=1.0)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    for seed, same in ((2**64 + 5, 5), (2**64 - 1 + 3, 2), (-1, 2**64 - 1), (2**200, 0)):
        a, b = SamplerState.create(p, seed), SamplerState.create(p, same)
        assert [sample(logits, [a]).token_ids for _ in range(8)] == \
               [sample(logits, [b]).token_ids for _ in range(8)]
    with pytest.raises(TypeError, match="seed"):
        SamplerState.create(p, 1.5)


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("kvlab-tiny", block_size=4, num_blocks=64, max_num_seqs=8)


def test_largest_seed_with_n_samples(tiny_llm):
    """Sample i of a request seeded s uses seed (s + i) mod 2**64, even past the top."""
    prompt = [0, 5, 6, 7]
    base = MAX_SEED - 1
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=base, n=4, ignore_eos=True)
    (out,) = tiny_llm.generate([prompt], params)
    assert len(out.outputs) == 4
    for c in out.outputs:
        alone = SamplingParams(max_tokens=6, temperature=1.0, seed=(base + c.index) % 2**64,
                               ignore_eos=True)
        assert c.token_ids == tiny_llm.generate([prompt], alone)[0].outputs[0].token_ids
