"""KV-cache storage dtypes and their byte arithmetic (pure Python; no torch).

The engine's ``kv_cache_dtype`` is one of :data:`KV_CACHE_DTYPES`:

- ``"auto"``: K and V are stored in the model dtype (4 bytes for float32, 2 for bf16/fp16);
- ``"int8"``: symmetric int8 with one fp16 scale per (token, KV head): ``s = max|x| / 127``;
- ``"fp8_e4m3"``: float8 e4m3 with one fp16 scale per (token, KV head): ``s = max|x| / 448``.

**Why one scale per token and head (not per block and head).** A block is filled one token at a
time by decode steps. With a per-block scale, a later token larger than the block's current
scale forces either clipping or requantising the tokens already stored, so the stored bytes of a
token would depend on *which tokens came after it in its block*. The prefix cache shares a
block's KV between requests on the promise that it depends only on the prefix (spec rule 4);
a per-token scale keeps that promise (a token's bytes are fixed when it is written), keeps
copy-on-write a plain copy, and costs ``scale_bytes / head_dim`` per element (2/32 = 0.0625
bytes for kvlab-tiny, 2/128 for Llama-sized heads).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KV_CACHE_DTYPES", "KVDtypeSpec", "kv_bytes_per_token", "kv_dtype_spec"]


@dataclass(frozen=True)
class KVDtypeSpec:
    """How one KV element is stored: payload bytes, the per-(token, head) scale's bytes, the
    largest representable magnitude of the payload (``qmax``; None for ``auto``)."""

    name: str
    payload_bytes: float | None      # None: the model dtype's size
    scale_bytes: int                 # per (token, KV head); 0 without a scale
    qmax: float | None
    planner_dtype: str | None        # the capacity planner's name (kvlab.labs.capacity)

    @property
    def quantized(self) -> bool:
        return self.payload_bytes is not None

    def schema(self) -> str:
        """Canonical text of the storage schema, part of the prefix-cache scope (rule 4)."""
        if not self.quantized:
            return "none"
        return f"kv={self.name};scale=fp16/token/head;qmax={self.qmax:g};symmetric"

    def element_bytes(self, head_dim: int, model_dtype_bytes: int) -> float:
        """Bytes per K or V element, the scale spread over its ``head_dim`` elements."""
        if not self.quantized:
            return float(model_dtype_bytes)
        return self.payload_bytes + self.scale_bytes / head_dim  # type: ignore[operator]


KV_CACHE_DTYPES: dict[str, KVDtypeSpec] = {
    "auto": KVDtypeSpec("auto", None, 0, None, None),
    "int8": KVDtypeSpec("int8", 1, 2, 127.0, "int8"),
    "fp8_e4m3": KVDtypeSpec("fp8_e4m3", 1, 2, 448.0, "fp8"),
}


def kv_dtype_spec(kv_cache_dtype: object) -> KVDtypeSpec:
    """The spec of ``kv_cache_dtype``; ValueError naming the accepted values otherwise."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       kv_cache_dtype: str = "auto", model_dtype_bytes: int = 4) -> int:
    """Exact bytes one token's K and V take in the engine's cache, scales included:
    ``2 · layers · kv_heads · (head_dim · payload + scale)`` (payload = model dtype for auto)."""
    spec = kv_dtype_spec(kv_cache_dtype)
    payload = model_dtype_bytes if not spec.quantized else spec.payload_bytes
    per_head = head_dim * payload + spec.scale_bytes  # type: ignore[operator]
    return int(2 * num_layers * num_kv_heads * per_head)
