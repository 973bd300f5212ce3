"""Capacity planning for models whose layers cache different things (production side of the
per-layer rule in :mod:`kvlab.labs.capacity.layer_kv`).

One GPU's KV pool is cut into blocks of one size, as vLLM v1's hybrid KV cache manager cuts it
(vLLM 0.32.0; the files are named where each step happens):

1. **Pages per layer** (``vllm/v1/kv_cache_interface.py``): an attention layer's page holds
   ``block_size`` tokens of ``heads × (K width + V width)`` elements (``AttentionSpec
   .page_size_bytes``; an MLA layer has one "head", the latent, and no V: ``MLAAttentionSpec``
   sets ``head_size_v = 0``); a recurrent layer's page is its whole state
   (``MambaSpec.page_size_bytes``: the sum of its state tensors).
2. **One page size** (``vllm/platforms/interface.py``, ``Platform._align_hybrid_block_size``):
   with recurrent layers, the attention block grows to the smallest multiple of the kernel block
   whose page holds a state, and the state page is padded to it. The kernel block is the
   attention backend's: 16 tokens for FlashAttention on an H100 (``MultipleOf(16)``); on
   Blackwell (compute capability 10 or 11) FA4's head-dim-256 kernel asks for 128
   (``FA4_HD256_PAGE_SIZE`` in ``vllm/v1/attention/backends/fa_utils.py``), a planner input
   here (``kernel_block``). Then ``unify_kv_cache_spec_page_size``
   (``vllm/v1/core/kv_cache_utils.py``) gives layers with a smaller page more tokens per block
   when the ratio is whole, else pads.
3. **Groups** (``_get_kv_cache_groups_uniform_page_size``): layers of one kind form groups of
   equal size, the smallest kind's layer count (the largest when it is under 1.5× the
   smallest); a kind whose count is not a multiple gets padding slots. Every group draws blocks
   from the one pool, and a block is one page in each layer of a group, so a block costs
   ``group size × page`` bytes (``_get_kv_cache_bytes_per_block``).
4. **Blocks per request** (the specs' ``max_admission_blocks_per_request`` /
   ``max_memory_usage_bytes``): a full or MLA group needs ``ceil(T / block)`` blocks for ``T``
   tokens; a sliding group the blocks of ``W − 1`` tokens plus the tokens in flight, plus one for
   a window that starts inside a block (never more than a full group would hold); a recurrent
   group one state block (two with prefix caching: vLLM's "align" mode keeps the last
   checkpoint beside the running state).

Tokens in flight: ``in_flight_tokens=1`` is the **steady-decode packing**, every request
decoding and each window's blocks freed as it slides. vLLM 0.32 counts more conservatively: it
calls ``SlidingWindowSpec.max_admission_blocks_per_request`` with
``VllmConfig.max_in_flight_tokens`` (``vllm/config/vllm.py``), ``max_concurrent_batches ×
max_num_batched_tokens``, for the start-up pool sizing and the "maximum concurrency" it logs
(``get_kv_cache_capacity``) and as each request's admission cap. :func:`max_in_flight_tokens`
gives that bound (16,384 for ``vllm serve`` on an H100); a plan made with it is vLLM's count
(one block more per windowed group where the window and the tokens in flight cover the whole
request: :meth:`KVGroup.blocks_per_request`).

Parallelism: with tensor parallelism ``tp`` a rank keeps ``ceil(kv_heads / tp)`` KV heads (at
least one, ch. 1), its share of each recurrent state (heads split), and the **whole** MLA latent:
the latent has no head dimension to split, so every rank holds all of it
(``ModelConfig.get_num_kv_heads`` returns 1 for MLA whatever the TP size). Data-parallel
attention (``dp`` replicas) gives each replica its own requests and its own pool, so a
deployment of ``tp × dp`` GPUs holds ``dp`` times one pool's requests; the weights each GPU then
holds depend on how experts and dense layers are split, so they are an input (``weight_bytes``,
per GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from kvlab.labs.capacity import PoolBudget, kv_heads_per_rank
from kvlab.labs.capacity.hf_config import ModelLayout
from kvlab.labs.capacity.layer_kv import LayerKV
from kvlab.sim.catalog import GPUSpec, dtype_bytes

__all__ = ["GiB", "KVGroup", "LayoutPlan", "bytes_by_layer", "hybrid_block_size",
           "max_in_flight_tokens", "plan_layout"]

GiB = 2**30

#: Minimum kernel block of vLLM's FlashAttention backend on an H100
#: (``FlashAttentionBackend.get_supported_kernel_block_sizes`` returns ``[MultipleOf(16)]``; on
#: Blackwell, FA4's head-dim-256 kernel returns 128), the unit the hybrid block size is a
#: multiple of.
KERNEL_BLOCK = 16

#: ``max_num_batched_tokens`` of ``vllm serve`` on a GPU of 70 GiB or more that is not an A100
#: (an H100 or H200; ``EngineArgs.get_batch_defaults``, ``vllm/engine/arg_utils.py``, v0.32.0).
VLLM_SERVE_BATCHED_TOKENS = 8192


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _non_negative(name: str, value) -> float:
    if (not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value)
            or value < 0):
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return value


def max_in_flight_tokens(max_num_batched_tokens: int = VLLM_SERVE_BATCHED_TOKENS,
                         max_concurrent_batches: int = 2) -> int:
    """vLLM's bound on tokens scheduled but not yet settled (``VllmConfig.max_in_flight_tokens``,
    v0.32.0): every concurrent batch may hold a full ``max_num_batched_tokens``. Async
    scheduling, on by default, keeps 2 batches in flight without pipeline parallelism
    (``VllmConfig.max_concurrent_batches``); the defaults give 16,384, ``vllm serve``'s on an
    H100. Pass the result as ``plan_layout(in_flight_tokens=...)`` for vLLM's own count."""
    _positive_int("max_num_batched_tokens", max_num_batched_tokens)
    _positive_int("max_concurrent_batches", max_concurrent_batches)
    return max_concurrent_batches * max_num_batched_tokens


