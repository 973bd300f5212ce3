"""TorchExecutor: runs a scheduler's decisions on the real model and the real KV tensors.

The executor is the only place where :mod:`kvlab.core` decisions touch tensors. Per step it

1. performs the copy-on-write ``copies`` on the cache (before any write of this step),
2. lays the chunks out as one flat batch (:func:`~kvlab.engine.attention.build_metadata`:
   positions and slot mappings from the chunks' block tables),
3. runs the forward pass (which writes the new K/V through the slot mapping), and
4. returns the logits of the last token of every chunk with ``sample=True``.

It knows nothing of requests' sampling parameters or lifecycles; the engine does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.core.scheduler_api import ScheduledChunk

from .attention import AttentionMetadata, ChunkSpec, Workspace, build_metadata
from .kv_cache import PagedKVCache
from .model import LlamaModel

__all__ = ["ExecutorOutput", "TorchExecutor"]


@dataclass
class ExecutorOutput:
    """Logits ``[S, V]`` (float32) for ``request_ids[i]``; the step's metadata; timings (s)."""

    request_ids: list[str]
    logits: torch.Tensor
    metadata: AttentionMetadata | None
    prepare_s: float = 0.0   # building index tensors (slot mapping, tables, masks)
    forward_s: float = 0.0   # copies + model forward + logits (device-synchronised)


class TorchExecutor:
    """Execute steps of ``model`` over ``cache`` (both on the same device)."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache):
        cfg = model.cfg
        if len(cache.layers) != cfg.num_layers or cache.data.shape[-2:] != (
                cfg.num_kv_heads, cfg.head_dim):
            raise ValueError("TorchExecutor: KV cache shape does not match the model")
        self.model = model
        self.cache = cache
        self.device = model.device
        self.block_size = cache.block_size
        self.workspace = Workspace(self.device, cache.data.dtype)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk],
                copies: Sequence[tuple[int, int]] = ()) -> ExecutorOutput:
        """Run one step; ValueError (cache untouched) when a chunk's table does not cover it."""
        t0 = time.perf_counter()
        meta = build_metadata(
            [ChunkSpec(c.token_ids, c.start_pos, c.block_table) for c in chunks],
            self.block_size, self.device, self.workspace) if chunks else None
        sample_idx = [i for i, c in enumerate(chunks) if c.sample]
        t1 = time.perf_counter()
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
