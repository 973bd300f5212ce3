"""SpecExecutor: the engine core's executor when speculation is on (one forward verifies all).

Per step (the engine core's ``execute``; the step loop is unchanged):

1. copy-on-write copies on the target's cache and on the proposer's (the draft model's);
2. the proposer drafts up to ``num_lookahead`` tokens for every chunk that has lookahead
   slots (:mod:`.proposers`);
3. **one target forward** over the flat batch: prefill chunks, plain decodes, and for each
   speculating request its last token followed by its drafts (``k + 1`` query tokens, laid out
   as a multi-token chunk over the reserved slots); logits of every verified row;
4. per sampling request the rejection sampler (:func:`.verifier.verify`) picks the emitted
   tokens, cut after a stop token (:func:`kvlab.core.spec_plan.stop_cut`), with counter-based
   random streams (:mod:`.rng`).

The answer maps a speculating request to a tuple of tokens and any other sampling request to
one int; the scheduler then rolls the KV back to the accepted tokens. Sampling requests without
lookahead (first tokens, requests that could not reserve slots) go through the same sampler
with zero drafts, so one request's tokens depend on its seed alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.core.request import RequestStatus, RuntimeRequest
from kvlab.core.spec_plan import stop_cut
from kvlab.core.step_records import ModelOutput, SchedulerOutput
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.model import LlamaModel
from kvlab.engine.model_runner import ModelRunner, StepInfo
from kvlab.engine.ops import Kernels
from kvlab.engine.sampler import SamplerState
from kvlab.engine.spec_decode.grammar import GrammarCursor
from kvlab.engine.spec_decode.metrics import SpecDecodeMetrics
from kvlab.engine.spec_decode.proposers import (
    DraftModelProposer,
    NgramProposer,
    Proposal,
    RowContext,
)
from kvlab.engine.spec_decode.rng import TARGET, position_generator
from kvlab.engine.spec_decode.verifier import processed_probs, verify
from kvlab.engine.structured_outputs.manager import StructuredOutputManager

__all__ = ["SpecExecutor", "SpecStepInfo", "grammar_of"]


def grammar_of(state: SamplerState) -> GrammarCursor | None:
    """A cursor over the request's grammar state (structured outputs), or None."""
    grammar = getattr(state, "grammar", None)
    return None if grammar is None else GrammarCursor(grammar)


@dataclass
class SpecStepInfo(StepInfo):
    """:class:`~kvlab.engine.model_runner.StepInfo` plus ``draft_s`` (proposer time)."""

    draft_s: float = 0.0


