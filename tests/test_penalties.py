"""Presence, frequency and repetition penalties and ``min_tokens``: the formulas on a worked
example, the parameters' checks, and greedy decoding against Hugging Face transformers on the
same random weights (its own logits processors, or its logits with the OpenAI formula applied
by hand), so that nothing here is checked against kvlab itself."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.sampler import SamplerState, penalize, sample


def test_penalize_on_a_worked_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25, min_tokens=4, temperature=0)
    state = SamplerState.create(params, 0, prompt_ids=(0, 1), stop_ids=(4,))
    state.output_ids.extend([3, 3, 2])
    got = penalize(logits, [state])
    # repetition over prompt and output {0, 1, 2, 3}: positive / 2, negative * 2; then token 3
    # (twice in the output) and 2 (once) lose 0.5 per occurrence and 0.25 once; 4 is masked
    # (3 < min_tokens tokens so far); 5 was never seen
    assert got.tolist() == [[1.0, -2.0, -0.5, 0.25, -math.inf, 1.0]]
    assert logits[0, 0] == 2.0                       # the caller's logits are untouched
    state.output_ids.append(5)                       # the 4th token: the mask lifts
    assert penalize(logits, [state])[0, 4] == -2.0


def test_unpenalized_rows_are_untouched_and_keep_no_history():
    plain = SamplerState.create(SamplingParams(temperature=0), 0, prompt_ids=(1, 2))
    logits = torch.randn(1, 8)
    assert penalize(logits, [plain]) is logits
    sample(logits, [plain])
    assert plain.output_ids == [] and plain.prompt_ids == ()


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", math.nan),
    ("repetition_penalty", 0), ("repetition_penalty", math.inf), ("repetition_penalty", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0)])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(max_tokens=16, **{field: value})


def test_speculative_engines_refuse_penalties():
    from kvlab.engine.llm import LLM

    llm = LLM("kvlab-tiny", num_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        llm.generate(["The town of"], SamplingParams(frequency_penalty=0.5), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from kvlab.engine.llm import LLM
    from kvlab.labs.parity.hf import save_random_hf_model

    path = save_random_hf_model(tmp_path_factory.mktemp("pen") / "m", "llama", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return LLM(path, block_size=4), hf


def _prompts(n: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (t,), generator=gen).tolist() for t in (3, 9, 17, 30)[:n]]


def test_frequency_and_presence_penalties_match_openais_formula_on_hf_logits(hf_pair):
    """Greedy: kvlab's tokens equal the argmax of HF's logits minus ``frequency * count +
    presence * [count > 0]`` over the tokens generated so far (OpenAI's definition)."""
    llm, hf = hf_pair
    freq, pres, steps = 0.7, 0.4, 14
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                            frequency_penalty=freq, presence_penalty=pres)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    plain = llm.generate(_prompts(), SamplingParams(max_tokens=steps, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
    changed = 0
    for prompt, out, base in zip(_prompts(), outs, plain, strict=True):
        ids, counts = list(prompt), torch.zeros(128)
        for _ in range(steps):
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0, -1].float()
            token = int((logits - freq * counts - pres * (counts > 0)).argmax())
            ids.append(token)
            counts[token] += 1
        assert out.outputs[0].token_ids == ids[len(prompt):]
        changed += out.outputs[0].token_ids != base.outputs[0].token_ids
    assert changed >= 2          # the penalties really changed the greedy choice


def test_repetition_penalty_and_min_tokens_match_hf_generate(hf_pair):
    """HF's RepetitionPenaltyLogitsProcessor (prompt and output) and MinNewTokensLength
    processor, through ``generate``; the stop token is one that plain greedy emits early, so
    ``min_tokens`` has something to hold back."""
    llm, hf = hf_pair
    checked = 0
    for prompt in _prompts():
        base = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
        stop = base[0].outputs[0].token_ids[1]   # plain greedy emits it second
        params = SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.6,
                                min_tokens=6, stop_token_ids=[stop])
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                              min_new_tokens=6, repetition_penalty=1.6, eos_token_id=stop,
                              pad_token_id=stop)[0, len(prompt):].tolist()
        if stop in ref:
            ref = ref[:ref.index(stop) + 1]      # HF pads after its eos; kvlab stops there
        assert got.token_ids == ref
        assert stop not in got.token_ids[:6] and len(got.token_ids) >= 6
        checked += 1
    assert checked == 4
