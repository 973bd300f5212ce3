"""Sampling parameters of a request, validated at construction (shaped like vLLM's)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SamplingParams"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    - ``max_tokens``: at most this many generated tokens (``finish_reason="length"``).
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens (``0`` or ``-1`` = all).
    - ``top_p``: keep the smallest set of most likely tokens whose probability reaches ``top_p``
      (applied after top-k and temperature; ``1.0`` = all).
    - ``seed``: per-request random stream. The same seed gives the same tokens whatever else runs
      in the batch. With ``n > 1`` sample ``i`` uses ``seed + i``. ``None``: drawn from the
      engine's seed and the request's arrival order (reproducible for one engine).
    - ``stop_token_ids``: generating one of these ends the request (``finish_reason="stop"``);
      the stop token is kept in the output.
    - ``ignore_eos``: keep going past the model's end-of-sequence token.
    - ``n``: number of samples; they share the prompt's KV blocks (forks, copy-on-write).
    - ``logprobs``: ``k`` -> per generated token a dict ``token id -> log-probability`` holding
      the k most likely tokens and the sampled one. Log-probabilities are the model's *raw*
      ``log_softmax(logits)``, before temperature, top-k and top-p (as vLLM returns by default).
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

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= 1, or 0/-1 for all, "
                             f"got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not all(_is_int(s) and s >= 0 for s in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"SamplingParams.logprobs must be None or an int >= 0, "
                             f"got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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
