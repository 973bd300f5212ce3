"""What the engine returns: :class:`RequestOutput` with one :class:`CompletionOutput` per sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.core.scheduler_api import SchedulerOutput

__all__ = ["CompletionOutput", "EngineStats", "RequestMetrics", "RequestOutput", "StepTrace"]


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
    # speculative decoding (sample 0): verifications with drafts, drafts, accepted drafts
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None without speculation)."""
        n = self.spec_num_draft_tokens
        return self.spec_num_accepted_tokens / n if n else None

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


@dataclass
class StepTrace:
    """What the last :meth:`LLMEngine.step` did, for teaching and debugging (references only).

    ``scheduler_output``: the scheduler's decisions (chunks, copies, admissions, preemptions);
    ``metadata``: the executor's flat-batch layout (``input_ids``, ``positions``,
    ``slot_mapping``, decode buckets, prefill chunks); ``sampled_from``: request ids whose
    logits rows were sampled, in row order; ``logits_shape``: ``(rows, vocab)``;
    ``sampled``: token per sequence; ``finished``: sequence ids that ended in this step.
    """

    scheduler_output: SchedulerOutput
    metadata: Any
    sampled_from: list[str]
    logits_shape: tuple[int, ...]
    sampled: dict[str, int]
    finished: list[str]


@dataclass
class EngineStats:
    """Counters since the engine started (times in seconds)."""

    steps: int = 0
    forward_passes: int = 0           # steps that ran the model (one target forward each)
    prompt_tokens: int = 0            # prompt tokens of admitted requests
    cached_prompt_tokens: int = 0     # of which served by the prefix cache
    computed_tokens: int = 0          # tokens run through the model (prefill + decode)
    generated_tokens: int = 0
    finished_requests: int = 0
    #: finished samples by finish reason (vLLM's ``vllm:request_success`` label)
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    step_time_s: float = 0.0          # whole step() wall time
    model_time_s: float = 0.0         # executor forward (copies + model + logits)
    prepare_time_s: float = 0.0       # executor metadata building
    schedule_time_s: float = 0.0      # scheduler.schedule() + update_from_output()
    sample_time_s: float = 0.0

    def add_step(self, result, seconds: float) -> None:
        """Count one engine-core step (a ``StepResult``) that took ``seconds`` in all."""
        info = result.model.info
        self.steps += 1
        self.forward_passes += bool(result.output.chunks)
        self.computed_tokens += result.output.num_batched_tokens
        self.generated_tokens += sum(len(t) if isinstance(t, tuple) else 1
                                     for t in result.model.sampled.values())
        self.schedule_time_s += result.schedule_s + result.update_s
        self.prepare_time_s += info.prepare_s
        self.model_time_s += info.forward_s
        self.sample_time_s += info.sample_s
        self.step_time_s += seconds

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of step time spent outside the model forward (scheduling, metadata, sampling,
        bookkeeping)."""
        return 1.0 - self.model_time_s / self.step_time_s if self.step_time_s else 0.0
