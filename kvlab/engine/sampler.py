"""The parameters a request samples with (:class:`SamplingParams`, validated when made) and the
sampler that applies them (:func:`sample`). Each row draws from its request's own seeded
``torch.Generator``, never depending on the rest of the batch; reported log-probabilities are
the raw ``log_softmax(logits)``, before penalties, temperature, top-k and top-p (vLLM's
default). Order, as vLLM's sampler: min-tokens mask, penalties, then greedy or temperature,
min-p, top-k, top-p and the draw.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from .detokenizer import check_stop
from .structured_outputs.params import StructuredOutputsParams, check_structured_outputs

__all__ = ["MAX_SEED", "MIN_TEMPERATURE", "RequestOutputKind", "SampleResult", "SamplerState",
           "SamplingParams", "filter_logits", "is_real", "penalize", "sample"]

MIN_TEMPERATURE = 1e-5   # below it, greedy (vLLM's rule): a tinier divisor overflows float32
MAX_SEED = 2**64 - 1      # torch generators take a 64-bit unsigned seed


def _count(value: object, least: int) -> bool:
    """An int >= ``least`` that is not a bool (``True`` is an int, never a meaningful count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")


def is_real(value: object) -> bool:
    """A finite ``int`` or ``float``, not a ``bool`` (no NaN, no infinity, no int beyond float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float range
        return False


class RequestOutputKind(Enum):   # vLLM's: each output has all tokens so far, or the new ones
    CUMULATIVE, DELTA = 0, 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's names and meanings).

    ``max_tokens`` (>= 1); ``temperature`` (0, or below ``MIN_TEMPERATURE``: greedy); ``min_p``
    in [0, 1]: after temperature, drop tokens less likely than ``min_p`` times the most likely
    one (0: off; greedy ignores it); ``top_k`` (0 or -1: all); ``top_p`` in (0, 1], after
    min-p, top-k and temperature, always keeping the most likely token; ``seed`` in
    ``0 .. 2**64-1``: the request's own stream (sample ``i`` of ``n`` uses ``seed + i``; None:
    from the engine's seed and arrival order); ``stop_token_ids`` (kept
    in the output; stored as a tuple); ``ignore_eos``; ``n`` samples sharing the prompt's blocks;
    ``logprobs=k``: per token the k most likely and the sampled one, raw (``prompt_logprobs=k``:
    the same per prompt token after the first); ``structured_outputs``: exactly one of
    ``{"json"|"regex"|"choice"|"grammar": ...}``, as ``StructuredOutputsParams`` (the request
    ends when its grammar does). Penalties (OpenAI's and vLLM's): ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] subtract, per token already generated, once and per
    occurrence; ``repetition_penalty`` > 0 divides positive (multiplies negative) logits of
    tokens in the prompt or the output; ``min_tokens``: EOS and the stop ids are masked until
    that many tokens were generated; ``stop``: strings the text ends before (the match is
    excluded, ``stop_reason`` is the string); ``output_kind=DELTA``: each output only the new
    tokens. A bad value raises ``ValueError`` naming ``SamplingParams.<field>``; any accepted
    value samples without error."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    stop: str | Sequence[str] = ()
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    min_p: float = 0.0

    def __post_init__(self) -> None:
        t, p, s, stops = self.temperature, self.top_p, self.seed, self.stop_token_ids
        _check(_count(self.max_tokens, 1), "max_tokens", "an int >= 1", self.max_tokens)
        _check(is_real(t) and t >= 0, "temperature", "a finite number >= 0", t)
        object.__setattr__(self, "temperature", float(t))
        _check(_count(self.top_k, -1), "top_k", "an int >= 1, or 0/-1 for all", self.top_k)
        _check(is_real(p) and 0 < p <= 1, "top_p", "a number in (0, 1]", p)
        object.__setattr__(self, "top_p", float(p))
        _check(is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]",
               self.min_p)
        object.__setattr__(self, "min_p", float(self.min_p))
        _check(s is None or (_count(s, 0) and s <= MAX_SEED), "seed",
               "None or an int in 0..2**64-1", s)
        _check(isinstance(stops, Iterable) and not isinstance(stops, (str, bytes, Mapping)),
               "stop_token_ids", "a sequence of token ids", stops)
        stops = tuple(stops)  # materialise once: checking would exhaust an iterator
        _check(all(_count(i, 0) for i in stops), "stop_token_ids", "token ids >= 0", stops)
        object.__setattr__(self, "stop_token_ids", stops)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _check(_count(self.n, 1), "n", "an int >= 1", self.n)
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
               "a RequestOutputKind", self.output_kind)
        for name in ("logprobs", "prompt_logprobs"):
            _check(getattr(self, name) is None or _count(getattr(self, name), 0), name,
                   "None or an int >= 0", getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(is_real(v) and -2 <= v <= 2, name, "a number in [-2, 2]", v)
            object.__setattr__(self, name, float(v))
        rp = self.repetition_penalty
        _check(is_real(rp) and rp > 0, "repetition_penalty", "a finite number > 0", rp)
        object.__setattr__(self, "repetition_penalty", float(rp))
        _check(_count(self.min_tokens, 0) and self.min_tokens <= self.max_tokens, "min_tokens",
               f"an int in 0..max_tokens ({self.max_tokens})", self.min_tokens)
        if self.stop != ():   # a str or strings, stored as a tuple (kvlab.engine.stop_strings)
            object.__setattr__(self, "stop", check_stop(self.stop, "SamplingParams.stop"))
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               check_structured_outputs(self.structured_outputs))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty or ``min_tokens`` changes the logits (the sampler keeps history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.min_tokens
                    or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when a stop token id is outside the model's vocabulary."""
        bad = [s for s in self.stop_token_ids if s >= vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad} outside vocabulary of "
                             f"{vocab_size} tokens")


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
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"SamplerState.create: seed must be an int, got {seed!r}")
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


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits of non-greedy rows with tokens outside each row's min-p, top-k
    and top-p sets at -inf, in vLLM's order (min-p on the scaled distribution first; a row
    without a filter is unaffected by the others)."""
    assert not any(p.greedy for p in params), "greedy rows take the argmax"
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                         device=logits.device)
    scaled = logits / temps[:, None]
    if any(p.uses_min_p for p in params):
        # min-p (vLLM's MinPLogitsProcessor): p(token) < min_p * max p; 0 drops nothing
        mins = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < probs.amax(-1, keepdim=True) * mins[:, None],
                                    float("-inf"))
    if not any(p.uses_top_k or p.uses_top_p for p in params):
        return scaled
    vocab = logits.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    # top-k: a k larger than the vocabulary keeps everything (and must not overflow a tensor)
    ks = torch.tensor([min(p.top_k, vocab) if p.uses_top_k else vocab for p in params],
                      device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    # top-p: drop a token once the mass strictly before it reaches top_p. Rows without top-p
    # compare against +inf (drop nothing, even where float cumsums round up to 1).
    ps = torch.tensor([p.top_p if p.uses_top_p else float("inf") for p in params],
                      dtype=logits.dtype, device=logits.device)
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


def sample(logits: torch.Tensor, states: Sequence[SamplerState]) -> SampleResult:
    """Pick one token per row of ``logits: [S, V]`` (float32) for ``states[i]``."""
    assert logits.shape[0] == len(states), (logits.shape, len(states))
    logprobs = torch.log_softmax(logits, dim=-1)
    logits = penalize(logits, states)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = filter_logits(logits[idx], [states[i].params for i in random_rows]).softmax(-1)
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
    return SampleResult(token_list, chosen.tolist(), top)
