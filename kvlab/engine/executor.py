"""TorchExecutor: runs a scheduler's decisions on the real model and the real KV tensors.

It is the :class:`~kvlab.core.engine_core.Executor` of the real engine, and the only place where
:mod:`kvlab.core` decisions touch tensors. Per step it

1. performs the copy-on-write ``copies`` on the cache (before any write of this step),
2. lays the chunks out as one flat batch (:func:`~kvlab.engine.attention.build_metadata`:
   positions and slot mappings from the chunks' block tables; a persistent
   :class:`~kvlab.engine.input_batch.InputBatch` keeps the tables across steps and applies
   per-step diffs),
3. runs the forward pass (which writes the new K/V through the slot mapping), and
4. samples one token from the logits of the last token of every chunk with ``sample=True``,
   with that request's :class:`~kvlab.engine.sampling.SamplerState`; rows with a grammar
   (structured outputs) are masked first and their grammar advanced by the token
   (:func:`~kvlab.engine.structured_outputs.bitmask.sample_with_grammars`).

The executor owns each running request's sampler state (parameters, RNG, grammar): the engine
hands it over once with :meth:`~TorchExecutor.add_request` and ends it with
:meth:`~TorchExecutor.remove_requests`; the executor never looks into the scheduler. It never
changes requests, queues or KV ownership; the scheduler does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvlab.core.engine_core import ModelOutput
from kvlab.core.scheduler_api import ScheduledChunk, SchedulerOutput

from . import cpu_kernels
from .attention import AttentionMetadata, ChunkSpec, Workspace
from .input_batch import InputBatch
from .kv_cache import PagedKVCache
from .model import LlamaModel
from .sampling import SamplerState, sample
from .structured_outputs.bitmask import sample_with_grammars

__all__ = ["ExecutorOutput", "StepInfo", "TorchExecutor"]


@dataclass
class ExecutorOutput:
    """Logits ``[S, V]`` (float32) for ``request_ids[i]``; the step's metadata; timings (s)."""

    request_ids: list[str]
    logits: torch.Tensor
    metadata: AttentionMetadata | None
    prepare_s: float = 0.0   # building index tensors (slot mapping, tables, masks)
    forward_s: float = 0.0   # copies + model forward + logits (device-synchronised)


@dataclass
class StepInfo:
    """Detail of one executed step (``ModelOutput.info``): the flat-batch ``metadata``, the
    sampled ``request_ids`` in logits-row order, ``logits_shape``, and per sampled request its
    raw log-probability and (if asked) its top-logprobs dict; timings in seconds."""

    metadata: AttentionMetadata | None
    request_ids: list[str]
    logits_shape: tuple[int, ...]
    logprobs: dict[str, float]
    top_logprobs: dict[str, dict[int, float] | None]
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class TorchExecutor:
    """Execute steps of ``model`` over ``cache`` (both on the same device).

    ``samplers`` holds the sampler state of every request the engine added and has not
    removed; a chunk that samples must belong to one of them.
    """

    def __init__(self, model: LlamaModel, cache: PagedKVCache):
        cfg = model.cfg
        if len(cache.layers) != cfg.num_layers or cache.data.shape[-2:] != (
                cfg.num_kv_heads, cfg.head_dim):
            raise ValueError("TorchExecutor: KV cache shape does not match the model")
        self.model = model
        self.cache = cache
        self.device = model.device
        self.block_size = cache.block_size
        self.workspace = Workspace(self.device, getattr(cache, "compute_dtype", cache.data.dtype))
        self.input_batch = InputBatch(self.block_size, self.device)
        self.samplers: dict[str, SamplerState] = {}
        if self.device.type == "cpu":
            cpu_kernels.available()   # build the attention kernel now, not in the first step

    def add_request(self, request_id: str, sampler: SamplerState) -> None:
        """Take over ``request_id``'s sampler state (once, when the engine adds it)."""
        assert request_id not in self.samplers, f"{request_id} added twice"
        self.samplers[request_id] = sampler

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Drop the state of requests that ended (unknown ids are ignored)."""
        for rid in request_ids:
            self.samplers.pop(rid, None)

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Run ``output`` (copies, forward, sampling); see the module docstring."""
        res = self.forward(output.chunks, output.copies)
        t0 = time.perf_counter()
        states = [self.samplers[rid] for rid in res.request_ids]
        if not states:
            picked = None
        elif any(s.grammar is not None for s in states):   # structured outputs in the batch
            picked = sample_with_grammars(res.logits, states, sample)
        else:
            picked = sample(res.logits, states)
        sample_s = time.perf_counter() - t0
        ids = res.request_ids
        info = StepInfo(
            res.metadata, ids, tuple(res.logits.shape),
            dict(zip(ids, picked.logprobs, strict=True)) if picked else {},
            dict(zip(ids, picked.top_logprobs, strict=True)) if picked else {},
            res.prepare_s, res.forward_s, sample_s)
        sampled = dict(zip(ids, picked.token_ids, strict=True)) if picked else {}
        return ModelOutput(sampled, res.prepare_s + res.forward_s + sample_s, info)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[ScheduledChunk],
                copies: Sequence[tuple[int, int]] = ()) -> ExecutorOutput:
        """Copies, then the forward pass over ``chunks``; the logits of the sampling rows.
        ValueError (cache untouched) when a chunk's table does not cover it."""
        t0 = time.perf_counter()
        meta = self.input_batch.build(
            [c.request_id for c in chunks],
            [ChunkSpec(c.token_ids, c.start_pos, c.block_table) for c in chunks],
            self.workspace) if chunks else None
        sample_idx = [i for i, c in enumerate(chunks) if c.sample]
        t1 = time.perf_counter()
        if copies:   # copy-on-write targets of this step, before any write
            self.cache.copy_blocks(copies)
        if meta is None:
            self._sync()
            return ExecutorOutput([], torch.empty(0, self.model.cfg.vocab_size), None,
                                  t1 - t0, time.perf_counter() - t1)
        rows = torch.tensor([meta.last_row[i] for i in sample_idx], dtype=torch.long,
                            device=self.device)
        hidden = self.model(meta, self.cache.layers, rows=rows)
        logits = self.model.logits(hidden)
        self._sync()
        t2 = time.perf_counter()
        return ExecutorOutput([chunks[i].request_id for i in sample_idx], logits, meta,
                              t1 - t0, t2 - t1)
