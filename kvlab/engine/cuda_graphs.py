"""CUDA-graph decode: the decode forward captured once per padded batch size, then replayed.

A decode step of a small model on a GPU is bound by kernel launches, not by memory: each of
its ~700 kernels costs the host a few microseconds to launch and the GPU only a few to run. A
CUDA graph records the whole forward's kernels once and launches them all with one call. The
recording fixes every kernel's arguments, so the inputs must live in *static buffers* whose
addresses never change; each step copies its batch into them and replays. A graph also fixes
the batch size, so :class:`DecodeGraphs` captures a *ladder* of sizes and pads each batch up
to the next one (:func:`padded_size`).

What is captured: ``model(meta, kv_layers, kernels)`` over rows of one token each (every chunk a
decode), with the step's flat metadata (:class:`~kvlab.engine.attention_metadata.AttentionMetadata`)
pointing into the static buffers: token ids, positions, slot mapping, block tables and
sequence lengths, sized for the largest size and ``ceil(max_model_len / block_size)`` table
columns. The final-normed hidden states land in a static output buffer; the runner selects the
sampling rows and computes logits outside the graph. Padded rows carry token 0 at position 0,
write their K/V to a *scratch block* (one block past the KV cache manager's, which it never
hands out) and attend only that slot, so they never touch a live block. Prefill, mixed steps,
prompt-logprob steps and batches above the ladder run eagerly.

As in vLLM v1 (``vllm/v1/worker/gpu_model_runner.py``, ``vllm/compilation/cuda_graph.py``'s
``CUDAGraphWrapper``, ``vllm/v1/cudagraph_dispatcher.py``, v0.32.0) and nano-vllm
(``nanovllm/engine/model_runner.py``'s ``capture_cudagraph`` / ``run_model``): persistent
input buffers, the largest size captured first so the smaller graphs share its memory pool, a
batch padded to the next captured size, eager execution above the largest. vLLM pads the slot
mapping with -1, which its cache-write kernels skip; kvlab's writes have no such case (CPU's
``index_copy_`` rejects it), hence the scratch block.

On CPU there are no graphs: :class:`EagerCapture` stands in for :class:`CudaGraphCapture` and
"replays" by running the captured callable again through the same static buffers, so the
padding, the buffer reuse and the scratch writes are tested without a GPU.
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvlab.engine.attention_metadata import AttentionMetadata
from kvlab.engine.model import LlamaModel
from kvlab.engine.ops import Kernels

__all__ = ["MAX_CAPTURE_SIZE", "CudaGraphCapture", "DecodeGraphs", "EagerCapture",
           "GraphCounter", "capture_sizes", "counter", "padded_size"]

#: The largest batch captured by default (vLLM's default ceiling, ``vllm/config/vllm.py``
#: ``_set_cudagraph_sizes``, v0.32.0); larger decode batches run eagerly.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int | None = None) -> tuple[int, ...]:
    """The ladder of batch sizes to capture: vLLM's default pattern ``1, 2, 4``, multiples of 8
    below 256, multiples of 16 from 256, cut at ``min(max_num_seqs, limit)`` (default
    :data:`MAX_CAPTURE_SIZE`), that size itself included (vLLM cuts its default ladder at
    ``min(2 * max_num_seqs, 512)``, ``vllm/config/vllm.py``). ValueError for a size below 1."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE if limit is None else limit)
    if top < 1:
        raise ValueError(f"capture_sizes: the largest size must be >= 1, got {top}")
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return (*(s for s in ladder if s < top), top)


def padded_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``n`` rows; None above the ladder."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class GraphCounter:
    """Process-wide counts (as vLLM's ``compilation_counter``): graphs captured, steps replayed,
    decode steps that fell back to eager because the batch was above the ladder, and why the
    last engine's capture failed (None when it succeeded; the engine then decodes eagerly)."""

    captured: int = 0
    replayed: int = 0
    too_large: int = 0
    capture_error: str | None = None


counter = GraphCounter()


class Capture(Protocol):
    """A recorded callable: ``replay()`` reruns it on whatever its static buffers hold."""

    pool: object

    def replay(self) -> None: ...


class EagerCapture:
    """The CPU stand-in for a CUDA graph: runs ``fn`` once at capture, and again per replay."""

    def __init__(self, fn: Callable[[], None], pool: object = None):
        self.fn, self.pool = fn, pool
        fn()

    def replay(self) -> None:
        self.fn()