class SpecExecutor(ModelRunner):
    """Executor of a speculating engine: ``model`` over ``cache``, drafts from ``proposer``.
    Sampler states as :class:`ModelRunner`'s; ``contexts``: its own copy of each request, made
    from the scheduler output's :class:`~kvlab.core.step_records.NewRequest` and extended by the
    tokens it emits (the proposers read the context, the stop cut its stop conditions), so it
    never reads the scheduler's."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache, kernels: Kernels,
                 proposer: DraftModelProposer | NgramProposer, metrics: SpecDecodeMetrics,
                 structured_outputs: StructuredOutputManager | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        super().__init__(model, cache, kernels, structured_outputs, eos_token_ids)
        self.contexts: dict[str, RuntimeRequest] = {}
        self.proposer, self.metrics = proposer, metrics

    def update_requests(self, output: SchedulerOutput) -> None:
        super().update_requests(output)
        for rid in output.finished_ids:
            self.contexts.pop(rid, None)
        for new in output.new_requests:
            self.contexts[new.request_id] = RuntimeRequest(
                new.request_id, new.prompt_token_ids, new.max_tokens,
                stop_token_ids=new.stop_token_ids, eos_token_id=new.eos_token_id,
                ignore_eos=new.ignore_eos, max_model_len=new.max_model_len,
                output_token_ids=list(new.output_token_ids), status=RequestStatus.RUNNING)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelOutput:
        t0 = time.perf_counter()
        chunks = output.chunks
        self.update_requests(output)
        sampling = [i for i, c in enumerate(chunks) if c.sample]
        rows: dict[str, RowContext] = {}
        for i in sampling:
            request = self.contexts[chunks[i].request_id]
            state = self.requests[request.request_id]
            seed = state.generator.initial_seed() if state.generator is not None else None
            rows[request.request_id] = RowContext(request.all_token_ids, state.params, seed,
                                                  grammar_of(state))
        self.input_batch.apply(chunks, self.requests)
        tables = {c.request_id: self.input_batch.table(c.request_id) for c in chunks}
        self.cache.copy_blocks(output.copies)
        self.proposer.copy_blocks(output.copies)
        t1 = time.perf_counter()
        proposals: dict[str, Proposal] = {}
        if chunks:     # the draft model writes its KV of every chunk, drafts or not
            proposals = self.proposer.propose(chunks, rows, tables)
        self._sync()
        t2 = time.perf_counter()
        if not chunks:
            return ModelOutput({}, t2 - t0, SpecStepInfo(None, [], (0,)))
        drafts = {rid: p.tokens for rid, p in proposals.items()}
        specs = [ChunkSpec(c.token_ids + drafts.get(c.request_id, ()), c.start_pos,
                           tables[c.request_id]) for c in chunks]
        meta = build_metadata(specs, self.block_size, self.device,
                              self.kernels.attention.paged_max_tokens)
        picked: list[int] = []
        for i in sampling:
            n = len(drafts.get(chunks[i].request_id, ())) + 1
            picked.extend(range(meta.last_row[i] - n + 1, meta.last_row[i] + 1))
        index = torch.tensor(picked, dtype=torch.long, device=self.device)
        logits = self.model.logits(self.model(meta, self.cache.layers, self.kernels,
                                              rows=index))
        self._sync()
        t3 = time.perf_counter()
        sampled, logprobs, tops, spec = self._verify(output.step, chunks, sampling, rows,
                                                     proposals, logits.float().cpu())
        t4 = time.perf_counter()
        self.metrics.draft_time_s += t2 - t1
        self.metrics.target_time_s += t3 - t2
        ids = [chunks[i].request_id for i in sampling]
        info = SpecStepInfo(meta, ids, tuple(logits.shape), t1 - t0, t3 - t2, t4 - t3,
                            draft_s=t2 - t1)
        return ModelOutput(sampled, t4 - t0, info, logprobs, tops, spec)

    def _verify(self, step, chunks, sampling, rows, proposals, logits):
        """Rejection-sample every sampling request of the step (probabilities and
        log-probabilities computed for all rows at once, then per request)."""
        props = [proposals.get(chunks[i].request_id, Proposal((), None)) for i in sampling]
        ctxs = [rows[chunks[i].request_id] for i in sampling]
        row_params = [ctx.params for ctx, prop in zip(ctxs, props, strict=True)
                      for _ in range(len(prop.tokens) + 1)]
        masks = [self._target_masks(ctx, prop.tokens) for ctx, prop in zip(ctxs, props,
                                                                           strict=True)]
        allowed = None
        if any(m is not None for m in masks):
            allowed = torch.cat([m if m is not None else torch.ones(
                len(prop.tokens) + 1, logits.shape[-1], dtype=torch.bool)
                for m, prop in zip(masks, props, strict=True)])
        probs = processed_probs(logits, row_params, allowed)
        lp_all = torch.log_softmax(logits, dim=-1)
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, list[float]] = {}
        tops: dict[str, list[dict[int, float] | None]] = {}
        spec: dict[str, tuple[int, int]] = {}
        row = 0
        for i, ctx, prop in zip(sampling, ctxs, props, strict=True):
            c = chunks[i]
            rid = c.request_id
            k = len(prop.tokens)
            p, lp = probs[row:row + k + 1], lp_all[row:row + k + 1]
            row += k + 1
            first = c.start_pos + c.num_tokens    # position of the first token decided here

            def gens(j: int, seed=ctx.seed, first=first) -> torch.Generator | None:
                return None if seed is None else position_generator(seed, first + j, TARGET)

            verdict = verify(p, prop.tokens, None if prop.q is None else prop.q.cpu(), gens)
            tokens = verdict.tokens[:stop_cut(self.contexts[rid], verdict.tokens)]
            self.contexts[rid].output_token_ids.extend(tokens)
            if ctx.constraint is not None:
                ctx.constraint.commit(tokens)
            if c.num_lookahead:
                self.metrics.record(step, rid, k, verdict.num_accepted, verdict.rejected)
                spec[rid] = (k, verdict.num_accepted)
            chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
            top: list[dict[int, float] | None] = [None] * len(tokens)
            want = ctx.params.logprobs
            if want is not None:
                values, ids = lp[:len(tokens)].topk(min(max(want, 1), lp.shape[-1]), dim=-1)
                top = []
                for j, t in enumerate(tokens):
                    d = {int(a): float(b) for a, b in zip(ids[j, :want].tolist(),
                                                          values[j, :want].tolist(), strict=True)}
                    d[t] = chosen[j]
                    top.append(d)
            sampled[rid], logprobs[rid], tops[rid] = tuple(tokens), chosen, top
        return sampled, logprobs, tops, spec

    @staticmethod
    def _target_masks(ctx: RowContext, drafts: tuple[int, ...]) -> torch.Tensor | None:
        """Grammar masks of rows ``0..k``: the state after accepting ``drafts[:j]``; the
        constraint is rolled back to where it was."""
        c = ctx.constraint
        if c is None:
            return None
        masks = []
        for t in drafts:
            masks.append(c.allowed())
            c.push(t)
        masks.append(c.allowed())
        c.pop_all()
        return torch.stack(masks)
