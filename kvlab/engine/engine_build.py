"""Building an LLMEngine's parts from its arguments: checkpoint, context length, scheduler, scope.

Each function validates what it is given and raises ValueError naming the problem before
anything is allocated; :class:`~kvlab.engine.llm_engine.LLMEngine` calls them in order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvlab.core.kv_manager import KVCacheManager
from kvlab.core.policies import BaselineScheduler, ProductionScheduler
from kvlab.core.scheduler_api import Scheduler
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.scope import CacheScope

from .checkpoint import LoadedCheckpoint
from .config import ModelConfig
from .model import rope_inv_freq
from .quantization.setup import EngineQuantization
from .tokenizer import Tokenizer


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
    from .kv_transfer import KVTransferConfig
    parsed = KVTransferConfig.parse(kv_transfer_config)
    if parsed.consume and not enable_prefix_caching:
        raise ValueError("a kv_consumer installs remote KV through the prefix cache: "
                         "it needs enable_prefix_caching=True")
    if quant.kv.quantized:
        raise ValueError(f"kv_transfer_config moves unquantized KV only; it cannot be used "
                         f"with kv_cache_dtype={quant.kv.name!r}")
    return parsed


def load_engine_checkpoint(model: str | Path | LoadedCheckpoint, quant: EngineQuantization,
                           device: torch.device, dtype: torch.dtype) -> LoadedCheckpoint:
    """Load ``model`` (or take a LoadedCheckpoint in place, moved to ``device``/``dtype``) and
    apply the weight quantization."""
    if isinstance(model, LoadedCheckpoint):
        ckpt = model
        ckpt.model.to(device=device, dtype=dtype)
        # RoPE frequencies stay float32 (recomputed: a cast to half precision loses bits)
        ckpt.model.inv_freq = rope_inv_freq(ckpt.config.rope, ckpt.config.head_dim,
                                            ckpt.config.max_position_embeddings).to(device)
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
                  f"[head_dim={cfg.head_dim}]",
        security_domain=security_domain,
        **quant.scope_fields(dtype),
    ).key()