def token_bytes(layer: LayerKV, kv_dtype: str, tp: int = 1) -> float:
    """Bytes one rank keeps per token in ``layer`` (0 for a recurrent layer): its KV heads
    (``ceil(kv_heads / tp)``, at least one) or, for MLA, the whole latent."""
    if layer.kind == "state":
        return 0.0
    heads = 1 if layer.kind == "mla" else kv_heads_per_rank(layer.kv_heads, tp)
    return heads * (layer.head_dim + layer.head_dim_v) * dtype_bytes(kv_dtype)


def bytes_by_layer(layout: ModelLayout, tokens: int, *, kv_dtype: str = "bf16", tp: int = 1
                   ) -> list[float]:
    """Bytes each layer keeps on one rank for one request of ``tokens`` tokens, exactly (no
    blocks): the per-layer rule of :func:`~kvlab.labs.capacity.layer_kv.kv_bytes_by_layer`
    with tensor parallelism applied."""
    _positive_int("tokens", tokens)
    _positive_int("tp", tp)
    return [layer.tokens_kept(tokens) * token_bytes(layer, kv_dtype, tp) + layer.state_bytes(tp)
            for layer in layout.layers]


def hybrid_block_size(attention_token_bytes: float, state_bytes: int, *, block_size: int = 16,
                      kernel_block: int = KERNEL_BLOCK) -> int:
    """The attention block size vLLM picks for a model with recurrent layers: the smallest
    multiple of ``max(kernel_block, block_size)`` tokens whose page (``tokens ×
    attention_token_bytes`` per layer) holds ``state_bytes`` (``Platform
    ._align_hybrid_block_size``), never below ``block_size``."""
    _positive_int("block_size", block_size)
    _positive_int("kernel_block", kernel_block)
    if attention_token_bytes <= 0 or state_bytes <= 0:
        raise ValueError("attention_token_bytes and state_bytes must be positive")
    unit = max(kernel_block, block_size)
    aligned = unit * math.ceil(state_bytes / (unit * attention_token_bytes))
    aligned = kernel_block * _cdiv(aligned, kernel_block)
    return max(block_size, aligned)


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table: one kind, one window, one page.

    ``slots`` is the group size every group of the plan has (``slots - len(layers)`` are
    padding); ``page_bytes`` is one layer's page on one rank (``block_size`` tokens, or a whole
    recurrent state, padded to the plan's page).
    """

    kind: str
    layers: tuple[int, ...]
    slots: int
    block_size: int
    page_bytes: float
    window: int | None = None

    def blocks_per_request(self, tokens: int, in_flight_tokens: int = 1,
                           state_blocks: int = 1) -> int:
        """Blocks one request of ``tokens`` tokens holds in this group at most, with
        ``in_flight_tokens`` computed but not yet settled. A sliding group never counts more
        than a full group would: a request cannot hold more. (vLLM's start-up count caps the
        window at ``max_model_len`` and then adds the straddling block, one block more than
        this when the window and the tokens in flight cover the whole request.)"""
        if self.kind == "state":
            return state_blocks
        full = _cdiv(tokens, self.block_size)
        if self.kind == "sliding":
            window = _cdiv(min(self.window - 1 + in_flight_tokens, tokens), self.block_size) + 1
            return min(full, window)
        return full


@dataclass(frozen=True)
class LayoutPlan(PoolBudget):
    """What fits on one GPU (one rank of one data-parallel replica). Sizes in bytes.

    Memory identity (as :class:`~kvlab.labs.capacity.CapacityPlan`)::

        gpu_memory_bytes == weight_bytes + reserve_bytes + kv_cache_bytes
                            + leftover_bytes + headroom_bytes
    """

    model: str
    gpu: str
    kv_dtype: str
    tp: int
    dp: int
    block_size: int                 # attention tokens per block (after hybrid alignment)
    context_len: int
    in_flight_tokens: int
    windows: bool
    prefix_caching: bool
    gpu_memory_bytes: int | float
    gpu_memory_utilization: float
    weight_bytes: float
    reserve_bytes: float
    groups: tuple[KVGroup, ...]
    block_bytes: float              # one block of the pool: a page in every layer of a group
    num_blocks: int

    @property
    def padding_slots(self) -> int:
        """Layer slots of the groups that hold no layer (pages paid for, never used)."""
        return sum(g.slots - len(g.layers) for g in self.groups)

    def group_blocks(self, tokens: int | None = None) -> tuple[int, ...]:
        """Blocks one request of ``tokens`` tokens (default ``context_len``) holds per group."""
        tokens = self.context_len if tokens is None else _positive_int("tokens", tokens)
        state_blocks = 2 if self.prefix_caching else 1
        return tuple(g.blocks_per_request(tokens, self.in_flight_tokens, state_blocks)
                     for g in self.groups)

    def blocks_per_request(self, tokens: int | None = None) -> int:
        """Blocks of the pool one request of ``tokens`` tokens needs, all groups together."""
        return sum(self.group_blocks(tokens))

    def kv_bytes_per_request(self, tokens: int | None = None) -> float:
        """Pool bytes one request of ``tokens`` tokens takes on this GPU (blocks × block)."""
        return self.blocks_per_request(tokens) * self.block_bytes

    @property
    def max_requests(self) -> int:
        """Requests of ``context_len`` tokens one replica's pool holds at once."""
        return self.num_blocks // self.blocks_per_request()

    @property
    def max_concurrency(self) -> float:
        """``num_blocks / blocks_per_request``: vLLM's "maximum concurrency" (fractional)."""
        return self.num_blocks / self.blocks_per_request()

    @property
    def token_capacity(self) -> int:
        """Tokens the pool holds by vLLM's formula (``get_kv_cache_capacity``: maximum
        concurrency × tokens per request), with this plan's ``in_flight_tokens``: vLLM's own
        figure when that is :func:`max_in_flight_tokens` and ``context_len`` its
        ``max_model_len``, the steady-decode figure with 1. For one group of full layers it is
        ``num_blocks × block_size`` when the context fills whole blocks."""
        return int(self.max_concurrency * self.context_len)

    @property
    def deployment_requests(self) -> int:
        """Requests the ``tp × dp`` GPUs hold at once: one pool's worth per replica."""
        return self.dp * self.max_requests

    def breakdown(self) -> dict[str, float]:
        """Per-GPU memory by use, summing to ``gpu_memory_bytes`` (a deficit shows as 0)."""
        return {"weights": self.weight_bytes, "reserve": self.reserve_bytes,
                "kv_cache": self.kv_cache_bytes, "leftover": max(0.0, self.leftover_bytes),
                "headroom": self.headroom_bytes}

    def summary(self) -> str:
        """A few readable lines: the groups, the pool and what it holds."""
        kinds: dict[str, int] = {}
        for g in self.groups:
            name = g.kind if g.window is None else f"{g.kind}({g.window})"
            kinds[name] = kinds.get(name, 0) + 1
        groups = ", ".join(f"{n} {name}" for name, n in kinds.items())
        lines = [f"{self.model} on {self.gpu} (TP={self.tp}, DP={self.dp})",
                 f"  KV {self.kv_dtype}, blocks of {self.block_size} tokens"
                 + ("" if self.windows else ", no windows"),
                 f"  {_count(len(self.groups), 'group')} of {self.groups[0].slots} layer slots: "
                 f"{groups}; {self.padding_slots} padding",
                 f"  KV budget {self.kv_budget_bytes / GiB:.2f} GiB -> {self.num_blocks:,} "
                 f"blocks of {self.block_bytes / 2**20:.2f} MiB"]
        if self.fits:
            lines.append(f"  {self.blocks_per_request():,} blocks per {self.context_len:,}-token "
                         f"request -> {self.max_requests:,} per replica "
                         f"({self.token_capacity:,} tokens)")
            lines.append(f"  {_count(self.deployment_requests, 'request')} on "
                         f"{_count(self.tp * self.dp, 'GPU')}")
        else:
            lines.append("  does not fit: no KV block after weights and reserve")
        return "\n".join(lines)


