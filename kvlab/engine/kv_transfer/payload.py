"""KV payloads: the engine's paged KV of whole blocks <-> a safetensors entry payload.

The payload of an entry (format in :mod:`kvlab.disagg.entry`) holds, for each layer ``l``,
``layers.{l}.key`` and ``layers.{l}.value`` of shape ``[num_tokens, kv_heads, head_dim]`` in the
engine's KV dtype, token-major, so producer and consumer may use different block sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvlab.disagg.entry import LAYOUT, Delivery
from kvlab.engine.kv_cache import PagedKVCache

__all__ = ["KVPayloadCodec", "engine_model_fields", "rope_string"]


def rope_string(rope: Any) -> str:
    """The RoPE parameters as one comparable string (same spelling as the cache scope)."""
    return (f"type={rope.rope_type},theta={rope.theta},factor={rope.factor},"
            f"low={rope.low_freq_factor},high={rope.high_freq_factor},"
            f"orig={rope.original_max_position_embeddings}")


def engine_model_fields(weights_hash: str, cfg: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The model part of a descriptor: what producer and consumer must agree on."""
    return {"model_version": weights_hash, "layers": cfg.num_layers,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "dtype": str(dtype).replace("torch.", ""), "layout": LAYOUT,
            "rope": rope_string(cfg.rope)}


class KVPayloadCodec:
    """Reads whole blocks of ``cache`` into payload bytes and writes payloads into blocks.

    It is both the producer's reader and the consumer's
    :class:`~kvlab.disagg.interfaces.KVWriter`.
    """

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.layers, _, _, self.block_size, self.kv_heads, self.head_dim = cache.data.shape
        self.dtype = cache.data.dtype

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(blocks), dtype=torch.long, device=self.cache.data.device)

    def gather(self, blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
        """``[layers, 2, num_tokens, kv_heads, head_dim]`` of the first tokens of ``blocks``."""
        if num_tokens > len(blocks) * self.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {len(blocks)} blocks")
        x = self.cache.data[:, :, self._index(blocks)]
        return x.reshape(self.layers, 2, -1, self.kv_heads, self.head_dim)[:, :, :num_tokens]

    def export(self, blocks: Sequence[int], num_tokens: int) -> bytes:
        """The safetensors payload of the first ``num_tokens`` tokens held in ``blocks``."""
        x = self.gather(blocks, num_tokens).to("cpu")
        tensors = {}
        for layer in range(self.layers):
            tensors[f"layers.{layer}.key"] = x[layer, 0].contiguous()
            tensors[f"layers.{layer}.value"] = x[layer, 1].contiguous()
        return st_save(tensors, metadata={"format": "kvlab-kv/1", "num_tokens": str(num_tokens)})

    def decode(self, delivery: Delivery, num_tokens: int) -> torch.Tensor:
        """``[layers, 2, num_tokens, kv_heads, head_dim]`` on the cache's device; ValueError
        naming the problem when the payload does not hold exactly this engine's layout."""
        try:
            tensors = st_load(delivery.payload)
        except (SafetensorError, ValueError, RuntimeError) as error:
            raise ValueError(f"payload is not a readable safetensors file: {error}") from None
        names = {f"layers.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")}
        if set(tensors) != names:
            raise ValueError(f"payload tensors {sorted(set(tensors) ^ names)[:4]} do not match "
                             f"{self.layers} layers of key/value")
        shape = (delivery.num_tokens, self.kv_heads, self.head_dim)
        for name, t in tensors.items():
            if tuple(t.shape) != shape or t.dtype != self.dtype:
                raise ValueError(f"payload {name} is {tuple(t.shape)} {t.dtype}, expected "
                                 f"{shape} {self.dtype}")
        if num_tokens > delivery.num_tokens:
            raise ValueError(f"payload holds {delivery.num_tokens} tokens, {num_tokens} needed")
        x = torch.stack([torch.stack([tensors[f"layers.{i}.key"], tensors[f"layers.{i}.value"]])
                         for i in range(self.layers)])
        return x[:, :, :num_tokens].to(self.cache.data.device)

    def write(self, decoded: torch.Tensor, blocks: Sequence[int], first_token: int) -> None:
        """Write tokens ``[first_token, first_token + len(blocks) * block_size)`` of ``decoded``
        into ``blocks`` (whole blocks; ``first_token`` is a multiple of the block size)."""
        bs = self.block_size
        end = first_token + len(blocks) * bs
        if first_token % bs or end > decoded.shape[2]:
            raise ValueError(f"cannot write tokens [{first_token}, {end}) of a payload of "
                             f"{decoded.shape[2]} tokens into whole blocks of {bs}")
        if not blocks:
            return
        part = decoded[:, :, first_token:end].reshape(
            self.layers, 2, len(blocks), bs, self.kv_heads, self.head_dim)
        self.cache.data[:, :, self._index(blocks)] = part
