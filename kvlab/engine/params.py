"""Sampling parameters of a request, validated at construction (shaped like vLLM's).

Also home of the small value checks the engine's input layer shares (:func:`is_int`,
:func:`is_real`): ``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds,
yet ``True`` is never a meaningful count, id or size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvlab.core.checks import is_int

from .structured_outputs.params import StructuredOutputsParams, check_structured_outputs

__all__ = ["MAX_SEED", "MIN_TEMPERATURE", "SamplingParams", "is_int", "is_real"]

#: Temperatures below this sample greedily (vLLM's convention). Dividing logits by a tinier
#: temperature overflows float32 and would turn the distribution into NaNs.
MIN_TEMPERATURE = 1e-5

#: Largest accepted ``seed``: torch generators take a 64-bit unsigned seed.
MAX_SEED = 2**64 - 1


def is_real(value: object) -> bool:
    """True for a finite ``int`` or ``float`` that is not a ``bool`` (no NaN, no infinity, no int
    too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float range
        return False


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    - ``max_tokens``: at most this many generated tokens (``finish_reason="length"``).
    - ``temperature``: logits are divided by it. ``0`` means greedy (argmax), and so does any
      temperature below ``MIN_TEMPERATURE = 1e-5`` (vLLM's convention: smaller ones overflow).
    - ``top_k``: keep the k most likely tokens (``0`` or ``-1`` = all).
    - ``top_p``: keep the smallest set of most likely tokens whose probability reaches ``top_p``
      (applied after top-k and temperature; ``1.0`` = all). The most likely token is always
      kept, so a tiny ``top_p`` samples the argmax.
    - ``seed``: per-request random stream, an int in ``0 .. 2**64 - 1``. The same seed gives the
      same tokens whatever else runs in the batch. With ``n > 1`` sample ``i`` uses ``seed + i``
      (modulo ``2**64``). ``None``: drawn from the engine's seed and the request's arrival order
      (reproducible for one engine).
    - ``stop_token_ids``: generating one of these ends the request (``finish_reason="stop"``);
      the stop token is kept in the output. Any iterable of ints; stored as a tuple.
    - ``ignore_eos``: keep going past the model's end-of-sequence token.
    - ``n``: number of samples; they share the prompt's KV blocks (forks, copy-on-write).
    - ``logprobs``: ``k`` -> per generated token a dict ``token id -> log-probability`` holding
      the k most likely tokens and the sampled one. Log-probabilities are the model's *raw*
      ``log_softmax(logits)``, before temperature, top-k and top-p (as vLLM returns by default).
    - ``structured_outputs``: constrain the output to a language, with vLLM's keys: exactly one
      of ``{"json": schema}``, ``{"regex": pattern}``, ``{"choice": [str, ...]}``,
      ``{"grammar": ebnf}`` (or a ``StructuredOutputsParams``); stored as a
      ``StructuredOutputsParams``. The request ends (``"stop"``) when its grammar does, even
      with ``ignore_eos``. Logprobs are then those of the grammar-masked logits (as in vLLM).
      See :mod:`kvlab.engine.structured_outputs`.

    A bad value raises ``ValueError`` naming the field (``SamplingParams.<field>``). Any value
    accepted here samples without error. ``temperature`` and ``top_p`` are stored as floats.
    """

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

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not is_real(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        object.__setattr__(self, "temperature", float(t))
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= 1, or 0/-1 for all, "
                             f"got {self.top_k!r}")
        p = self.top_p
        if not is_real(p) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1], got {p!r}")
        object.__setattr__(self, "top_p", float(p))
        s = self.seed
        if s is not None and not (is_int(s) and 0 <= s <= MAX_SEED):
            raise ValueError(f"SamplingParams.seed must be None or an int in 0..2**64-1, got {s!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes, Mapping)) or not isinstance(stops, Iterable):
            raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of token ids, "
                             f"got {stops!r}")
        stops = tuple(stops)  # materialise once: checking would exhaust an iterator
        if not all(is_int(s) and s >= 0 for s in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"SamplingParams.logprobs must be None or an int >= 0, "
                             f"got {self.logprobs!r}")
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               check_structured_outputs(self.structured_outputs))

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax: ``temperature < MIN_TEMPERATURE``."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when a stop token id is outside the model's vocabulary."""
        bad = [s for s in self.stop_token_ids if s >= vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad} outside vocabulary of "
                             f"{vocab_size} tokens")
