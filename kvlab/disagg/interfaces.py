"""The interfaces of :mod:`kvlab.disagg.remote_kv_scheduler`: what the engine plugs in
(source, writer, exporter), the policy, and the decision records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvlab.core.request import RuntimeRequest
from kvlab.disagg.entry import Delivery

__all__ = ["KVExporter", "KVSource", "KVWriter", "RemoteKVPolicy", "TransferDecision",
           "scope_domain"]


class KVSource(Protocol):
    def fetch(self, keys: Sequence[str]) -> list[Delivery]:
        """Entries that arrived for ``keys`` (non-blocking)."""
        ...

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for something new to fetch."""
        ...


class KVWriter(Protocol):
    def decode(self, delivery: Delivery, num_tokens: int) -> Any:
        """The payload's first ``num_tokens`` tokens, ready to write; ValueError if unusable."""
        ...

    def write(self, decoded: Any, blocks: Sequence[int], first_token: int) -> None:
        """Write tokens ``first_token..`` of ``decoded`` into ``blocks`` (full blocks)."""
        ...


class KVExporter(Protocol):
    def export(self, request: RuntimeRequest, blocks: Sequence[int], num_tokens: int) -> None:
        """Export the KV of the request's first ``num_tokens`` tokens, held in ``blocks``."""
        ...


@dataclass(frozen=True)
class RemoteKVPolicy:
    """``model_fields``: this engine's descriptor fields (model_version, layers, kv_heads,
    head_dim, dtype, layout, rope), the expectation a consumer checks entries against."""

    model_fields: Mapping[str, Any]
    produce: bool = False
    consume: bool = False
    on_failure: str = "recompute"
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.on_failure not in ("recompute", "fail"):
            raise ValueError(f"on_failure must be 'recompute' or 'fail', got {self.on_failure!r}")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s < 0:
            raise ValueError(f"timeout_s must be a number >= 0, got {self.timeout_s!r}")


@dataclass(frozen=True)
class TransferDecision:
    """One thing the consumer (or producer) decided, for traces and the chapter's figures."""

    step: int
    request_id: str
    kind: str            # installed, a reject kind, missing, duplicate, after_abort, exported...
    action: str          # install, recompute, fail, discard, wait, export, park
    entry_id: str = ""
    tokens: int = 0      # tokens installed (or exported)
    detail: str = ""


def scope_domain(scope: Any) -> str:
    """The security domain of a request's prefix-cache scope ("default" when it has none)."""
    try:
        return str(dict(scope).get("security_domain", "default"))
    except (TypeError, ValueError):
        return "default"


