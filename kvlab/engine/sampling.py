"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request RNG, logprobs.

:func:`sample` takes the logits rows of one step (one row per sampled sequence) and the
:class:`SamplerState` of each row. Every row owns a ``torch.Generator`` seeded from its request's
seed, so a request's tokens depend only on its own logits and seed — never on what else shares
the batch.

**One batched draw** (the exponential race, a form of the Gumbel-max trick): with ``E_v ~ Exp(1)``
i.i.d., ``argmax_v p_v / E_v`` is distributed as ``p`` (``E_v / p_v ~ Exp(p_v)`` and the
smallest of independent exponentials is ``v`` with probability ``p_v / sum p``). Each row's noise
is drawn from its own generator (one ``exponential_`` per *generator*: rows that share a generator
share one call), then every row is picked by one ``div`` + ``argmax`` over the whole batch. For a
row with a private generator this consumes the stream exactly as ``torch.multinomial(p, 1,
generator=g)`` does (torch uses the same race for one draw), so seeded outputs are unchanged.
Rows that share one generator (the engine's stream for unseeded requests) are reproducible per
engine seed and workload, but not independent of the batch.

Log-probabilities reported (``cumulative_logprob`` and ``logprobs=k``) are the model's raw
``log_softmax(logits)``, taken *before* temperature, top-k and top-p.

Every :class:`SamplingParams` samples without error: temperatures below ``MIN_TEMPERATURE`` are
greedy rows (never divided by), top-k is capped at the vocabulary, and top-p keeps the most likely
token however small ``top_p`` is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .params import MAX_SEED, SamplingParams, is_int

__all__ = ["SampleResult", "SamplerState", "sample"]


@dataclass
class SamplerState:
    """Sampling state of one sequence: its parameters and its private random stream."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy sequences; may be shared between rows
    # structured outputs: the sequence's GrammarState (kvlab.engine.structured_outputs), or None
    grammar: Any = None

    @classmethod
    def create(cls, params: SamplingParams, seed: int, device: torch.device | str = "cpu"
               ) -> SamplerState:
        """The state of one sequence. ``seed`` may be any int: it is reduced modulo ``2**64``
        (torch's seed range), so derived seeds such as ``params.seed + i`` never overflow."""
        if not is_int(seed):
            raise TypeError(f"SamplerState.create: seed must be an int, got {seed!r}")
        if params.greedy:
            return cls(params, None)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed % (MAX_SEED + 1))
        return cls(params, gen)


@dataclass
class SampleResult:
    """Per row: the token, its raw log-probability and (if asked) the top-k dict."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside each row's top-k / top-p set at -inf.

    Rows must not be greedy (their temperature would be a division by ~0). A row without top-k
    or top-p gets the same values whatever other rows ask for.
    """
    assert not any(p.greedy for p in params), "greedy rows take the argmax, not _filter"
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                         device=logits.device)
    scaled = logits / temps[:, None]
    if not any(p.uses_top_k or p.uses_top_p for p in params):
        return scaled
    vocab = logits.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    # top-k: a k larger than the vocabulary keeps everything (and must not overflow a tensor)
    ks = torch.tensor([min(p.top_k, vocab) if p.uses_top_k else vocab for p in params],
                      device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= ks[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # top-p: drop a token once the mass strictly before it reaches top_p. Rows without top-p
    # compare against +inf (drop nothing, even where float cumsums round up to 1).
    ps = torch.tensor([p.top_p if p.uses_top_p else float("inf") for p in params],
                      dtype=logits.dtype, device=logits.device)
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs
    drop = before >= ps[:, None]
    drop[:, 0] = False  # the most likely token always survives (a tiny top_p rounds to 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def _race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs: [R, V]``: ``argmax(probs / E)`` with ``E ~ Exp(1)`` drawn
    per row from ``generators[j]`` (rows sharing a generator object draw in one call, in row
    order; ``None`` rows share torch's default generator)."""
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


def sample(logits: torch.Tensor, states: Sequence[SamplerState]) -> SampleResult:
    """Pick one token per row of ``logits: [S, V]`` (float32) for ``states[i]``."""
    if logits.shape[0] != len(states):
        raise ValueError(f"sample: {logits.shape[0]} logits rows for {len(states)} states")
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = _filter(logits[idx], [states[i].params for i in random_rows]).softmax(-1)
        tokens[idx] = _race(probs, [states[i].generator for i in random_rows])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    token_list = tokens.tolist()
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
    return SampleResult(token_list, chosen.tolist(), top)


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p applied to non-greedy rows (what :func:`sample` draws
    from); speculative decoding processes draft and target rows with it."""
    return _filter(logits, params)
