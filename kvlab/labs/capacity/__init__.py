"""KV cache capacity planning (production side of spec rule 1): what fits on one GPU.

Built on the reference :func:`~kvlab.reference.rule01_capacity.kv_bytes`
(``M_KV = 2 · L · B · T · A_kv · D · s``): how many KV blocks, tokens and requests one
tensor-parallel rank holds after weights and reserve, with quantisation-scale overhead and
TP sharding of KV heads.

For models whose layers cache different things (sliding windows, MLA latents, recurrent states)
see :mod:`.layer_kv` (what one layer keeps, the per-layer rule), :mod:`.hf_config` (layouts read
from a Hugging Face ``config.json``) and :mod:`.hybrid_plan` (the pool cut as vLLM's hybrid KV
cache manager cuts it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from kvlab.reference.rule01_capacity import kv_bytes
from kvlab.sim.catalog import DTYPE_BYTES as DTYPE_BYTES  # re-exported: the planner's table
from kvlab.sim.catalog import GPUSpec, ModelShape, dtype_bytes

# ---------------------------------------------------------------------------------------------
# Capacity planner (production): how many KV blocks, tokens and requests one GPU can hold.
# ---------------------------------------------------------------------------------------------

GiB = 2**30


def kv_element_bytes(dtype: str, scale_group: int | None = None, scale_bytes: float = 2.0) -> float:
    """Effective bytes per cached K or V element, including quantisation-scale overhead.

    ``scale_group=None`` means no per-group scale (bf16/fp16, or fp8/int8 with a per-tensor or
    per-head scale whose cost is negligible). With a group size ``g``, every ``g`` elements
    carry one scale of ``scale_bytes`` (2 for an fp16 scale): ``bytes = s + scale_bytes / g``.
    Example: int4 with one fp16 scale per 32 elements costs 0.5 + 2/32 = 0.5625 bytes.
    """
    base = dtype_bytes(dtype)
    if scale_group is None:
        return base
    if not isinstance(scale_group, int) or isinstance(scale_group, bool) or scale_group <= 0:
        raise ValueError(f"scale_group must be a positive int or None, got {scale_group!r}")
    if not isinstance(scale_bytes, Real) or scale_bytes < 0:
        raise ValueError(f"scale_bytes must be a non-negative number, got {scale_bytes!r}")
    return base + scale_bytes / scale_group


def kv_heads_per_rank(kv_heads: int, tp: int, sharded: bool = True) -> int:
    """KV heads one tensor-parallel rank stores (spec rule 1).

    With the cache sharded by TP rank (what Megatron-style attention does: each rank owns
    whole heads), a rank holds ``ceil(kv_heads / tp)`` heads, and at least one: when
    ``tp > kv_heads`` the KV heads are *replicated* (each head lives on ``tp / kv_heads``
    ranks), so adding ranks past ``kv_heads`` no longer shrinks the per-rank cache. With an
    unsharded (replicated) cache every rank holds all ``kv_heads``. Serving systems usually
    also require that one of ``kv_heads`` and ``tp`` divides the other.
    """
    for name, value in (("kv_heads", kv_heads), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not sharded:
        return kv_heads
    return max(1, math.ceil(kv_heads / tp))


class PoolBudget:
    """The memory identity every plan obeys, from its ``gpu_memory_bytes``,
    ``gpu_memory_utilization``, ``weight_bytes``, ``reserve_bytes``, ``num_blocks`` and
    ``block_bytes``::

        gpu_memory_bytes == weight_bytes + reserve_bytes + kv_cache_bytes
                            + leftover_bytes + headroom_bytes
    """

    gpu_memory_bytes: int | float
    gpu_memory_utilization: float
    weight_bytes: float
    reserve_bytes: float
    num_blocks: int
    block_bytes: float

    @property
    def usable_bytes(self) -> float:
        """``gpu_memory_utilization · gpu_memory_bytes``: what the engine may use."""
        return self.gpu_memory_bytes * self.gpu_memory_utilization

    @property
    def headroom_bytes(self) -> float:
        """Memory the utilisation fraction keeps back (other processes, fragmentation)."""
        return self.gpu_memory_bytes - self.usable_bytes

    @property
    def kv_budget_bytes(self) -> float:
        """``usable - weights - reserve``: what is left for the KV pool (negative: no fit)."""
        return self.usable_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def kv_cache_bytes(self) -> float:
        """Bytes of the allocated KV pool: ``num_blocks · block_bytes``."""
        return self.num_blocks * self.block_bytes

    @property
    def leftover_bytes(self) -> float:
        """Budget left after whole blocks (< one block), or the deficit when negative."""
        return self.kv_budget_bytes - self.kv_cache_bytes

    @property
    def fits(self) -> bool:
        """True when weights and reserve fit and at least one KV block remains."""
        return self.num_blocks > 0


@dataclass(frozen=True)
class CapacityPlan(PoolBudget):
    """What fits on one tensor-parallel rank (= one GPU). All sizes in **bytes** unless named.

    Memory identity (checked in tests)::

        gpu_memory_bytes == weight_bytes + reserve_bytes + kv_cache_bytes
                            + leftover_bytes + headroom_bytes

    where ``headroom_bytes = (1 - gpu_memory_utilization) · gpu_memory_bytes`` is never used,
    ``kv_cache_bytes = num_blocks · block_bytes`` is the KV pool actually allocated and
    ``leftover_bytes`` is the remainder smaller than one block (or the deficit, negative, when
    weights and reserve do not fit: then ``num_blocks == 0`` and ``fits`` is False).

    Every rank stores a slice (its heads) of *every* token, so the token capacity of a rank is
    the token capacity of the whole TP group.
    """

    model: str
    gpu: str
    kv_dtype: str
    tp: int
    block_size: int                 # tokens per KV block
    context_len: int                # tokens per request for ``max_requests``
    gpu_memory_bytes: int | float   # per GPU
    gpu_memory_utilization: float   # fraction the engine may use (vLLM's knob)
    weight_bytes: float             # per rank (= total weights / tp)
    reserve_bytes: float            # activations, workspace, CUDA graphs ... per rank
    kv_sharded: bool
    kv_heads_per_rank: int
    kv_element_bytes: float         # per K or V element, scale overhead included
    kv_bytes_per_token: float       # per rank, all layers, K and V
    block_bytes: float              # per rank: block_size · kv_bytes_per_token
    num_blocks: int
    layers: int
    head_dim: int

    @property
    def token_capacity(self) -> int:
        """Tokens the KV pool can hold in total: ``num_blocks · block_size``."""
        return self.num_blocks * self.block_size

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of ``context_len`` tokens needs: ``ceil(context_len / block)``."""
        return -(-self.context_len // self.block_size)

    @property
    def max_requests(self) -> int:
        """Requests of ``context_len`` tokens that fit at once (whole blocks each)."""
        return self.num_blocks // self.blocks_per_request

    def kv_bytes_per_request(self, tokens: int | None = None) -> float:
        """Per-rank KV bytes of one request of ``tokens`` tokens (default ``context_len``)."""
        tokens = self.context_len if tokens is None else tokens
        return kv_bytes(self.layers, 1, tokens, self.kv_heads_per_rank, self.head_dim,
                        self.kv_element_bytes)

    def breakdown(self) -> dict[str, float]:
        """Per-GPU memory by use, in bytes, summing to ``gpu_memory_bytes``.

        Keys in drawing order: weights, reserve, kv_cache, leftover, headroom. A negative
        leftover (deficit) is reported as 0 here; use :attr:`leftover_bytes` to see it.
        """
        parts = {
            "weights": self.weight_bytes,
            "reserve": self.reserve_bytes,
            "kv_cache": self.kv_cache_bytes,
            "leftover": max(0.0, self.leftover_bytes),
            "headroom": self.headroom_bytes,
        }
        return parts

    def summary(self) -> str:
        """A few readable lines: inputs, memory split in GiB, and the resulting capacity."""
        g = GiB
        lines = [
            f"{self.model} on {self.gpu} (TP={self.tp}), KV {self.kv_dtype}, "
            f"block {self.block_size} tokens",
            f"  per GPU: {self.gpu_memory_bytes / g:.1f} GiB x {self.gpu_memory_utilization:.2f}"
            f" usable = {self.usable_bytes / g:.1f} GiB",
            f"  weights {self.weight_bytes / g:.2f} GiB + reserve {self.reserve_bytes / g:.2f} GiB"
            f" -> KV budget {self.kv_budget_bytes / g:.2f} GiB",
            f"  KV per token per rank: {self.kv_bytes_per_token / 1024:.1f} KiB "
            f"({self.kv_heads_per_rank} KV heads/rank"
            f"{'' if self.kv_sharded else ', cache replicated'})",
        ]
        if self.fits:
            lines += [
                f"  {self.num_blocks:,} blocks of {self.block_bytes / 2**20:.2f} MiB = "
                f"{self.kv_cache_bytes / g:.2f} GiB -> {self.token_capacity:,} tokens",
                f"  max concurrent requests at {self.context_len:,} tokens: {self.max_requests:,}",
            ]
        else:
            lines.append(f"  does not fit: short by {-self.kv_budget_bytes / g:.2f} GiB "
                         "(no KV block can be allocated)")
        return "\n".join(lines)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _non_negative(name: str, value) -> float:
    if (not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value)
            or value < 0):
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return value


