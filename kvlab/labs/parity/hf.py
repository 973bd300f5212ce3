"""Parity with Hugging Face transformers: build a random checkpoint, compare token by token.

:func:`save_random_hf_model` writes a randomly initialised ``LlamaForCausalLM``,
``MistralForCausalLM``, ``MinistralForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``
(small, grouped-query
attention; sliding windows through the config's own fields) to a directory in the Hugging Face
layout.
:func:`compare_with_hf` generates greedily with kvlab (paged KV, chunked prefill, batching) and
re-scores every generated sequence with the transformers model in one dense forward pass, then
reports the largest log-probability difference and any greedy-token divergence.

transformers is an optional (dev) dependency: it is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["ParityReport", "compare_with_hf", "save_random_hf_model"]


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars (their timings would make outputs irreproducible)."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def save_random_hf_model(path: str | Path, arch: str = "llama", *, seed: int = 0,
                         **overrides: Any) -> Path:
    """Save a random small model (``arch``: ``"llama"``, ``"mistral"``, ``"ministral"``,
    ``"qwen2"`` or ``"qwen3"``) to ``path``.

    Defaults: hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), vocab 128, weights drawn
    with std 0.1 so that the next-token distribution is peaked enough to be interesting.
    ``overrides`` go to the transformers config (e.g. ``rope_scaling``, ``sliding_window``;
    Mistral's default window is 4096, more than these models ever see). Returns ``path``.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MinistralConfig,
        MinistralForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    kinds = {"llama": (LlamaConfig, LlamaForCausalLM),
             "mistral": (MistralConfig, MistralForCausalLM),
             "ministral": (MinistralConfig, MinistralForCausalLM),
             "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    if arch not in kinds:
        raise ValueError(f"arch must be one of {sorted(kinds)}, got {arch!r}")
    cfg_cls, model_cls = kinds[arch]
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=512, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch in ("qwen3", "ministral"):
        kwargs["head_dim"] = 16            # Qwen3Config's default is 128, Ministral's None
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():   # transformers initialises biases to zero and norms to one
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.1)
            for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.normal_(1, 0.2)
    path = Path(path)
    with _quiet_transformers():
        model.save_pretrained(path)
    return path


@dataclass
class ParityReport:
    """Result of :func:`compare_with_hf` (log-probabilities in nats)."""

    num_sequences: int
    num_tokens: int
    max_logprob_diff: float          # over every generated position and every reported token
    greedy_mismatches: int           # positions where kvlab's token != HF's argmax
    unexplained_mismatches: int      # ... where HF's top-2 margin is >= the tolerance
    details: list[dict] = field(default_factory=list)

    def ok(self, tol: float = 1e-4) -> bool:
        return self.max_logprob_diff <= tol and self.unexplained_mismatches == 0


def compare_with_hf(model_dir: str | Path, prompts: Sequence[Sequence[int]], *,
                    max_tokens: int = 16, logprobs: int = 5, tol: float = 1e-4,
                    **engine_kwargs: Any) -> ParityReport:
    """Generate greedily with kvlab, re-score with transformers, compare every position.

    HF scores kvlab's own sequence (teacher forcing), so every position is compared even after
    a divergence; a sequence whose every token is HF's argmax is HF's greedy output.

    ``engine_kwargs`` go to :class:`~kvlab.engine.llm.LLM` (block size, chunking, ...).
    """
    from transformers import AutoModelForCausalLM

    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    llm = LLM(model_dir, **engine_kwargs)
    outs = llm.generate([list(p) for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                       logprobs=logprobs))
    with _quiet_transformers():
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst, mism, unexplained, total = 0.0, 0, 0, 0
    details = []
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        ids = list(prompt) + comp.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:len(ids) - 1]
        for t, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            total += 1
            for tid, value in lp.items():
                worst = max(worst, abs(value - ref[t, tid].item()))
            top2 = ref[t].topk(2).values
            if tok != int(ref[t].argmax()):
                mism += 1
                margin = (top2[0] - top2[1]).item()
                if margin >= tol:
                    unexplained += 1
                details.append({"position": t, "kvlab": tok, "hf": int(ref[t].argmax()),
                                "hf_margin": margin})
    return ParityReport(len(outs), total, worst, mism, unexplained, details)
