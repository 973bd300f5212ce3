"""The compatibility scope of cached KV (spec rule 4): everything besides the token ids that a
cached block depends on. Two requests share KV only when every field is identical; a
natural-language string is never a key (two tokenizers split one string differently). No field
has a default: a default is a value that silently matches. Chapter 4 explains.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SCOPE_FIELDS: tuple[str, ...] = ("model", "weights_version", "tokenizer", "chat_template",
                                  "adapter", "rope", "kv_dtype", "kv_layout", "quant_schema",
                                  "security_domain")


@dataclass(frozen=True)
class CacheScope:
    """Everything besides token ids that a cached KV block depends on (spec rule 4). Every
    field is a required non-empty str (``"none"`` explicitly): a default would silently match."""

    model: str
    weights_version: str
    tokenizer: str
    chat_template: str
    adapter: str
    rope: str
    kv_dtype: str
    kv_layout: str
    quant_schema: str
    security_domain: str

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str):
                raise TypeError(f"CacheScope.{f.name} must be a str, got {type(value).__name__}")
            if not value:
                raise ValueError(f"CacheScope.{f.name} must be non-empty (use 'none' explicitly)")

    def key(self) -> tuple[tuple[str, str], ...]:
        """The comparable key: ``(field name, value)`` pairs in a fixed order."""
        return tuple((name, getattr(self, name)) for name in SCOPE_FIELDS)
