"""The sampler: one token per row of the step's logits (:func:`sample`), with the parameters of
each row's request (:class:`~kvlab.core.sampling_params.SamplingParams`). Each row draws from its
request's own seeded ``torch.Generator``, never depending on the rest of the batch; reported
log-probabilities are
the raw ``log_softmax(logits)``, before penalties, temperature, top-k and top-p (vLLM's
default). Order, as vLLM's sampler: min-tokens mask, penalties, then greedy or temperature,
min-p, top-k, top-p and the draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.core.sampling_params import MAX_SEED, SamplingParams

__all__ = ["RowParams", "SampleResult", "SamplerState", "filter_logits", "penalize", "sample"]


@dataclass
class SamplerState:
    """One sequence's parameters, random stream (None when greedy) and grammar state; for
    penalized params also its prompt, the ids ``min_tokens`` masks, and the tokens sampled."""

    params: SamplingParams
    generator: torch.Generator | None
    grammar: Any = None
    prompt_ids: Sequence[int] = ()
    stop_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, params: SamplingParams, seed: int, device: torch.device | str = "cpu",
               prompt_ids: Sequence[int] = (), stop_ids: Sequence[int] = ()) -> SamplerState:
        """``seed`` (an int) is taken modulo ``2**64``, so derived seeds never overflow."""
        assert type(seed) is int, f"seed must be an int, got {seed!r}"
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed % (MAX_SEED + 1))
        if not params.penalized and params.prompt_logprobs is None:
            return cls(params, gen)
        return cls(params, gen, None, tuple(prompt_ids), tuple(stop_ids))


@dataclass
class SampleResult:
    """Per row: the token, its raw log-probability and (if asked) the top-k dict."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    tokens: torch.Tensor | None = None    # token_ids on the logits' device


@dataclass(frozen=True)
class RowParams:
    """The filter parameters of a batch of random rows as tensors (the runner's input batch
    keeps them per row): ``temperature [S]``, ``top_p [S]`` (1: off) and ``min_p [S]`` (0: off)
    in float64, cast to the logits' dtype where used, ``top_k [S]`` (0: all tokens), and
    whether any row uses min-p, top-k or top-p."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    filtered: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
           ) -> RowParams:
        f64 = torch.float64
        return cls(torch.tensor([p.temperature for p in params], dtype=f64, device=device),
                   torch.tensor([row_top_k(p) for p in params], device=device),
                   torch.tensor([p.top_p for p in params], dtype=f64, device=device),
                   torch.tensor([p.min_p for p in params], dtype=f64, device=device),
                   any(p.filtered for p in params))


def row_top_k(p: SamplingParams) -> int:
    """``top_k`` as a row stores it: 0 for all tokens, a k beyond any vocabulary capped so it
    fits an int64 (it keeps every token either way)."""
    return min(max(p.top_k, 0), 2**62)


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams] | RowParams
                  ) -> torch.Tensor:
    """Temperature-scaled logits of non-greedy rows with tokens outside each row's min-p, top-k
    and top-p sets at -inf, in vLLM's order (min-p on the scaled distribution first; a row
    without a filter is unaffected by the others)."""
    if not isinstance(params, RowParams):
        assert not any(p.greedy for p in params), "greedy rows take the argmax"
        params = RowParams.of(params, logits.device)
    scaled = logits / params.temperature.to(logits.dtype)[:, None]
    if not params.filtered:
        return scaled
    if bool((params.min_p > 0).any()):
        # min-p (vLLM's MinPLogitsProcessor): p(token) < min_p * max p; 0 drops nothing
        probs = scaled.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * params.min_p.to(logits.dtype)[:, None]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    vocab = logits.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    # top-k: 0 keeps everything, as does a k larger than the vocabulary
    ks = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    # top-p: drop a token once the mass strictly before it reaches top_p. Rows without top-p
    # compare against +inf (drop nothing, even where float cumsums round up to 1).
    ps = torch.where(params.top_p < 1.0, params.top_p, float("inf")).to(logits.dtype)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= ps[:, None]
    drop[:, 0] = False  # the most likely token always survives (a tiny top_p rounds to 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def penalize(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """``logits`` (a copy, when any row changes) after each penalized row's ``min_tokens`` mask
    and its repetition, frequency and presence penalties (vLLM's formulas and order)."""
    rows = [i for i, s in enumerate(states) if s.params.penalized]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        s, p, row = states[i], states[i].params, logits[i]
        if len(s.output_ids) < p.min_tokens and s.stop_ids:
            row[list(s.stop_ids)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*s.prompt_ids, *s.output_ids}), dtype=torch.long,
                                device=row.device)
            v = row[seen]
            row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if s.output_ids and (p.frequency_penalty or p.presence_penalty):
            ids, counts = torch.tensor(s.output_ids, device=row.device).unique(
                return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return logits


def _race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row: ``argmax(probs / E)``, ``E ~ Exp(1)`` (the exponential race: the
    argmax is distributed as ``probs``). One ``exponential_`` per generator, in row order; for
    a private generator this consumes the stream as ``torch.multinomial(p, 1)`` does."""
    noise = torch.empty_like(probs)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for j, g in enumerate(generators):
        groups.setdefault(id(g), (g, []))[1].append(j)
    for g, rows in groups.values():
        if len(rows) == 1:
            noise[rows[0]].exponential_(generator=g)
        elif rows[-1] - rows[0] + 1 == len(rows):  # contiguous rows: fill the view in place
            noise[rows[0]:rows[-1] + 1].exponential_(generator=g)
        else:
            noise[rows] = torch.empty(len(rows), probs.shape[1], dtype=probs.dtype,
                                      device=probs.device).exponential_(generator=g)
    return probs.div_(noise).argmax(dim=-1)


def sample(logits: torch.Tensor, states: Sequence[SamplerState],
           rows: RowParams | None = None) -> SampleResult:
    """Pick one token per row of ``logits: [S, V]`` (float32) for ``states[i]``; ``rows``: the
    rows' filter parameters as tensors, where the caller keeps them (else built here)."""
    assert logits.shape[0] == len(states), (logits.shape, len(states))
    logprobs = torch.log_softmax(logits, dim=-1)
    logits = penalize(logits, states)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        if rows is None:
            picked = [states[i].params for i in random_rows]
        else:
            picked = RowParams(rows.temperature[idx], rows.top_k[idx], rows.top_p[idx],
                               rows.min_p[idx], rows.filtered)
        probs = filter_logits(logits[idx], picked).softmax(-1)
        tokens[idx] = _race(probs, [states[i].generator for i in random_rows])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    token_list = tokens.tolist()
    for s, t in zip(states, token_list, strict=True):
        if s.params.penalized:
            s.output_ids.append(t)
    top: list[dict[int, float] | None] = [None] * len(states)
    want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if want:
        k = max(states[i].params.logprobs for i in want)
        rows = logprobs[torch.tensor(want, device=logits.device)]
        values, ids = rows.topk(min(max(k, 1), rows.shape[-1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        chosen_list = chosen.tolist()
        for j, i in enumerate(want):
            kk = states[i].params.logprobs
            d = {int(t): float(v) for t, v in zip(ids[j][:kk], values[j][:kk], strict=True)}
            d[token_list[i]] = chosen_list[i]
            top[i] = d
    return SampleResult(token_list, chosen.tolist(), top, tokens)