class CudaGraphCapture:
    """``fn`` recorded into a ``torch.cuda.CUDAGraph`` (after one warm-up run on a side stream,
    which compiles Triton kernels and sets up cuBLAS), in the shared memory ``pool``."""

    def __init__(self, fn: Callable[[], None], pool: object = None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn()
        self.pool = self.graph.pool()

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """Decode forwards of ``model`` over ``kv_layers`` captured at each of ``sizes``.

    ``scratch_block``: a block of the cache no request ever owns (padded rows write there).
    ``max_model_len`` sizes the tables (``ceil(max_model_len / block_size)`` columns) and bounds
    the positions; ``kernels``: the runner's. ``capture``: :class:`CudaGraphCapture`
    on CUDA, :class:`EagerCapture` elsewhere (the default follows the model's device)."""

    def __init__(self, model: LlamaModel, kv_layers: Sequence, kernels: Kernels, *,
                 sizes: Sequence[int], block_size: int, max_model_len: int, scratch_block: int,
                 capture: type[EagerCapture] | type[CudaGraphCapture] | None = None):
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"DecodeGraphs: sizes must be ascending positive ints, got "
                             f"{list(sizes)}")
        dev = model.device
        if capture is None:
            capture = CudaGraphCapture if dev.type == "cuda" else EagerCapture
        self.model, self.kv_layers, self.kernels = model, kv_layers, kernels
        self.sizes = tuple(sizes)
        self.scratch_slot = scratch_block * block_size
        self.scratch_block, self.max_model_len = scratch_block, max_model_len
        top, width = self.sizes[-1], -(-max_model_len // block_size)
        with torch.inference_mode():
            long = functools.partial(torch.zeros, dtype=torch.long, device=dev)
            self.input_ids, self.positions = long(top), long(top)
            self.slot_mapping = long(top).fill_(self.scratch_slot)
            self.block_tables = long(top, width).fill_(scratch_block)
            self.seq_lens = long(top).fill_(1)
            self.rows = torch.arange(top, device=dev)
            self.hidden = torch.zeros(top, model.cfg.hidden_size, dtype=model.dtype, device=dev)
            self._live = 0          # rows [0, _live) hold the last replayed batch's requests
            self.graphs: dict[int, Capture] = {}
            pool = None
            for b in reversed(self.sizes):   # largest first: the others reuse its pool
                graph = capture(functools.partial(self._forward, self._metadata(b)), pool)
                self.graphs[b], pool = graph, graph.pool
                counter.captured += 1

    def _metadata(self, b: int) -> AttentionMetadata:
        """The static metadata of ``b`` single-token rows: views of the buffers. Its start
        positions are a bound on every position (``max_model_len - 1``), all the forward reads
        of them (``max_position``, which selects the RoPE table)."""
        return AttentionMetadata(
            input_ids=self.input_ids[:b], positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            query_start=tuple(range(b + 1)), start_pos=(self.max_model_len - 1,) * b,
            paged_rows=self.rows[:b], paged_tables=self.block_tables[:b],
            paged_lens=self.seq_lens[:b], dense=())

    def _forward(self, meta: AttentionMetadata) -> None:
        b = meta.num_tokens
        self.hidden[:b].copy_(self.model(meta, self.kv_layers, self.kernels))

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether ``meta`` is a decode step a captured graph can run: one token per chunk, at
        most the largest size (counted in :data:`counter` when above)."""
        n = meta.num_tokens
        if n != len(meta.start_pos):
            return False
        if n > self.sizes[-1]:
            counter.too_large += 1
            return False
        return True

    def __call__(self, meta: AttentionMetadata, rows: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """:meth:`LlamaModel.forward <kvlab.engine.model.LlamaModel.forward>` of a step that
        :meth:`fits`, over the captured KV layers with the captured kernels: the final-normed
        hidden states of ``rows`` (all when None). The inputs are copied into the buffers, rows
        a larger batch left become padding again, and the padded size's graph replays."""
        n = meta.num_tokens
        b = padded_size(self.sizes, n)
        assert b is not None and n == len(meta.start_pos), "call fits() first"
        self.input_ids[:n].copy_(meta.input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :meta.paged_tables.shape[1]].copy_(meta.paged_tables)
        self.seq_lens[:n].copy_(meta.paged_lens)
        if self._live > n:          # rows a larger batch held: padding again
            self._pad(n, self._live)
        self._live = n
        self.graphs[b].replay()
        counter.replayed += 1
        return self.hidden.index_select(0, self.rows[:n] if rows is None else rows)

    def _pad(self, lo: int, hi: int) -> None:
        """Rows ``lo .. hi-1`` become padding: token 0 at position 0 in the scratch slot."""
        self.input_ids[lo:hi] = 0
        self.positions[lo:hi] = 0
        self.slot_mapping[lo:hi] = self.scratch_slot
        self.block_tables[lo:hi] = self.scratch_block
        self.seq_lens[lo:hi] = 1
