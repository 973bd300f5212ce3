"""SamplingParams(prompt_logprobs=k): every prompt token after the first scored as a dense HF
forward scores it, through chunked prefill, prefix hits, n > 1 and mixed batches."""

from __future__ import annotations

import pytest
import torch

from kvlab.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from kvlab.labs.parity.hf import save_random_hf_model

    path = save_random_hf_model(tmp_path_factory.mktemp("plp") / "m", "llama", seed=4)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (t,), generator=gen).tolist() for t in (2, 9, 23, 37)]


def _reference(hf, prompt: list[int], k: int) -> list[dict[int, float] | None]:
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    out: list[dict[int, float] | None] = [None]
    for j in range(1, len(prompt)):
        values, ids = lp[j - 1].topk(k)
        d = dict(zip(ids.tolist(), values.tolist(), strict=True))
        d[prompt[j]] = float(lp[j - 1, prompt[j]])
        out.append(d)
    return out


def _check(got, want) -> None:
    assert got is not None and len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert list(g) == list(w)       # the same ids, in rank order, prompt token last
        for t in w:
            assert abs(g[t] - w[t]) < 1e-5, (t, g[t], w[t])


@pytest.mark.parametrize("engine_kw", [
    {"block_size": 4},
    {"block_size": 4, "max_num_batched_tokens": 8},
])
def test_prompt_logprobs_equal_a_dense_forward(hf_pair, engine_kw):
    from kvlab.engine.llm import LLM

    path, hf = hf_pair
    llm = LLM(path, **engine_kw)     # 8 batched tokens: the 23- and 37-token prompts chunk
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    for prompt, out in zip(_prompts(), outs, strict=True):
        _check(out.prompt_logprobs, _reference(hf, prompt, 3))


def test_prefix_hit_n_and_a_plain_request_in_the_same_batch(hf_pair):
    """A second run of the same prompts hits the prefix cache and is still scored in full;
    n=3 gets one list; a request without prompt_logprobs beside them is unchanged."""
    from kvlab.engine.llm import LLM

    path, hf = hf_pair
    llm = LLM(path, block_size=4)
    prompts = _prompts()
    plain = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    alone = llm.generate([prompts[3]], plain, use_tqdm=False)[0]
    scored = SamplingParams(max_tokens=4, temperature=0.8, seed=2, n=3, ignore_eos=True,
                            prompt_logprobs=0)
    first = llm.generate(prompts[:3], scored, use_tqdm=False)
    again = llm.generate([*prompts[:3], prompts[3]], [scored] * 3 + [plain], use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again[1:3])    # the hits really happened
    for prompt, a, b in zip(prompts[:3], first, again[:3], strict=True):
        ref = _reference(hf, prompt, 0)
        _check(a.prompt_logprobs, ref)
        _check(b.prompt_logprobs, ref)
        assert len(a.outputs) == 3
    mixed = again[3]
    assert mixed.prompt_logprobs is None
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed.outputs[0].cumulative_logprob == pytest.approx(
        alone.outputs[0].cumulative_logprob, abs=1e-5)


def test_bad_prompt_logprobs_is_refused():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
