"""The engine's configuration (:class:`EngineArgs`), validated when it is made, and the KV
cache's size.

Every check names the argument and the value, and runs before anything is allocated or
loaded: a bad argument raises ``ValueError`` (or ``TypeError`` for a wrong kind of object) and
nothing else happens.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvlab.core.checks import is_int

if TYPE_CHECKING:
    from kvlab.core.interfaces import Scheduler
    from kvlab.engine.checkpoint import LoadedCheckpoint
    from kvlab.engine.kv_events import KVEventsConfig
    from kvlab.engine.tokenizer import Tokenizer

#: Default KV budget on CPU when ``num_blocks`` is None (bytes). On CUDA the default is half of
#: the device memory free after loading the weights.
DEFAULT_KV_CACHE_MEMORY_CPU = 512 * 2**20

#: Largest block size accepted (tokens). vLLM's kernels use 16–256; a block is a unit of
#: allocation, and a huge one only wastes memory.
MAX_BLOCK_SIZE = 4096

#: Seeds are taken modulo 2**64 (torch.Generator's range); a seed argument must lie below it.
SEED_MOD = 2**64

#: Floating-point dtypes the model and its KV cache can run in.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_positive_int(name: str, value: object, *, optional: bool = False,
                       upper: int | None = None) -> None:
    """ValueError naming ``name`` unless ``value`` is an int in ``1..upper`` (or None when
    ``optional``)."""
    if optional and value is None:
        return
    if not is_int(value) or value <= 0 or (upper is not None and value > upper):
        bound = f" <= {upper}" if upper is not None else ""
        kind = "a positive int" + bound + (" or None" if optional else "")
        raise ValueError(f"LLMEngine: {name} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class EngineArgs:
    """Everything an :class:`~kvlab.engine.llm_engine.LLMEngine` is built from, frozen and
    checked when made (:func:`check_engine_args`; device, dtype, quantization, speculative and
    transfer configs are checked when the engine resolves them, before anything is loaded).

    ``model``: shipped model name, local Hugging Face directory, or a
    :class:`~kvlab.engine.checkpoint.LoadedCheckpoint` (used in place: moved to the engine's
    device and dtype). ``num_blocks=None`` sizes the cache from ``kv_cache_memory`` bytes
    (default :data:`DEFAULT_KV_CACHE_MEMORY_CPU` on CPU, half the free memory on CUDA), capped
    at ``max_num_seqs * max_model_len`` tokens. ``max_model_len`` defaults to the model's
    ``max_position_embeddings``. ``max_prefill_chunk`` caps the prefill tokens one request gets
    per step (None: the whole step budget). ``security_domain``: the default tenant (part of
    every prefix-cache scope). ``device``: ``"cpu"`` (default) or ``"cuda[:N]"``; ``dtype``:
    float32, float16 or bfloat16. ``quantization`` (``"int8"``, ``"int4"`` or a
    ``QuantConfig``), ``quantization_group_size``, ``kv_cache_dtype`` (``"auto"``, ``"int8"``,
    ``"fp8_e4m3"``): :mod:`kvlab.engine.quantization`. ``enforce_eager`` (vLLM's name): no
    CUDA graphs; by default an engine on CUDA captures its decode forward
    (:mod:`kvlab.engine.cuda_graphs`). ``async_scheduling`` (vLLM's name): plan step n+1 while
    step n executes (:class:`~kvlab.core.engine_core.EngineCore`'s overlap mode; not with
    speculative decoding or KV transfer). ``kv_events_config``: vLLM's KV-events JSON (a dict,
    its text or a ``KVEventsConfig``): publish the prefix cache's changes
    (:mod:`kvlab.engine.kv_events`; off by default). A model with sliding-window layers gets a
    block table per KV cache group, and its window groups release what falls out of their
    windows (:mod:`kvlab.core.hybrid_kv_cache_manager`); ``disable_hybrid_kv_cache_manager``
    (vLLM's name) keeps one full table for all layers instead. The spec's invariants after every
    step are an observer attached from outside: :func:`kvlab.labs.invariants.check_every_step`.
    """

    model: str | Path | LoadedCheckpoint
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    device: str | torch.device | None = None
    dtype: torch.dtype | str | None = None
    seed: int = 0
    scheduler: str | Callable[..., Scheduler] = "baseline"
    kv_cache_memory: int | None = None
    security_domain: str = "default"
    tokenizer: Tokenizer | None = None
    kv_transfer_config: dict | None = None
    speculative_config: dict | None = None
    quantization: str | None = None
    quantization_group_size: int = 64
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool = False
    kv_events_config: dict | str | KVEventsConfig | None = None
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        check_engine_args(self)

    @staticmethod
    def add_cli_args(ap: argparse.ArgumentParser) -> None:
        """The engine's command-line flags (vLLM's names, ``--no-enable-prefix-caching``), plus
        ``--max-waiting`` (the production scheduler's admission limit)."""
        ap.add_argument("--model", default="kvlab-tiny", help="shipped model name or HF directory")
        ap.add_argument("--block-size", type=int, default=16)
        ap.add_argument("--num-blocks", type=int, default=None)
        ap.add_argument("--max-num-seqs", type=int, default=64)
        ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
        ap.add_argument("--max-prefill-chunk", type=int, default=None)
        ap.add_argument("--max-model-len", type=int, default=None)
        ap.add_argument("--no-enable-prefix-caching", action="store_true")
        ap.add_argument("--scheduler", choices=("baseline", "production"), default="baseline")
        ap.add_argument("--max-waiting", type=int, default=None,
                        help="production scheduler: refuse requests (HTTP 503) when this many wait")
        ap.add_argument("--device", default=None)
        ap.add_argument("--dtype", default=None)
        ap.add_argument("--seed", type=int, default=0)
        ap.add_argument("--async-scheduling", action="store_true",
                        help="plan each step while the previous one executes (overlap)")
        ap.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="publish KV cache events, vLLM's JSON: '{\"enable_kv_cache_events\": "
                             "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'")
        ap.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="one full block table for all layers of a sliding-window model")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """EngineArgs from :meth:`add_cli_args`' parsed flags (ValueError on bad ones)."""
        scheduler: str | Callable[..., Scheduler] = args.scheduler
        if args.max_waiting is not None:
            if args.max_waiting < 0:
                raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
            from kvlab.core.production_scheduler import ProductionScheduler

            limit = args.max_waiting

            def scheduler(kv, cfg):
                return ProductionScheduler(kv, dataclasses.replace(cfg, max_waiting=limit))
        return cls(args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                   max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_prefill_chunk=args.max_prefill_chunk, max_model_len=args.max_model_len,
                   enable_prefix_caching=not args.no_enable_prefix_caching, device=args.device,
                   dtype=args.dtype, seed=args.seed, scheduler=scheduler,
                   async_scheduling=args.async_scheduling,
                   kv_events_config=args.kv_events_config,
                   disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager)


