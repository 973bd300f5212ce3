"""Spec rule 9 — prefill/decode disaggregation: the immutable KV layout descriptor check.

Before a decode worker installs KV computed elsewhere it checks that the descriptor carries every
field of ``REQUIRED_KV_FIELDS`` and agrees with what the worker expects on each expected field.
"""

from __future__ import annotations

__all__ = ["REQUIRED_KV_FIELDS", "validate_kv_descriptor"]

REQUIRED_KV_FIELDS = {
    "request_id", "model_version", "token_ids_hash", "layers",
    "kv_heads", "head_dim", "dtype", "layout", "rope", "security_domain",
}


def validate_kv_descriptor(descriptor, expected):
    """Return the descriptor's request_id, or raise ValueError naming missing/mismatched fields."""
    missing = REQUIRED_KV_FIELDS - descriptor.keys()
    if missing:
        raise ValueError(f"missing KV fields: {sorted(missing)}")
    mismatch = {
        key: (descriptor.get(key), value)
        for key, value in expected.items()
        if descriptor.get(key) != value
    }
    if mismatch:
        raise ValueError(f"incompatible KV descriptor: {mismatch}")
    return descriptor["request_id"]
