"""What the engine returns: :class:`RequestOutput` with one :class:`CompletionOutput` per sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One sample of a request.

    ``logprobs``: None unless requested; else one dict ``token id -> log-probability`` per
    generated token (raw model log-softmax, see :class:`~kvlab.engine.params.SamplingParams`).
    ``cumulative_logprob``: sum of the raw log-probabilities of the generated tokens.
    ``text`` is decoded on first access (step outputs of long runs stay cheap).
    """

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    _decode: Callable[[list[int]], str] | None = field(default=None, repr=False, compare=False)
    _text: str | None = field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str:
        """Detokenised output ('' when the model has no tokenizer)."""
        if self._text is None:
            self._text = self._decode(self.token_ids) if self._decode is not None else ""
        return self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timestamps (seconds on the engine's monotonic clock; None until reached)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state after a step (or at the end of :meth:`LLM.generate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache

    def __repr__(self) -> str:
        outs = ", ".join(f"#{o.index}: {len(o.token_ids)} tok {o.finish_reason}"
                         for o in self.outputs)
        return (f"RequestOutput({self.request_id!r}, prompt={len(self.prompt_token_ids)} tok, "
                f"cached={self.num_cached_tokens}, finished={self.finished}, [{outs}])")