def check_engine_args(args: EngineArgs) -> None:
    """Check the plain arguments of ``args`` (device and dtype are resolved by
    :func:`resolve_device` / :func:`resolve_dtype`; a blank model name is refused where names
    are resolved, :func:`~kvlab.engine.checkpoint.resolve_model_path`)."""
    from kvlab.engine.checkpoint import LoadedCheckpoint

    model, block_size, seed = args.model, args.block_size, args.seed
    max_num_seqs, max_num_batched_tokens = args.max_num_seqs, args.max_num_batched_tokens
    scheduler = args.scheduler
    security_domain = args.security_domain

    if not isinstance(model, (str, Path, LoadedCheckpoint)):
        raise TypeError(f"LLMEngine: model must be a str, a Path or a LoadedCheckpoint, "
                        f"got {type(model).__name__}")
    check_positive_int("block_size", block_size, upper=MAX_BLOCK_SIZE)
    check_positive_int("max_num_seqs", max_num_seqs)
    check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
    for name in ("num_blocks", "max_prefill_chunk", "kv_cache_memory", "max_model_len"):
        check_positive_int(name, getattr(args, name), optional=True)
    if not is_int(seed) or not 0 <= seed < SEED_MOD:
        raise ValueError(f"LLMEngine: seed must be an int in [0, 2**64), got {seed!r}")
    for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling",
                 "disable_hybrid_kv_cache_manager"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"LLMEngine: {name} must be a bool, got {getattr(args, name)!r}")
    if isinstance(scheduler, str) and scheduler not in ("baseline", "production"):
        raise ValueError(f"unknown scheduler {scheduler!r}; expected 'baseline', "
                         "'production' or a factory (kv, SchedulerConfig) -> Scheduler")
    if not isinstance(scheduler, str) and not callable(scheduler):
        raise TypeError(f"LLMEngine: scheduler must be a name or a factory, got {scheduler!r}")
    # Followed: vLLM 0.32's vllm/config/vllm.py (VllmConfig.__post_init__), which refuses
    # async_scheduling with any speculation but EAGLE/MTP, draft-model and GPU n-gram; stop
    # strings, logprobs and structured outputs run overlapped there (a grammar's bitmask waits
    # for the tokens in flight: vllm/v1/core/sched/async_scheduler.py) and here (the runner
    # advances the grammar in step order). kvlab refuses both of its speculative methods.
    if args.async_scheduling and args.speculative_config is not None:
        raise ValueError("LLMEngine: async_scheduling=True is not supported with "
                         "speculative_config: kvlab plans each step's draft slots from the "
                         "tokens accepted in the step before, which overlap does not know yet")
    if args.async_scheduling and args.kv_transfer_config is not None:
        raise ValueError("LLMEngine: async_scheduling=True is not supported with "
                         "kv_transfer_config: kvlab's transfer protocol runs between steps")
    if not isinstance(security_domain, str) or not security_domain:
        raise ValueError(f"LLMEngine: security_domain must be a non-empty str, "
                         f"got {security_domain!r}")
    if args.kv_events_config is not None:   # imported only when asked for (msgspec)
        from kvlab.engine.kv_events import KVEventsConfig
        config = KVEventsConfig.parse(args.kv_events_config)
        if config.enabled and not args.enable_prefix_caching:
            raise ValueError("LLMEngine: kv_events_config publishes the prefix cache's changes: "
                             "it needs enable_prefix_caching=True")


