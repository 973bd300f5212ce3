"""Spec rule 1 — KV capacity: how many bytes the keys and values of a batch occupy.

``M_KV = 2 · L · B · T · A_kv · D · s`` — the 2 counts K and V; L layers, B sequences,
T tokens each, A_kv KV heads, D head dimension, s bytes per element. The per-rank size may be
divided by the TP size only when the cache really is sharded by TP rank. The capacity planner
built on it is :mod:`kvlab.labs.capacity`.
"""

from __future__ import annotations

__all__ = ["kv_bytes"]


def kv_bytes(layers, batch, tokens, kv_heads, head_dim, element_bytes):
    """Bytes of K and V for ``batch`` sequences of ``tokens`` tokens (reference listing).

    Every dimension must be positive; ``element_bytes`` may be fractional (0.5 for int4).
    Divide by the tensor-parallel size only when the cache really is sharded by TP rank.
    """
    values = (layers, batch, tokens, kv_heads, head_dim, element_bytes)
    if any(v <= 0 for v in values):
        raise ValueError("KV dimensions must be positive")
    return 2 * layers * batch * tokens * kv_heads * head_dim * element_bytes
