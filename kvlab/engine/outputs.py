"""What the engine returns (:class:`RequestOutput`, a :class:`CompletionOutput` per sample,
cumulative) and the :class:`OutputProcessor` that folds each step into per-request state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlab.core.request import FinishReason, RequestStatus, RuntimeRequest
from kvlab.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvlab.core.engine_core import StepResult

__all__ = ["CompletionOutput", "EngineStats", "OutputProcessor", "RequestMetrics", "RequestOutput",
           "RequestState", "SampleState"]


@dataclass
class CompletionOutput:
    """One sample: token ids, finish reason, per-token ``logprobs`` dicts (None unless asked)
    and decoded ``text`` (DELTA outputs: the new tokens' only), all tokens' raw logprob sum."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None   # the stop string, or stop token id, that ended it
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
    """Per-request timestamps (seconds, the engine's monotonic clock; None until reached)."""

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
    prompt_logprobs: list[dict[int, float] | None] | None = None   # SamplingParams'; [0] None

    def __repr__(self) -> str:
        outs = ", ".join(f"#{o.index}: {len(o.token_ids)} tok {o.finish_reason}"
                         for o in self.outputs)
        return (f"RequestOutput({self.request_id!r}, prompt={len(self.prompt_token_ids)} tok, "
                f"cached={self.num_cached_tokens}, finished={self.finished}, [{outs}])")


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
        self.generated_tokens += sum(len(t) for t in result.model.sampled.values())
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
        """Share of step time outside the model forward (scheduling, metadata, sampling)."""
        return 1.0 - self.model_time_s / self.step_time_s if self.step_time_s else 0.0


@dataclass
class SampleState:
    """One sample of a request (one RuntimeRequest in the scheduler), kept from the steps'
    results alone: its tokens, logprobs and, once it ended, the request the core handed back."""

    seq_id: str
    index: int
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    ended: RuntimeRequest | None = None     # the scheduler's request once it was reported
    sent: int = 0                           # tokens in earlier outputs (DELTA)


@dataclass
class RequestState:
    """A client request: its prompt, parameters, metrics and its ``n`` samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    num_cached_tokens: int = 0
    admitted: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def done(self) -> bool:
        return all(s.ended is not None for s in self.samples)


class OutputProcessor:
    """Per-request state and outputs, folded from each step's :class:`StepResult` (it never
    reads the scheduler); ``decode`` turns token ids into text (None: no tokenizer). Callers
    hold the core's lock."""

    def __init__(self, decode: Callable[[list[int]], str] | None) -> None:
        self.decode = decode
        self.requests: dict[str, RequestState] = {}
        self.samples: dict[str, tuple[RequestState, SampleState]] = {}
        self.undelivered: dict[str, RequestOutput] = {}
        self.stops = None   # a StopStrings once a request has SamplingParams.stop

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        if state.params.stop:
            from kvlab.engine.stop_strings import StopStrings  # off the default path
            self.stops = self.stops or StopStrings(self.decode)
            self.stops.add([s.seq_id for s in state.samples], state.params.stop,
                           state.params.min_tokens)
        for sample in state.samples:
            self.samples[sample.seq_id] = (state, sample)

    def drop(self, state: RequestState) -> None:
        for sample in state.samples:
            self.samples.pop(sample.seq_id, None)
        if self.stops is not None:
            self.stops.drop([s.seq_id for s in state.samples])
        self.requests.pop(state.request_id, None)
        self.undelivered.pop(state.request_id, None)

    def defer(self, output: RequestOutput) -> None:
        """Return ``output`` with the next :meth:`process` (it replaces an older one)."""
        self.undelivered[output.request_id] = output

    def process(self, result: StepResult, now: float, stats: EngineStats,
                only_finished: bool = False) -> list[RequestOutput]:
        """Fold one core step in: deferred outputs, then those of requests that got a token or
        ended (finished ones are dropped); prompt, cache and finish counters go to ``stats``."""
        out, model = result.output, result.model
        touched: dict[str, RequestState] = {}
        starts = {}
        for c in out.chunks:
            starts[c.request_id] = c.start_pos
            entry = self.samples.get(c.request_id)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = now
        for rid in out.preempted:
            entry = self.samples.get(rid)
            if entry is not None and entry[1].index == 0:
                entry[0].metrics.num_preemptions += 1
        for rid in out.admitted:
            entry = self.samples.get(rid)
            if entry is None or entry[0].admitted:
                continue  # other samples and re-admissions after preemption are not counted
            state = entry[0]
            # an admission's first chunk starts after the prefix the cache served
            cached, prompt = starts[rid], len(state.prompt_token_ids)
            state.admitted, state.num_cached_tokens = True, cached
            stats.prompt_tokens += prompt
            stats.cached_prompt_tokens += min(cached, prompt)
        for rid, entries in (getattr(model.info, "prompt_logprobs", None) or {}).items():
            if rid in self.samples:
                self.samples[rid][0].prompt_logprobs = entries
        for rid in model.sampled:
            entry = self.samples.get(rid)
            if entry is None or entry[1].ended is not None:
                continue          # aborted during the step, or (overlap) ended the step before
            state, sample = entry
            sample.token_ids.extend(model.sampled[rid])
            sample.cumulative_logprob += sum(model.logprobs[rid])
            if sample.logprobs is not None:
                sample.logprobs.extend(model.top_logprobs[rid])
            spec = model.drafts.get(rid)
            if spec is not None and sample.index == 0:
                state.metrics.spec_num_drafts += 1 if spec[0] else 0
                state.metrics.spec_num_draft_tokens += spec[0]
                state.metrics.spec_num_accepted_tokens += spec[1]
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            touched[state.request_id] = state
        for req in result.ended:
            entry = self.samples.get(req.request_id)
            if entry is not None:
                entry[1].ended = req
                touched[entry[0].request_id] = entry[0]
        outputs, self.undelivered = list(self.undelivered.values()), {}
        for state in touched.values():
            if only_finished and not state.done:
                continue
            o = self.make_output(state)
            if o.finished:
                state.metrics.finished_time = now
                o.metrics = state.metrics
                stats.finished_requests += 1
                for c in o.outputs:
                    reasons = stats.finished_by_reason
                    reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
                self.drop(state)
            outputs.append(o)
        return outputs

    def make_output(self, state: RequestState, force_finished: bool = False) -> RequestOutput:
        """The request's output now; ``force_finished`` (an abort) ends unfinished samples with
        reason ``abort``."""
        completions = []
        all_done = True
        for sample in state.samples:
            req, reason = sample.ended, None
            if req is not None:
                reason = req.finish_reason.value if req.finish_reason is not None else None
                if req.status is RequestStatus.CANCELLED:
                    reason = FinishReason.ABORT.value
                assert req.known_output_token_ids == sample.token_ids, sample.seq_id
                if sample.index == 0:   # exact even when aborted in a step that preempted it
                    state.metrics.num_preemptions = req.num_preemptions
            stop, text = None, None
            if self.stops is not None:   # a stop string ends it "stop", its text cut before
                reason, stop, text = self.stops.ending(sample.seq_id, reason)
            if reason == "stop" and stop is None and sample.token_ids[-1:] and \
                    sample.token_ids[-1] in state.params.stop_token_ids:
                stop = sample.token_ids[-1]            # vLLM: the stop token's id
            if force_finished and reason is None:
                reason = FinishReason.ABORT.value
            all_done &= reason is not None
            done, sample.sent = sample.sent if state.params.output_kind.value else 0, \
                len(sample.token_ids)   # DELTA (1): only the tokens after the last output's
            completions.append(CompletionOutput(
                index=sample.index, token_ids=sample.token_ids[done:], finish_reason=reason,
                logprobs=None if sample.logprobs is None else sample.logprobs[done:],
                cumulative_logprob=sample.cumulative_logprob, stop_reason=stop,
                _decode=self.decode, _text=text))
        return RequestOutput(state.request_id, state.prompt, list(state.prompt_token_ids),
                             completions, force_finished or all_done, state.metrics,
                             state.num_cached_tokens, state.prompt_logprobs)
