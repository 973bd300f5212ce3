"""OutputProcessor: the engine's output side — engine-core steps in, RequestOutputs out.

It keeps one :class:`RequestState` per client request (its ``n`` samples, metrics, logprobs)
and folds each :class:`~kvlab.core.engine_core.StepResult` into them: first-scheduled and
first-token times, prompt and prefix-cache counters, the samples that ended. A request's
output is cumulative (all tokens so far), so handing back only the latest one per request
loses nothing. Callers hold the engine core's lock around every method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvlab.core.engine_core import StepResult
from kvlab.core.scheduler_api import FinishReason, RequestStatus, RuntimeRequest

from .outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from .params import SamplingParams

__all__ = ["OutputProcessor", "RequestState", "SampleState"]


@dataclass
class SampleState:
    """One sample of a request (one RuntimeRequest in the scheduler)."""

    seq_id: str
    index: int
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0
    ended: RuntimeRequest | None = None     # the scheduler's request once it was reported


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

    @property
    def done(self) -> bool:
        return all(s.ended is not None for s in self.samples)


class OutputProcessor:
    """Per-request state and output building (see the module docstring).

    ``lookup(seq_id)`` returns the scheduler's live request; ``decode`` turns token ids into
    text (None: no tokenizer).
    """

    def __init__(self, lookup: Callable[[str], RuntimeRequest],
                 decode: Callable[[list[int]], str] | None) -> None:
        self.lookup = lookup
        self.decode = decode
        self.requests: dict[str, RequestState] = {}
        self.samples: dict[str, tuple[RequestState, SampleState]] = {}
        self.undelivered: dict[str, RequestOutput] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for sample in state.samples:
            self.samples[sample.seq_id] = (state, sample)

    def drop(self, state: RequestState) -> None:
        for sample in state.samples:
            self.samples.pop(sample.seq_id, None)
        self.requests.pop(state.request_id, None)
        self.undelivered.pop(state.request_id, None)

    def defer(self, output: RequestOutput) -> None:
        """Return ``output`` with the next :meth:`process` (it replaces an older one)."""
        self.undelivered[output.request_id] = output

    def process(self, result: StepResult, now: float, stats: EngineStats,
                only_finished: bool = False) -> list[RequestOutput]:
        """Fold one core step in; the outputs of requests that got a token or ended (finished
        ones are dropped from the processor), after any deferred outputs. Prompt, prefix-cache
        and finish counters are added to ``stats``."""
        out, info = result.output, result.model.info
        touched: dict[str, RequestState] = {}
        for c in out.chunks:
            entry = self.samples.get(c.request_id)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = now
        ended = {r.request_id: r for r in result.ended}
        for rid in out.admitted:
            entry = self.samples.get(rid)
            if entry is None or entry[0].admitted:
                continue  # other samples and re-admissions after preemption are not counted
            state = entry[0]
            state.admitted = True
            # admitted and ended in this very step: the core has forgotten it already
            req = ended[rid] if rid in ended else self.lookup(rid)
            state.num_cached_tokens = req.num_cached_tokens
            stats.prompt_tokens += req.num_prompt_tokens
            stats.cached_prompt_tokens += min(req.num_cached_tokens, req.num_prompt_tokens)
        for rid in result.model.sampled:
            entry = self.samples.get(rid)
            if entry is None:
                continue          # aborted during the step
            state, sample = entry
            lps, tops = info.logprobs[rid], info.top_logprobs[rid]
            multi = isinstance(lps, list)              # a speculating request's tokens
            sample.cumulative_logprob += sum(lps) if multi else lps
            if sample.logprobs is not None:
                sample.logprobs.extend(tops if multi else [tops])
            spec = getattr(info, "spec", {}).get(rid)
            if spec is not None and sample.index == 0:
                state.metrics.spec_num_drafts += 1 if spec[0] else 0
                state.metrics.spec_num_draft_tokens += spec[0]
                state.metrics.spec_num_accepted_tokens += spec[1]
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            touched[state.request_id] = state
        for req in ended.values():
            entry = self.samples.get(req.request_id)
            if entry is not None:
                entry[1].ended = req
                touched[entry[0].request_id] = entry[0]
        outputs = list(self.undelivered.values())
        self.undelivered = {}
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
            req = sample.ended or self.lookup(sample.seq_id)
            reason = req.finish_reason.value if req.finish_reason is not None else None
            if req.status is RequestStatus.CANCELLED or (force_finished and reason is None):
                reason = FinishReason.ABORT.value
            if reason is None:
                all_done = False
            completions.append(CompletionOutput(
                index=sample.index, token_ids=list(req.output_token_ids), finish_reason=reason,
                logprobs=None if sample.logprobs is None else list(sample.logprobs),
                cumulative_logprob=sample.cumulative_logprob, _decode=self.decode))
            if sample.index == 0:
                state.metrics.num_preemptions = req.num_preemptions
        return RequestOutput(state.request_id, state.prompt, list(state.prompt_token_ids),
                             completions, force_finished or all_done, state.metrics,
                             state.num_cached_tokens)
