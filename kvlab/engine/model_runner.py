"""ModelRunner: the real engine's executor, where scheduler decisions touch tensors. Per step:
copy-on-write copies first, the chunks' table deltas into the persistent :class:`InputBatch`,
the metadata from its rows, one forward (which writes the new K/V), one token per sampling
chunk. It owns each running request's sampler state and never looks into the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvlab.core.engine_core import ModelOutput, ScheduledChunk, SchedulerOutput
from kvlab.core.request import RuntimeRequest
from kvlab.kernels import row_kernel

from .attention import AttentionMetadata, RowKernel, flat_metadata
from .kv_cache import PagedKVCache
from .model import LlamaModel
from .sampler import SamplerState, sample
from .structured_outputs.bitmask import sample_with_grammars

__all__ = ["InputBatch", "ModelRunner", "StepInfo"]


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
    """Execute steps of ``model`` over ``cache`` (one device). ``samplers``: the state of every
    request added and not removed; a chunk that samples belongs to one of them."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache):
        cfg = model.cfg
        if len(cache.layers) != cfg.num_layers or cache.data.shape[-2:] != (
                cfg.num_kv_heads, cfg.head_dim):
            raise ValueError("ModelRunner: KV cache shape does not match the model")
        self.model, self.cache = model, cache
        self.device, self.block_size = model.device, cache.block_size
        # the paged rows' attention op, chosen (and compiled) once, not per step
        self.kernel = row_kernel(self.device, getattr(cache, "compute_dtype", cache.data.dtype))
        self.input_batch = InputBatch(self.block_size, self.device)
        self.samplers: dict[str, SamplerState] = {}
        self.scorer = None   # a PromptScorer once a request asks for prompt logprobs
        self.graphs = None   # CUDA-graph decode (engine/cuda_graphs.py), set at engine build

    def add_request(self, request: RuntimeRequest, sampler: SamplerState) -> None:
        """Take over ``request``'s sampler state (sent once, when the engine adds it)."""
        assert request.request_id not in self.samplers, f"{request.request_id} added twice"
        self.samplers[request.request_id] = sampler
        if sampler.params.prompt_logprobs is not None and self.scorer is None:
            from .prompt_logprobs import PromptScorer  # off the default path
            self.scorer = PromptScorer(self)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Drop the state of requests that ended (unknown ids are ignored)."""
        request_ids = list(request_ids)
        for rid in request_ids:
            self.samplers.pop(rid, None)
        self.input_batch.remove(request_ids)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Run ``output``: copies, forward, sampling. ValueError (cache untouched) when a
        chunk's table does not cover it."""
        t0 = time.perf_counter()
        chunks = output.chunks
        self.input_batch.remove(output.preempted)   # their tables are resent whole on resume
        self.input_batch.apply(chunks)
        meta = self.input_batch.build(chunks, self.kernel) if chunks else None
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
            h = (self.graphs if graphed else self.model)(meta, self.cache.layers,
                                                         rows=None if scored else rows)
            logits = self.model.logits(self.scorer.score(meta, h, rows) if scored else h)
        self._sync()
        t2 = time.perf_counter()
        states = [self.samplers[rid] for rid in ids]
        if not states:
            picked = None
        elif any(s.grammar is not None for s in states):   # structured outputs in the batch
            picked = sample_with_grammars(logits, states, sample)
        else:
            picked = sample(logits, states)
        t3 = time.perf_counter()
        info = StepInfo(meta, ids, tuple(logits.shape), t1 - t0, t2 - t1, t3 - t2,
                        self.scorer and self.scorer.take())
        if picked is None:
            return ModelOutput({}, t3 - t0, info)
        return ModelOutput(
            {rid: (t,) for rid, t in zip(ids, picked.token_ids, strict=True)}, t3 - t0, info,
            {rid: [lp] for rid, lp in zip(ids, picked.logprobs, strict=True)},
            {rid: [top] for rid, top in zip(ids, picked.top_logprobs, strict=True)})

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class InputBatch:
    """The runner's block tables: one persistent row per running request, kept from the chunks'
    deltas alone (made by its first chunk, dropped on preemption or removal); grows on demand."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu",
                 max_rows: int = 64, max_blocks: int = 64):
        self.block_size, self.device = block_size, torch.device(device)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.long)
        self._row_of: dict[str, int] = {}
        self._len: dict[str, int] = {}            # table length of each row's request
        self._free = list(range(max_rows - 1, -1, -1))
        self.entries_written = 0                  # table entries written, over all steps

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    def row_ids(self) -> set[str]:
        """The requests that have a row."""
        return set(self._row_of)

    def table(self, request_id: str) -> list[int]:
        """The runner's copy of ``request_id``'s block table."""
        return self.tables[self._row_of[request_id], :self._len[request_id]].tolist()

    @torch.inference_mode()
    def remove(self, request_ids: Iterable[str]) -> None:
        """Drop the rows of ``request_ids`` (unknown ids are ignored)."""
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self.tables[row, :self._len.pop(rid)] = 0   # free rows are all padding
                self._free.append(row)

    @torch.inference_mode()
    def apply(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Apply each chunk's table delta. ValueError (nothing stored) for a delta that keeps
        more entries than the row has, or a first chunk that keeps any."""
        for c in chunks:
            have = self._len.get(c.request_id)
            if c.num_kept_blocks > (have or 0):
                raise ValueError(f"{c.request_id!r}: the delta keeps {c.num_kept_blocks} table "
                                 f"entries, the runner has {have or 0}")
        need = max((c.num_kept_blocks + len(c.new_block_ids) for c in chunks), default=0)
        rows = sum(c.request_id not in self._row_of for c in chunks)
        width = self.tables.shape[1]
        if need > width or rows > len(self._free):
            old_rows, old_width = self.tables.shape
            grown = torch.zeros(max(old_rows, self.num_rows + rows),
                                max(old_width, 2 * old_width if need > old_width else 0, need),
                                dtype=torch.long)
            grown[:old_rows, :old_width] = self.tables
            self.tables = grown
            self._free.extend(range(grown.shape[0] - 1, old_rows - 1, -1))
        for c in chunks:
            row = self._row_of.get(c.request_id)
            if row is None:
                row = self._row_of[c.request_id] = self._free.pop()
            kept, new = c.num_kept_blocks, c.new_block_ids
            if new:
                self.tables[row, kept:kept + len(new)] = torch.tensor(new, dtype=torch.long)
                self.entries_written += len(new)
            n, before = kept + len(new), self._len.get(c.request_id, 0)
            if n < before:                      # a rollback cut the tail: pad with 0 again
                self.tables[row, n:before] = 0
            self._len[c.request_id] = n

    def build(self, chunks: Sequence[ScheduledChunk], kernel: RowKernel | None = None
              ) -> AttentionMetadata:
        """The step's metadata from the rows, with tensor operations (:meth:`apply` the
        step's deltas first). ValueError (nothing computed) when a chunk is empty or its row's
        table does not cover it."""
        for c in chunks:
            end, have = c.start_pos + len(c.token_ids), self._len[c.request_id]
            if len(c.token_ids) == 0:
                raise ValueError(f"{c.request_id!r}: a chunk with no tokens")
            if c.start_pos < 0 or have * self.block_size < end:
                raise ValueError(f"{c.request_id!r}: its table ({have} blocks of "
                                 f"{self.block_size}) does not cover positions "
                                 f"{c.start_pos}..{end - 1}")
        rows = torch.tensor([self._row_of[c.request_id] for c in chunks], dtype=torch.long)
        return flat_metadata([c.token_ids for c in chunks], [c.start_pos for c in chunks],
                             self.tables.index_select(0, rows), self.block_size, self.device,
                             kernel)
