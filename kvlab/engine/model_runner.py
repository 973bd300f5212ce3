"""ModelRunner: the real engine's executor, where scheduler decisions touch tensors. Per step,
from the scheduler's output alone: drop the requests that ended, take over the state of new
ones (:class:`~kvlab.core.step_records.NewRequest`: the sampler state they seed), copy-on-write
copies, the chunks' table deltas into the persistent
:class:`~kvlab.engine.input_batch.InputBatch`, the metadata from its rows, one forward with the
engine's kernels (which writes the new K/V), one token per sampling chunk. It never looks
into the scheduler.

Overlap scheduling (``async_scheduling``): the engine core runs :meth:`ModelRunner.execute` on
a worker thread while it plans the next step, steps in order. A decode planned while its input
token was still being sampled carries a placeholder, replaced from the previous step's sampled
tokens on the device (:meth:`ModelRunner._fill_placeholders`). What the worker still waits
for on CUDA: each step's metadata is copied from pageable host memory, and the sampled tokens
come back to the host (``tolist``) for ``ModelOutput``, each a wait on the GPU, so the GPU
idles while the worker prepares the next step. vLLM avoids both, with pinned buffers copied
``non_blocking`` and an output copy on its own stream that only the step's reader waits for
(``CpuGpuBuffer`` in ``vllm/v1/utils.py``, ``AsyncGPUModelRunnerOutput`` in
``vllm/v1/worker/gpu_model_runner.py``, v0.32.0).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.core.request import PLACEHOLDER
from kvlab.core.step_records import ModelOutput, NewRequest, ScheduledChunk, SchedulerOutput
from kvlab.engine.attention_metadata import AttentionMetadata
from kvlab.engine.input_batch import InputBatch
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.model import LlamaModel
from kvlab.engine.ops import Kernels
from kvlab.engine.sampler import SamplerState, sample
from kvlab.engine.structured_outputs.bitmask import sample_with_grammars
from kvlab.engine.structured_outputs.manager import StructuredOutputManager

__all__ = ["ModelRunner", "StepInfo"]


@dataclass
class StepInfo:
    """``ModelOutput.info`` of a step: metadata, sampled ids in logits-row order, the logits'
    shape and timings in seconds."""

    metadata: AttentionMetadata | None
    request_ids: list[str]
    logits_shape: tuple[int, ...]
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    prompt_logprobs: dict | None = None   # seq id -> its prompt entries, the step they complete


class ModelRunner:
    """Execute steps of ``model`` over ``cache`` (one device) with ``kernels`` (chosen once, for
    the device and dtype). ``requests``: the sampler state of every request the scheduler sent
    and has not finished (kept across preemptions); ``structured_outputs`` makes the grammar
    states and ``eos_token_ids`` are the ids ``min_tokens`` holds back. ``input_batch``: the
    persistent rows (default: one table per request; a model with several KV cache groups
    passes a :class:`~kvlab.engine.hybrid_input_batch.HybridInputBatch`)."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache, kernels: Kernels,
                 structured_outputs: StructuredOutputManager | None = None,
                 eos_token_ids: Sequence[int] = (), input_batch: InputBatch | None = None):
        cfg = model.cfg
        assert len(cache.layers) == cfg.num_layers and cache.data.shape[-2:] == (
            cfg.num_kv_heads, cfg.head_dim), "the KV cache's shape is the model's"
        self.model, self.cache = model, cache
        self.device, self.block_size = model.device, cache.block_size
        self.kernels = kernels
        self.structured_outputs = structured_outputs
        self.eos_token_ids = tuple(eos_token_ids)
        self.input_batch = (input_batch if input_batch is not None
                            else InputBatch(self.block_size, self.device))
        self.requests: dict[str, SamplerState] = {}
        # overlap scheduling: the tokens the last step sampled, on the device, and each
        # request's row among them (a placeholder in the next step's inputs reads its row)
        self._last_tokens: torch.Tensor | None = None
        self._last_row: dict[str, int] = {}
        self.scorer = None   # a PromptScorer once a request asks for prompt logprobs
        self.graphs = None   # CUDA-graph decode (engine/cuda_graphs.py), set at engine build

    def update_requests(self, output: SchedulerOutput) -> None:
        """Drop the requests that ended, then take over the new ones (an id may be reused in
        the same step), and drop the rows of the preempted (their tables come again whole)."""
        for rid in output.finished_ids:
            self.requests.pop(rid, None)
        self.input_batch.remove(output.finished_ids)
        for new in output.new_requests:
            self.requests[new.request_id] = self._sampler_state(new)
        self.input_batch.remove(output.preempted)

    def _sampler_state(self, new: NewRequest) -> SamplerState:
        """The sampler state of a new request: its stream, its grammar, and what its penalties
        and ``min_tokens`` read (EOS and the stop ids are held back until ``min_tokens``)."""
        params = new.sampling_params
        assert params is not None and new.seed is not None, "the engine sends sampling params"
        held = set(params.stop_token_ids) | (set() if params.ignore_eos else
                                             set(self.eos_token_ids))
        state = SamplerState.create(params, new.seed, self.device, new.prompt_token_ids,
                                    sorted(held))
        if params.structured_outputs is not None:
            assert self.structured_outputs is not None
            state.grammar = self.structured_outputs.new_state(params)
        for token in new.output_token_ids:      # a request recovered mid-generation
            if state.grammar is not None:
                state.grammar.accept_token(token)
            if params.penalized:
                state.output_ids.append(token)
        if params.prompt_logprobs is not None and self.scorer is None:
            from kvlab.engine.prompt_logprobs import PromptScorer  # off the default path
            self.scorer = PromptScorer(self.requests, self.model, self.block_size,
                                       self.kernels)
        return state

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Run ``output``: copies, forward, sampling. ValueError (cache untouched) when a
        chunk's table does not cover it."""
        t0 = time.perf_counter()
        chunks, kernels = output.chunks, self.kernels
        last = self._last_tokens, self._last_row   # (overlap: what the step before sampled)
        self._last_tokens, self._last_row = None, {}
        self.update_requests(output)
        self.input_batch.apply(chunks, self.requests)
        meta = (self.input_batch.build(chunks, kernels.attention.paged_max_tokens) if chunks
                else None)
        if meta is not None:
            self._fill_placeholders(chunks, meta, *last)
        sampling = [i for i, c in enumerate(chunks) if c.sample]
        ids = [chunks[i].request_id for i in sampling]
        t1 = time.perf_counter()
        if output.copies:   # copy-on-write targets of this step, before any write
            self.cache.copy_blocks(output.copies)
        logits = torch.empty(0, self.model.cfg.vocab_size)
        if meta is not None:
            rows = torch.tensor([meta.last_row[i] for i in sampling], dtype=torch.long,
                                device=self.device)
            scored = self.scorer is not None and self.scorer.plan(chunks)
            graphed = self.graphs and not scored and self.graphs.fits(meta)
            h = (self.graphs(meta, rows) if graphed else
                 self.model(meta, self.cache.layers, kernels, rows=None if scored else rows))
            logits = self.model.logits(self.scorer.score(meta, h, rows) if scored else h)
        self._sync()
        t2 = time.perf_counter()
        states = [self.requests[rid] for rid in ids]
        if not states:
            picked = None
        else:
            filters = self.input_batch.row_params(ids)
            if any(s.grammar is not None for s in states):   # structured outputs in the batch
                picked = sample_with_grammars(logits, states,
                                              functools.partial(sample, rows=filters))
            else:
                picked = sample(logits, states, filters)
        t3 = time.perf_counter()
        if picked is not None:
            self._last_tokens, self._last_row = picked.tokens, {rid: i for i, rid in
                                                               enumerate(ids)}
        info = StepInfo(meta, ids, tuple(logits.shape), t1 - t0, t2 - t1, t3 - t2,
                        self.scorer and self.scorer.take())
        if picked is None:
            return ModelOutput({}, t3 - t0, info)
        return ModelOutput(
            {rid: (t,) for rid, t in zip(ids, picked.token_ids, strict=True)}, t3 - t0, info,
            {rid: [lp] for rid, lp in zip(ids, picked.logprobs, strict=True)},
            {rid: [top] for rid, top in zip(ids, picked.top_logprobs, strict=True)})

    def _fill_placeholders(self, chunks: Sequence[ScheduledChunk], meta: AttentionMetadata,
                           tokens: torch.Tensor | None, row_of: dict[str, int]) -> None:
        """Overlap scheduling: a decode planned while the step before was sampling its input
        carries a :data:`~kvlab.core.request.PLACEHOLDER` (only ever a chunk's last token);
        copy that step's sampled token (``tokens[row_of[request]]``) into its place, on the
        device: the token never goes through the host on its way to the next forward."""
        fill = [(meta.query_start[i + 1] - 1, c.request_id) for i, c in enumerate(chunks)
                if c.token_ids[-1] == PLACEHOLDER]
        if fill:
            assert tokens is not None and all(rid in row_of for _, rid in fill), \
                "a placeholder whose token the step before did not sample"
            rows = torch.tensor([r for r, _ in fill], dtype=torch.long, device=self.device)
            src = torch.tensor([row_of[rid] for _, rid in fill], dtype=torch.long,
                               device=self.device)
            meta.input_ids.index_copy_(0, rows, tokens.index_select(0, src))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
