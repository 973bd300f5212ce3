"""Building an LLMEngine's parts from its arguments (:func:`build_parts`): checkpoint, tokenizer,
context length, KV cache, scheduler, executor, and the prefix-cache scope.

Each function validates what it is given and raises ValueError naming the problem before
anything is allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.cache_scope import CacheScope
from kvlab.core.interfaces import Scheduler
from kvlab.core.kv_cache_groups import KVCacheGroup, group_layers, window_blocks
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.engine.checkpoint import LoadedCheckpoint
from kvlab.engine.config import ModelConfig
from kvlab.engine.engine_args import EngineArgs, resolve_device, resolve_dtype, size_kv_cache
from kvlab.engine.linear import select_linear_method
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.ops import select_kernels
from kvlab.engine.quantization.setup import EngineQuantization
from kvlab.engine.spec_decode.setup import Speculator
from kvlab.engine.structured_outputs.manager import StructuredOutputManager
from kvlab.engine.tokenizer import Tokenizer, load_tokenizer


def make_scheduler(kind: str | Callable[..., Scheduler], kv: KVCacheManager,
                   config: SchedulerConfig) -> Scheduler:
    """``"baseline"`` / ``"production"`` or a factory ``(kv, SchedulerConfig) -> Scheduler``."""
    if callable(kind) and not isinstance(kind, str):
        return kind(kv, config)
    classes = {"baseline": BaselineScheduler, "production": ProductionScheduler}
    return classes[kind](kv, config)


def parse_kv_transfer(kv_transfer_config: dict | None, enable_prefix_caching: bool,
                      quant: EngineQuantization):
    """The parsed ``KVTransferConfig`` (chapter 10), or None; ValueError for a bad one."""
    if kv_transfer_config is None:
        return None
    from kvlab.engine.kv_transfer import KVTransferConfig
    parsed = KVTransferConfig.parse(kv_transfer_config)
    if parsed.consume and not enable_prefix_caching:
        raise ValueError("a kv_consumer installs remote KV through the prefix cache: "
                         "it needs enable_prefix_caching=True")
    if quant.kv.quantized:
        raise ValueError(f"kv_transfer_config moves unquantized KV only; it cannot be used "
                         f"with kv_cache_dtype={quant.kv.name!r}")
    return parsed


def use_decode_graphs(a: EngineArgs, device: torch.device, quant: EngineQuantization,
                      speculator: Speculator | None) -> bool:
    """Whether the engine captures its decode forward in CUDA graphs
    (:mod:`~kvlab.engine.cuda_graphs`): on CUDA unless ``enforce_eager``; not with speculative
    decoding (its executor verifies several tokens a row) nor quantized weights or KV (their
    layers run code of their own)."""
    return (device.type == "cuda" and not a.enforce_eager and speculator is None
            and quant.weights is None and not quant.kv.quantized)


def capture_decode_graphs(executor: ModelRunner, cache: Any, max_num_seqs: int,
                          max_model_len: int, scratch_block: int) -> None:
    """Set ``executor.graphs`` to the decode forward captured at every size of the ladder up to
    ``max_num_seqs``; a capture that fails leaves the engine eager, with a warning."""
    import warnings

    from kvlab.engine.cuda_graphs import DecodeGraphs, capture_sizes, counter
    counter.capture_error = None
    try:
        executor.graphs = DecodeGraphs(
            executor.model, cache.layers, executor.kernels, sizes=capture_sizes(max_num_seqs),
            block_size=cache.block_size, max_model_len=max_model_len,
            scratch_block=scratch_block)
    except Exception as error:  # a GPU run must still produce results: eager, and say why
        counter.capture_error = repr(error)
        warnings.warn(f"CUDA-graph capture failed, decoding eagerly: {error!r}", stacklevel=3)


def hybrid_kv_groups(a: EngineArgs, cfg: ModelConfig, quant: EngineQuantization,
                     transfer: Any, speculator: Speculator | None
                     ) -> tuple[KVCacheGroup, ...] | None:
    """The KV cache groups of a model with sliding-window layers (a block table each, their
    windows releasing what falls out of them: :mod:`kvlab.core.hybrid_kv_cache_manager`);
    None for one table for all layers (no window, or ``disable_hybrid_kv_cache_manager``).
    ValueError for what the per-group layout does not support."""
    if not any(cfg.layer_windows) or a.disable_hybrid_kv_cache_manager:
        return None
    unsupported = {"speculative_config": speculator is not None,
                   "kv_transfer_config": transfer is not None,
                   f"kv_cache_dtype={quant.kv.name!r}": quant.kv.quantized,
                   "kv_events_config": a.kv_events_config is not None}
    for what, used in unsupported.items():
        if used:
            raise ValueError(f"LLMEngine: {what} is not supported with sliding-window layers' "
                             "per-group KV tables; pass disable_hybrid_kv_cache_manager=True "
                             "to keep one full table for all layers")
    return group_layers(cfg.layer_windows)


def load_engine_checkpoint(model: str | Path | LoadedCheckpoint, quant: EngineQuantization,
                           device: torch.device, dtype: torch.dtype) -> LoadedCheckpoint:
    """Load ``model`` (or take a LoadedCheckpoint in place, moved to ``device``/``dtype``) and
    apply the weight quantization."""
    if isinstance(model, LoadedCheckpoint):
        ckpt = model
        ckpt.model.to(device=device, dtype=dtype)
        # RoPE frequencies stay float32 (recomputed: a cast to half precision loses bits)
        cfg = ckpt.config
        ckpt.model.inv_freq = cfg.rope.inv_freq(cfg.head_dim,
                                                cfg.max_position_embeddings).to(device)
    else:
        ckpt = quant.load(model, dtype=dtype, device=device)
    quant.apply(ckpt)
    return ckpt


def resolve_max_model_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    """``max_model_len`` (default: the model's positions), at most the positions scaled by the
    RoPE factor."""
    longest = cfg.max_position_embeddings * (
        cfg.rope.factor if cfg.rope.rope_type != "default" else 1)
    if max_model_len is None:
        return cfg.max_position_embeddings
    if max_model_len > longest:
        raise ValueError(f"LLMEngine: max_model_len must be in 1..{int(longest)} (the "
                         f"model's positions, scaled by its RoPE factor), got {max_model_len}")
    return max_model_len


def engine_cache_scope(ckpt: LoadedCheckpoint, tokenizer: Tokenizer | None, block_size: int,
                       security_domain: str, quant: EngineQuantization,
                       dtype: torch.dtype) -> tuple:
    """The prefix-cache scope (spec rule 4) of an engine's requests, as a hashable key."""
    cfg = ckpt.config
    rope = cfg.rope
    return CacheScope(
        model=cfg.architecture,
        weights_version=ckpt.weights_hash,
        tokenizer=tokenizer.hash if tokenizer is not None else "none",
        chat_template="none",  # kvlab applies no chat template; tokenizer hash covers config
        adapter="none",
        rope=(f"type={rope.rope_type},theta={rope.theta},factor={rope.factor},"
              f"low={rope.low_freq_factor},high={rope.high_freq_factor},"
              f"orig={rope.original_max_position_embeddings}"),
        kv_layout=f"paged[block={block_size}][kv_heads={cfg.num_kv_heads}]"
                  f"[head_dim={cfg.head_dim}]"
                  + (f"[windows={','.join(map(str, cfg.layer_windows))}]"
                     if any(cfg.layer_windows) else ""),
        security_domain=security_domain,
        **quant.scope_fields(dtype),
    ).key()


@dataclass
class EngineParts:
    """What an :class:`~kvlab.engine.llm_engine.LLMEngine` is made of."""

    quantization: EngineQuantization
    checkpoint: LoadedCheckpoint
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    speculator: Speculator | None
    max_model_len: int
    num_blocks: int
    cache: Any                      # PagedKVCache, the quantized cache of kv_cache_dtype, or
                                    # a GroupedKVCache (sliding-window layers)
    kv: Any                         # KVCacheManager, or HybridKVCacheManager
    scheduler_config: SchedulerConfig
    scheduler: Scheduler
    kv_transfer: Any                # KVTransfer (chapter 10) or None
    executor: ModelRunner
    eos_token_ids: tuple[int, ...]
    structured_outputs: StructuredOutputManager
    kv_events_config: Any           # KVEventsConfig when KV events are published, else None


def build_parts(a: EngineArgs) -> EngineParts:
    """Build an engine's parts from ``a`` in dependency order; every argument is checked before
    the part it shapes is allocated; the tokenizer is the model directory's unless
    ``a.tokenizer`` is given."""
    quant = EngineQuantization.resolve(a.quantization, a.quantization_group_size,
                                       a.kv_cache_dtype)
    transfer = parse_kv_transfer(a.kv_transfer_config, a.enable_prefix_caching, quant)
    dev = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, dev)
    ckpt = load_engine_checkpoint(a.model, quant, dev, dtype)
    cfg = ckpt.config
    tokenizer = a.tokenizer if a.tokenizer is not None else load_tokenizer(ckpt.path)
    speculator = Speculator.load(a.speculative_config, cfg, tokenizer, dev, dtype)
    max_model_len = resolve_max_model_len(cfg, a.max_model_len)
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups = hybrid_kv_groups(a, cfg, quant, transfer, speculator)
    prefill_chunk = a.max_prefill_chunk or a.max_num_batched_tokens
    if groups is None:
        block_bytes, per_request = (quant.kv_bytes_per_token(cfg, itemsize) + Speculator.kv_bytes(
            speculator, itemsize)) * a.block_size, None
    else:   # a block is a page in each layer slot of one group
        slots = max(len(g.layers) for g in groups)
        block_bytes = 2 * slots * cfg.num_kv_heads * cfg.head_dim * itemsize * a.block_size
        per_request = sum(window_blocks(g.window, max_model_len, a.block_size, prefill_chunk)
                          for g in groups)
    size = size_kv_cache(
        block_bytes=block_bytes, block_size=a.block_size, num_blocks=a.num_blocks,
        kv_cache_memory=a.kv_cache_memory, max_num_seqs=a.max_num_seqs,
        max_model_len=max_model_len, device=dev, blocks_per_request=per_request)
    ckpt.model.prepare_rope(max_model_len)
    drafts = (speculator.draft.model,) if speculator and speculator.draft else ()
    linear = select_linear_method(dev, dtype)    # CPU: oneDNN, each weight packed once
    for model in (ckpt.model, *drafts):
        model.use_linear_method(linear)
    kernels = select_kernels(dev, dtype)         # attention backend and layer ops
    graphs = use_decode_graphs(a, dev, quant, speculator) and groups is None
    if groups is None:
        # with graphs, one block past the manager's: the padded rows' scratch block
        cache = quant.make_kv_cache(cfg, size.num_blocks + graphs, a.block_size, dtype, dev)
        kv = KVCacheManager(size.num_blocks, a.block_size,
                            enable_prefix_caching=a.enable_prefix_caching)
    else:
        from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
        from kvlab.engine.grouped_kv_cache import GroupedKVCache
        cache = GroupedKVCache(groups, size.num_blocks, a.block_size, cfg.num_kv_heads,
                               cfg.head_dim, dtype=dtype, device=dev)
        kv = HybridKVCacheManager(size.num_blocks, a.block_size, [g.window for g in groups],
                                  enable_prefix_caching=a.enable_prefix_caching,
                                  chunk_tokens=prefill_chunk)
    # A step's batch never holds more requests than tokens (each entry takes >= 1), so the
    # schedulers' rule max_num_seqs <= max_num_batched_tokens loses nothing here.
    scheduler_config = SchedulerConfig(
        max_num_seqs=min(a.max_num_seqs, a.max_num_batched_tokens),
        max_num_batched_tokens=a.max_num_batched_tokens,
        prefill_chunk=prefill_chunk,
        num_lookahead_tokens=speculator.num_lookahead if speculator else 0,
        async_scheduling=a.async_scheduling)
    scheduler = make_scheduler(a.scheduler, kv, scheduler_config)
    kv_transfer = None
    if transfer is not None:   # prefill/decode disaggregation (chapter 10)
        from kvlab.engine.kv_transfer import KVPayloadCodec, KVTransfer, engine_model_fields
        kv_transfer = KVTransfer(transfer, KVPayloadCodec(cache),
                                 engine_model_fields(ckpt.weights_hash, cfg, dtype))
        scheduler = kv_transfer.wrap(scheduler)
    eos = tuple(dict.fromkeys(cfg.eos_token_ids + ckpt.generation_eos))
    structured = StructuredOutputManager(tokenizer, cfg.vocab_size, eos)
    if groups is not None and len(groups) > 1:   # a table per group in the runner's rows
        from kvlab.engine.hybrid_input_batch import HybridInputBatch
        layer_group = [next(i for i, g in enumerate(groups) if layer in g.layers)
                       for layer in range(cfg.num_layers)]
        executor = ModelRunner(ckpt.model, cache, kernels, structured, eos,
                               HybridInputBatch(a.block_size, layer_group, dev))
    else:
        executor = Speculator.make_executor(speculator, ckpt.model, cache, max_model_len,
                                            kernels, structured, eos)
    if graphs:
        capture_decode_graphs(executor, cache, scheduler_config.max_num_seqs, max_model_len,
                              scratch_block=size.num_blocks)
    events = None
    if a.kv_events_config is not None:   # checked in EngineArgs; the engine attaches it
        from kvlab.engine.kv_events import KVEventsConfig
        events = KVEventsConfig.parse(a.kv_events_config)
    return EngineParts(quant, ckpt, tokenizer, dev, dtype, speculator, max_model_len,
                       size.num_blocks, cache, kv, scheduler_config, scheduler, kv_transfer,
                       executor, eos, structured, events if events and events.enabled else None)