def plan_capacity(
    model: ModelShape,
    gpu: GPUSpec | int | float,
    *,
    kv_dtype: str = "bf16",
    context_len: int = 8192,
    tp: int = 1,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: float = 0.0,
    weight_dtype: str = "bf16",
    weight_bytes: float | None = None,
    kv_sharded: bool = True,
    scale_group: int | None = None,
    scale_bytes: float = 2.0,
    total_memory: str = "cuda",
) -> CapacityPlan:
    """Plan the KV cache of ``model`` on one GPU of a tensor-parallel group, as vLLM sizes it.

    The engine may use ``gpu_memory_utilization`` of the GPU's total memory: with
    ``total_memory="cuda"`` (the default) the total CUDA reports, as vLLM uses it
    (:attr:`GPUSpec.engine_memory_bytes`, the datasheet figure where none is recorded); with
    ``"datasheet"`` the decimal GB of the datasheet. From that it subtracts the
    weights held by this rank (``weight_bytes`` if given, else ``params · bytes(weight_dtype)``,
    divided by ``tp``: every weight matrix, embeddings included, is split across ranks; the
    small replicated norms are ignored) and ``reserve_bytes`` for activations, workspace and
    CUDA graphs (vLLM measures the activations with a profiling forward pass, and does not
    count its CUDA graphs there; here the whole reserve is an input).
    What remains is cut into whole blocks of ``block_size`` tokens.

    Per-rank KV per token is ``2 · layers · kv_heads_per_rank · head_dim · element_bytes``
    (spec rule 1: the cache is divided by TP only when it is sharded by rank; with
    ``kv_sharded`` each rank holds ``ceil(kv_heads / tp)`` heads and at least one, so KV
    heads are replicated once ``tp > kv_heads``; with ``kv_sharded=False`` every rank holds
    all of them). ``scale_group``/``scale_bytes`` add quantisation-scale overhead (see
    :func:`kv_element_bytes`).

    Args:
        model: the model shape (see :mod:`kvlab.sim.catalog`).
        gpu: a :class:`GPUSpec` or the GPU memory in bytes.
        context_len: tokens per request used for :attr:`CapacityPlan.max_requests`.

    Raises:
        ValueError naming the offending field for any invalid input. Weights that do not fit
        are not an error: the plan comes back with ``num_blocks == 0`` and ``fits == False``.
    """
    if not isinstance(model, ModelShape):
        raise ValueError(f"model must be a ModelShape, got {type(model).__name__}")
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
    _positive_int("context_len", context_len)
    _positive_int("tp", tp)
    _positive_int("block_size", block_size)
    if (not isinstance(gpu_memory_utilization, Real) or isinstance(gpu_memory_utilization, bool)
            or not 0 < gpu_memory_utilization <= 1):
        raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization!r}")
    _non_negative("reserve_bytes", reserve_bytes)
    if weight_bytes is None:
        total_weights = model.params * dtype_bytes(weight_dtype)
    else:
        total_weights = _non_negative("weight_bytes", weight_bytes)
    element = kv_element_bytes(kv_dtype, scale_group, scale_bytes)
    heads = kv_heads_per_rank(model.kv_heads, tp, kv_sharded)

    per_token = kv_bytes(model.layers, 1, 1, heads, model.head_dim, element)
    block_bytes = per_token * block_size
    weights = total_weights / tp
    budget = memory * gpu_memory_utilization - weights - reserve_bytes
    num_blocks = max(0, math.floor(budget / block_bytes))
    return CapacityPlan(
        model=model.name, gpu=gpu_name, kv_dtype=kv_dtype, tp=tp, block_size=block_size,
        context_len=context_len, gpu_memory_bytes=memory,
        gpu_memory_utilization=float(gpu_memory_utilization), weight_bytes=weights,
        reserve_bytes=reserve_bytes, kv_sharded=kv_sharded, kv_heads_per_rank=heads,
        kv_element_bytes=element, kv_bytes_per_token=per_token, block_bytes=block_bytes,
        num_blocks=num_blocks, layers=model.layers, head_dim=model.head_dim,
    )
