"""Roofline cost of one engine step of a named model on a named GPU (no torch).

A step runs the model once over every scheduled token. Its time is modelled as

    t = max(FLOPs / (peak FLOP/s * compute_efficiency), bytes / (HBM bandwidth * bw_efficiency))
        + fixed overhead

with, for a batch of chunks (``n`` tokens of a request at positions ``[s, s + n)``):

* FLOPs: ``2 * P_dense * n`` for the weight matrices of every layer (``P_dense`` = parameters
  without the embedding/LM head), ``2 * hidden * vocab`` per position whose logits are computed
  (the LM head), and ``4 * layers * heads * head_dim * sum(context)`` for attention (QK^T and AV
  over each token's context ``p + 1``);
* bytes: all weights once per step, plus the KV cache each chunk reads (its whole context,
  ``2 * layers * kv_heads * head_dim * dtype_bytes`` per token) and writes (its ``n`` tokens).

A scheduled chunk with ``num_lookahead = L`` lookahead slots (speculative decoding,
:mod:`kvlab.core.spec_plan`) is verified in the same forward: it runs ``n + L`` query tokens
and computes logits at its last ``L + 1`` positions (:meth:`RooflineCostModel.step_cost`).
The proposer's own forwards are not part of the target's step; price them with the draft
model's cost model. :func:`speculative_step_cost` prices a whole speculative step that way and
carries the scenario's memory identity (:func:`speculative_memory`: both models' weights and KV
against the GPUs' memory), so a scenario that cannot be deployed is visible as such.

With tensor parallelism over ``tp`` GPUs (Megatron-style: every weight matrix split ``tp``
ways, KV heads split across GPUs) the FLOPs and bytes are shared by ``tp`` GPUs, so both roofs
scale by ``tp``, and each layer adds two all-reduces of the step's activations
(``tokens * hidden * dtype_bytes``), each costing ``2 (tp - 1) / tp`` of that over the GPU's
link bandwidth (ring all-reduce; NVLink 4 by default) plus a fixed latency.

Activations, other communication and kernel inefficiencies other than the two efficiency
factors are ignored; the fixed overhead stands for kernel launches, sampling and the scheduler
itself. It is a first-order model: good for comparing schedules (which batch shapes cost
what), not for predicting a real engine's latency to a few percent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvlab.core.step_records import ScheduledChunk
from kvlab.sim.catalog import GPUSpec, ModelShape, dtype_bytes, get_gpu, get_model


@dataclass(frozen=True)
class StepCost:
    """One step's modelled cost. Times in seconds."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    overhead_s: float
    comm_s: float = 0.0       # tensor-parallel all-reduces (0 at tp=1)

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        """"compute" or "memory": which roof the step hits."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class RooflineCostModel:
    """Step time of ``model`` on ``gpu`` (names from :mod:`kvlab.sim.catalog`) in ``dtype``.

    ``overhead_s``: fixed cost per step (default 0.5 ms, an assumption, not a measurement).
    ``compute_efficiency`` / ``bandwidth_efficiency``: the fraction of peak reached (default 1:
    the pure roofline). ``tp``: tensor-parallel degree (GPUs per instance);
    ``link_bandwidth``: bytes/s each GPU sends to its peers (default 450 GB/s, NVLink 4 per
    direction on an H100 SXM); ``allreduce_latency_s``: fixed cost of one all-reduce.
    """

    model: ModelShape
    gpu: GPUSpec
    dtype: str = "bf16"
    overhead_s: float = 0.5e-3
    compute_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    tp: int = 1
    link_bandwidth: float = 450e9
    allreduce_latency_s: float = 8e-6

    @classmethod
    def named(cls, model: str, gpu: str, **kw) -> RooflineCostModel:
        return cls(get_model(model), get_gpu(gpu), **kw)

    def __post_init__(self) -> None:
        if self.overhead_s < 0:
            raise ValueError("overhead_s must be >= 0")
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {self.tp!r}")
        if self.model.heads % self.tp:
            raise ValueError(f"tp={self.tp} must divide the {self.model.heads} attention heads "
                             f"of {self.model.name}")
        if not self.link_bandwidth > 0 or self.allreduce_latency_s < 0:
            raise ValueError("link_bandwidth must be > 0 and allreduce_latency_s >= 0")

    # -- per-token constants ------------------------------------------------------------------

    @property
    def element_bytes(self) -> float:
        return dtype_bytes(self.dtype)

    @property
    def dense_params(self) -> int:
        """Parameters multiplied per token in the layers (embedding and LM head excluded)."""
        m = self.model
        embed = m.vocab * m.hidden * (1 if m.tie_word_embeddings else 2)
        return m.params - embed

    @property
    def kv_bytes_per_token(self) -> float:
        m = self.model
        return 2 * m.layers * m.kv_heads * m.head_dim * self.element_bytes

    @property
    def weight_bytes(self) -> float:
        return self.model.params * self.element_bytes

    # -- costs --------------------------------------------------------------------------------

    def cost(self, work: Iterable[tuple[int, int, bool | int]]) -> StepCost:
        """Cost of chunks given as ``(num_tokens, start_pos, samples)`` triples.

        ``samples``: how many of the chunk's last positions compute logits (the LM head):
        ``False``/``True`` for 0/1, or an int in ``0 .. num_tokens`` (a verification chunk of
        ``k`` drafts computes ``k + 1``). ValueError for an empty chunk, a negative position
        or a ``samples`` outside that range.
        """
        m = self.model
        tokens = sampled = 0
        context_sum = 0
        kv_tokens_read = 0
        for n, start, samples in work:
            if n <= 0 or start < 0:
                raise ValueError(f"bad chunk: {n} tokens at position {start}")
            if not 0 <= int(samples) <= n:
                raise ValueError(f"bad chunk: {samples!r} sampled positions of {n} tokens")
            tokens += n
            sampled += int(samples)
            # sum over p in [start, start + n) of (p + 1)
            context_sum += n * start + n * (n + 1) // 2
            kv_tokens_read += start + n
        flops = (2.0 * self.dense_params * tokens + 2.0 * m.hidden * m.vocab * sampled
                 + 4.0 * m.layers * m.heads * m.head_dim * context_sum)
        moved = (self.weight_bytes if tokens else 0.0) + self.kv_bytes_per_token * (
            kv_tokens_read + tokens)
        compute_s = flops / (self.gpu.bf16_tflops * 1e12 * self.compute_efficiency * self.tp)
        memory_s = moved / (self.gpu.hbm_bandwidth * self.bandwidth_efficiency * self.tp)
        comm_s = 0.0
        if self.tp > 1 and tokens:
            volume = tokens * m.hidden * self.element_bytes * 2 * (self.tp - 1) / self.tp
            comm_s = 2 * m.layers * (volume / self.link_bandwidth + self.allreduce_latency_s)
        return StepCost(flops, moved, compute_s, memory_s, self.overhead_s if tokens else 0.0,
                        comm_s)

    def step_cost(self, chunks: Sequence[ScheduledChunk],
                  padding: Sequence[tuple[int, int]] = ()) -> StepCost:
        """Cost of a scheduler step; ``padding`` adds ``(num_tokens, start_pos)`` dummy work
        (slots a static batch computes for requests that already finished).

        A chunk's lookahead slots are verified in this step's forward, so a chunk costs its
        :attr:`~kvlab.core.step_records.ScheduledChunk.num_query_tokens` (tokens plus
        lookahead) and, when it samples, ``num_lookahead + 1`` LM-head rows.
        """
        work = [(c.num_query_tokens, c.start_pos, (c.num_lookahead + 1) if c.sample else 0)
                for c in chunks]
        work += [(n, s, False) for n, s in padding if n > 0]
        return self.cost(work)

    def kv_blocks(self, block_size: int, memory_fraction: float = 0.9) -> int:
        """KV blocks that fit in the memory of the instance's ``tp`` GPUs after the weights
        (``memory_fraction`` of it usable), for sizing a simulated pool. The memory is what
        CUDA reports where the catalogue records it (vLLM multiplies that total by
        ``gpu_memory_utilization``), else the datasheet label read as decimal GB."""
        free = self.tp * self.gpu.engine_memory_bytes * memory_fraction - self.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} weights do not fit on {self.tp} x "
                             f"{self.gpu.name}")
        return int(free // (self.kv_bytes_per_token * block_size))


@dataclass(frozen=True)
class SpecStepCost:
    """One speculative step of ``batch`` decoding requests with ``k`` drafts each, against a
    plain decode step of the same batch. Times in seconds, memory in bytes."""

    batch: int
    k: int
    alpha: float
    draft_forwards: int
    decode_s: float          # the target's plain decode step (1 token per request)
    verify_s: float          # the target's verification step (1 + k tokens per request)
    draft_s: float           # the proposer's forwards, all of them
    verify_bound: str        # "compute" or "memory": the roof the verification hits
    memory_bytes: float      # both models' weights + both KV caches (speculative_memory)
    memory_capacity: float   # what the instance's GPUs may use (speculative_memory)

    @property
    def expected_tokens(self) -> float:
        """Tokens a request emits per step if each draft is kept independently with
        probability ``alpha`` (Leviathan et al. 2023, §3): ``sum_{i=0..k} alpha^i``."""
        return sum(self.alpha ** i for i in range(self.k + 1))

    @property
    def speedup(self) -> float:
        """Tokens per second with speculation over tokens per second without."""
        return self.expected_tokens * self.decode_s / (self.verify_s + self.draft_s)

    @property
    def fits(self) -> bool:
        """Whether the scenario's weights and KV fit the instance's memory."""
        return self.memory_bytes <= self.memory_capacity


@dataclass(frozen=True)
class SpecMemory:
    """What a speculative deployment holds (bytes): ``weights`` (target + draft), ``per_request``
    (both KV caches for one request, in whole blocks) and ``capacity`` (the usable memory of the
    instance). ``needed(batch)`` is ``weights + batch * per_request``."""

    weights: float
    per_request: float
    capacity: float

    def needed(self, batch: int) -> float:
        return self.weights + batch * self.per_request

    @property
    def max_batch(self) -> int:
        """The largest batch whose weights and KV fit (0 when the weights alone do not)."""
        return max(0, int((self.capacity - self.weights) // self.per_request))


def speculative_memory(target: RooflineCostModel, draft: RooflineCostModel, *, context: int,
                       k: int, block_size: int = 16,
                       gpu_memory_utilization: float = 0.9) -> SpecMemory:
    """The memory identity of a speculative deployment, as chapter 1's planner sizes a pool.

    Target and draft share the instance (the same GPUs and tensor-parallel degree: vLLM
    requires the draft's TP to equal the target's) and, as in kvlab and vLLM, the same block
    tables, so each request holds KV in both models for its ``context`` tokens, the token
    being decoded and its ``k`` lookahead slots, rounded up to whole blocks of ``block_size``.
    The instance may use ``gpu_memory_utilization`` of its GPUs' memory (0.9 by default, kvlab's
    assumption; vLLM 0.32's default is 0.92), of the total CUDA reports
    (:attr:`~kvlab.sim.catalog.GPUSpec.engine_memory_bytes`);
    activations and CUDA graphs are not counted. ValueError when the two models are not on the
    same GPUs, or for a bad context, ``k``, block size or utilization.
    """
    if draft.gpu != target.gpu or draft.tp != target.tp:
        raise ValueError(f"the draft must share the target's GPUs: {draft.tp} x {draft.gpu.name}"
                         f" against {target.tp} x {target.gpu.name}")
    for name, value, low in (("context", context, 0), ("k", k, 0), ("block_size", block_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                         f"got {gpu_memory_utilization!r}")
    blocks = -(-(context + 1 + k) // block_size)
    per_request = blocks * block_size * (target.kv_bytes_per_token + draft.kv_bytes_per_token)
    capacity = target.tp * target.gpu.engine_memory_bytes * gpu_memory_utilization
    return SpecMemory(target.weight_bytes + draft.weight_bytes, per_request, capacity)


def speculative_step_cost(target: RooflineCostModel, draft: RooflineCostModel, *, batch: int,
                          k: int, alpha: float, context: int,
                          draft_forwards: int | None = None) -> SpecStepCost:
    """Price one speculative step on the roofline: ``batch`` requests at ``context`` tokens of
    context, each verifying ``k`` drafts (a decode chunk with ``k`` lookahead slots, priced by
    :meth:`RooflineCostModel.step_cost`) after the ``draft`` model ran ``draft_forwards``
    batched single-token forwards (default ``k + 1``, kvlab's proposer: the last one only
    writes the final draft's KV; a proposer that leaves that write to the next step runs
    ``k``). The result also carries the scenario's memory (:func:`speculative_memory`): check
    :attr:`SpecStepCost.fits` before reading a time. ValueError for a batch or ``k`` below 1,
    ``alpha`` outside ``[0, 1]``, a negative context, fewer than ``k`` draft forwards, or a
    draft on other GPUs than the target's.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an int >= 0, got {context!r}")
    forwards = k + 1 if draft_forwards is None else draft_forwards
    if isinstance(forwards, bool) or not isinstance(forwards, int) or forwards < k:
        raise ValueError(f"draft_forwards must be an int >= k = {k}, got {draft_forwards!r}")
    memory = speculative_memory(target, draft, context=context, k=k)
    decode = target.cost([(1, context, True)] * batch)
    chunks = [ScheduledChunk(str(i), (0,), context, (), True, False, num_lookahead=k)
              for i in range(batch)]
    verify = target.step_cost(chunks)
    draft_s = sum(draft.cost([(1, context + j, j < k)] * batch).seconds
                  for j in range(forwards))
    return SpecStepCost(batch, k, float(alpha), forwards, decode.seconds, verify.seconds,
                        draft_s, verify.bound, memory.needed(batch), memory.capacity)
