"""The compatibility scope of a cached KV prefix (spec rule 4).

Two requests may share KV only when every input that shaped that KV is identical: the exact
token ids (the cache key's token part) and everything in :class:`CacheScope`: model and weights
version, tokenizer and chat template, adapter, RoPE configuration, KV dtype, layout and
quantisation schema, and the security domain (tenant) that may read the KV. A natural-language
string is never a key: two tokenizers split one string differently, and a template changes the
tokens around it.

Every field is required. There are no defaults, because a default is a value that silently
matches: a scope built without naming its adapter would hit KV computed *with* an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SCOPE_FIELDS: tuple[str, ...] = (
    "model",
    "weights_version",
    "tokenizer",
    "chat_template",
    "adapter",
    "rope",
    "kv_dtype",
    "kv_layout",
    "quant_schema",
    "security_domain",
)


@dataclass(frozen=True)
class CacheScope:
    """Everything besides token ids that a cached KV block depends on. Immutable and hashable.

    Values are strings (use ``"none"`` explicitly for "no adapter" / "no quantisation" and a
    canonical text such as ``"theta=500000,scaling=none"`` for RoPE). :meth:`key` is the tuple the
    prefix caches compare with ``==``: two scopes share KV iff their keys are equal.
    """

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


def scope_key(scope: CacheScope | tuple | list) -> tuple:
    """Normalise a scope for use as a dictionary key.

    A :class:`CacheScope` gives its :meth:`~CacheScope.key`; any other iterable becomes a tuple,
    exactly as the reference ``PrefixCache`` does (``tuple(scope)``). Raises TypeError when the
    result is not hashable.
    """
    key = scope.key() if isinstance(scope, CacheScope) else tuple(scope)
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"cache scope must be hashable, got {key!r}") from None
    return key