def resolve_device(device: object) -> torch.device:
    """``None`` -> CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a torch.device of those types."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"LLMEngine: device must be a str or torch.device, got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"LLMEngine: device {device!r} is not a device: {error}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"LLMEngine: device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("LLMEngine: device='cuda' requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"LLMEngine: device {device!r}: only {torch.cuda.device_count()} "
                             "CUDA devices")
    return dev


def resolve_dtype(dtype: object, device: torch.device) -> torch.dtype:
    """``None`` -> float32 on CPU, bfloat16 on CUDA; a name or a torch dtype of
    :data:`SUPPORTED_DTYPES` otherwise."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"LLMEngine: unknown dtype {dtype!r}")
        dtype = named
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise ValueError(f"LLMEngine: dtype must be one of {names}, got {dtype!r}")
    return dtype  # type: ignore[return-value]


@dataclass(frozen=True)
class CacheSize:
    """The paged KV cache's size: ``num_blocks`` blocks of ``block_bytes`` bytes each."""

    num_blocks: int
    block_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def host_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def size_kv_cache(*, block_bytes: int, block_size: int, num_blocks: int | None,
                  kv_cache_memory: int | None, max_num_seqs: int, max_model_len: int,
                  device: torch.device, blocks_per_request: int | None = None) -> CacheSize:
    """How many blocks to allocate.

    ``num_blocks`` given: exactly that many. Otherwise ``floor(kv_cache_memory / block_bytes)``
    (never more than asked; ValueError if not even one block fits), capped at what
    ``max_num_seqs`` requests of ``max_model_len`` tokens can use (``blocks_per_request``
    each, when the KV cache manager says so; else ``ceil(max_model_len / block_size)``).
    ``kv_cache_memory`` defaults to :data:`DEFAULT_KV_CACHE_MEMORY_CPU` on CPU and half the free
    memory on CUDA. ValueError when the cache would not fit the device's memory.
    """
    if num_blocks is None:
        if kv_cache_memory is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                kv_cache_memory = free // 2
            else:
                kv_cache_memory = DEFAULT_KV_CACHE_MEMORY_CPU
        if kv_cache_memory < block_bytes:
            raise ValueError(
                f"LLMEngine: kv_cache_memory={kv_cache_memory} bytes holds no KV block "
                f"(one block of {block_size} tokens takes {block_bytes} bytes)")
        cap = (math.ceil(max_num_seqs * max_model_len / block_size) if blocks_per_request
               is None else max_num_seqs * blocks_per_request) + max_num_seqs
        num_blocks = min(kv_cache_memory // block_bytes, cap)
    total = num_blocks * block_bytes
    if device.type == "cuda":
        limit: int | None = torch.cuda.mem_get_info(device)[0]
    else:
        limit = host_memory_bytes()
    if limit is not None and total > limit:
        raise ValueError(
            f"LLMEngine: a KV cache of {num_blocks} blocks x {block_bytes} bytes "
            f"({total / 2**30:.1f} GiB) does not fit the {limit / 2**30:.1f} GiB of "
            f"{device.type} memory; lower num_blocks, block_size or kv_cache_memory")
    return CacheSize(num_blocks, block_bytes)