def _pages(layout: ModelLayout, kv_dtype: str, tp: int, block_size: int, kernel_block: int):
    """Per layer: (block size, page bytes) after hybrid alignment and page unification."""
    attention = [token_bytes(layer, kv_dtype, tp) for layer in layout.layers
                 if layer.kind != "state"]
    states = [layer.state_bytes(tp) for layer in layout.layers if layer.kind == "state"]
    if states and attention:
        block_size = hybrid_block_size(max(attention), max(states), block_size=block_size,
                                       kernel_block=kernel_block)
    raw = [(block_size, layer.state_bytes(tp)) if layer.kind == "state"
           else (block_size, block_size * token_bytes(layer, kv_dtype, tp))
           for layer in layout.layers]
    top = max(page for _, page in raw)
    unified = []
    for layer, (blocks, page) in zip(layout.layers, raw, strict=True):
        if page == top or layer.kind == "state" or top % page:
            unified.append((blocks, top))          # pad (a state, or no whole ratio)
        else:
            unified.append((blocks * int(top // page), top))   # more tokens per block
    return block_size, unified


def _groups(layout: ModelLayout, pages) -> tuple[KVGroup, ...]:
    buckets: dict[tuple, list[int]] = {}
    for i, (layer, (blocks, page)) in enumerate(zip(layout.layers, pages, strict=True)):
        key = (layer.kind, layer.window, blocks, page)
        buckets.setdefault(key, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    size = min(sizes)
    if max(sizes) < size * 1.5:
        size = max(sizes)
    groups = []
    for (kind, window, blocks, page), members in buckets.items():
        n = _cdiv(len(members), size)
        groups += [KVGroup(kind, tuple(members[i::n]), size, blocks, page, window)
                   for i in range(n)]
    return tuple(groups)


def plan_layout(
    layout: ModelLayout,
    gpu: GPUSpec | int | float,
    *,
    weight_bytes: float,
    kv_dtype: str = "bf16",
    context_len: int = 8192,
    tp: int = 1,
    dp: int = 1,
    block_size: int = 16,
    in_flight_tokens: int = 1,
    windows: bool = True,
    prefix_caching: bool = False,
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: float = 0.0,
    kernel_block: int = KERNEL_BLOCK,
    total_memory: str = "cuda",
) -> LayoutPlan:
    """Plan the KV pool of ``layout`` on one GPU, as vLLM's hybrid manager cuts it (module
    docstring). ``weight_bytes`` is what each GPU holds of the weights; ``in_flight_tokens``
    the tokens of a request computed but not yet settled, which its windowed groups still hold
    (1: the steady-decode packing; a prefill chunk's length while one is computed; vLLM
    reserves :func:`max_in_flight_tokens`, 16,384 for ``vllm serve`` on an H100, for every
    request); ``windows=False`` keeps every token of the sliding layers (an engine without a
    window-aware manager, e.g. vLLM with ``--disable-hybrid-kv-cache-manager``).
    ``gpu_memory_utilization`` defaults to 0.9, kvlab's assumption throughout (vLLM 0.32's
    default is 0.92, ``CacheConfig`` in ``vllm/config/cache.py``). ``gpu`` and
    ``total_memory`` as in :func:`~kvlab.labs.capacity.plan_capacity`.

    Raises ``ValueError`` naming the offending input; weights that do not fit give a plan with
    ``num_blocks == 0``.
    """
    if not isinstance(layout, ModelLayout):
        raise ValueError(f"layout must be a ModelLayout, got {type(layout).__name__}")
    if total_memory not in ("cuda", "datasheet"):
        raise ValueError(f"total_memory must be 'cuda' or 'datasheet', got {total_memory!r}")
    if isinstance(gpu, GPUSpec):
        gpu_name = gpu.name
        memory = gpu.engine_memory_bytes if total_memory == "cuda" else gpu.memory_bytes
    else:
        gpu_name, memory = "GPU", gpu
        if (not isinstance(memory, Real) or isinstance(memory, bool)
                or not math.isfinite(memory) or memory <= 0):
            raise ValueError(f"gpu memory bytes must be a positive number, got {gpu!r}")
    for name, value in (("context_len", context_len), ("tp", tp), ("dp", dp),
                        ("block_size", block_size), ("in_flight_tokens", in_flight_tokens),
                        ("kernel_block", kernel_block)):
        _positive_int(name, value)
    if (not isinstance(gpu_memory_utilization, Real) or isinstance(gpu_memory_utilization, bool)
            or not 0 < gpu_memory_utilization <= 1):
        raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization!r}")
    _non_negative("weight_bytes", weight_bytes)
    _non_negative("reserve_bytes", reserve_bytes)
    dtype_bytes(kv_dtype)
    if not windows:
        layout = layout.without_windows()
    block_size, pages = _pages(layout, kv_dtype, tp, block_size, kernel_block)
    groups = _groups(layout, pages)
    block_bytes = max(len(g.layers) * g.page_bytes for g in groups)
    budget = memory * gpu_memory_utilization - weight_bytes - reserve_bytes
    num_blocks = max(0, math.floor(budget / block_bytes))
    return LayoutPlan(
        model=layout.name, gpu=gpu_name, kv_dtype=kv_dtype, tp=tp, dp=dp,
        block_size=block_size, context_len=context_len, in_flight_tokens=in_flight_tokens,
        windows=windows, prefix_caching=prefix_caching, gpu_memory_bytes=memory,
        gpu_memory_utilization=float(gpu_memory_utilization), weight_bytes=float(weight_bytes),
        reserve_bytes=float(reserve_bytes), groups=groups, block_bytes=block_bytes,
        num_blocks=num_blocks)
