"""Teacher-forced scoring of text by an engine's model and KV format: log-probabilities and
perplexity, used to measure what quantization costs.

:func:`token_logprobs` feeds a sequence in chunks of ``chunk`` tokens through the engine's
model, with a *private* KV cache of the engine's own KV format (the engine's cache and prefix
cache are never touched). Every chunk after the first reads its context, itself included, from
that cache, so a quantized KV format is exercised exactly as decoding exercises it. The held-out
text is the shipped models' held-out split (:func:`heldout_token_ids`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvlab.engine.attention_metadata import ChunkSpec, build_metadata

__all__ = ["heldout_token_ids", "perplexity", "token_logprobs"]

#: First document index of the held-out split the shipped models never saw (tools/train_models).
HELDOUT_START = 1_000_000


def heldout_token_ids(tokenizer, num_docs: int = 4, max_tokens: int = 512) -> list[list[int]]:
    """Token ids of the first ``num_docs`` held-out corpus documents (each cut at
    ``max_tokens``), as the models were evaluated in training (``bos doc eos``)."""
    from kvlab.models.corpus import CORPUS_SEED, generate_corpus

    docs = generate_corpus(CORPUS_SEED, num_docs, start=HELDOUT_START)
    out = []
    for doc in docs:
        ids = [*tokenizer.encode(doc), 1]
        out.append(ids[:max_tokens])
    return out


@torch.inference_mode()
def token_logprobs(engine, token_ids: Sequence[int], chunk: int = 16) -> torch.Tensor:
    """``log p(token[i+1] | token[:i+1])`` for every position, float64 ``[len - 1]``.

    ``engine``: an :class:`~kvlab.engine.llm_engine.LLMEngine` (its model, dtype and
    quantization settings are used). ValueError for fewer than 2 tokens or a bad chunk.
    """
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError("token_logprobs: need at least 2 tokens")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"token_logprobs: chunk must be a positive int, got {chunk!r}")
    cfg, bs = engine.config, engine.block_size
    nb = -(-len(ids) // bs)
    cache = engine.quantization.make_kv_cache(cfg, nb, bs, engine.dtype, engine.device)
    kernels = engine.executor.kernels
    table = list(range(nb))
    rows = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        meta = build_metadata([ChunkSpec(part, start, table)], bs, engine.device,
                              kernels.attention.paged_max_tokens)
        hidden = engine.model(meta, cache.layers, kernels)
        rows.append(engine.model.logits(hidden).double().log_softmax(-1))
    logp = torch.cat(rows)[:-1]
    target = torch.tensor(ids[1:], device=logp.device)
    return logp.gather(1, target[:, None])[:, 0].cpu()


def perplexity(engine, sequences: Sequence[Sequence[int]], chunk: int = 16) -> float:
    """``exp(mean negative log-likelihood)`` over all predicted tokens of ``sequences``."""
    total, count = 0.0, 0
    for ids in sequences:
        lp = token_logprobs(engine, ids, chunk)
        total -= float(lp.sum())
        count += lp.numel()
    return math.exp(total / count)
