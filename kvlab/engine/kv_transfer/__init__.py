"""KV transfer between engines (prefill/decode disaggregation), the torch side.

:class:`KVTransfer` is what ``EngineArgs(kv_transfer_config=...)`` builds: the connector
(:mod:`.connectors`), the payload codec (:mod:`.payload`), the seeded fault injector
(:mod:`kvlab.disagg.transfer_faults`) and the scheduler wrapper
(:class:`kvlab.disagg.remote_kv_scheduler.RemoteKVScheduler`) that runs the protocol inside
the engine's one step loop. The entry format is documented in :mod:`kvlab.disagg.entry`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.disagg.channel import EntryExporter
from kvlab.disagg.entry import Delivery
from kvlab.disagg.remote_kv_scheduler import RemoteKVPolicy, RemoteKVScheduler
from kvlab.disagg.transfer_faults import TransferFaultInjector
from kvlab.engine.kv_transfer.config import KV_CONNECTORS, KV_ROLES, KVTransferConfig
from kvlab.engine.kv_transfer.connectors import (
    InProcessChannel,
    SharedStorageConnector,
    TcpConnector,
)
from kvlab.engine.kv_transfer.payload import KVPayloadCodec, engine_model_fields

__all__ = ["KV_CONNECTORS", "KV_ROLES", "InProcessChannel", "KVPayloadCodec", "KVTransfer",
           "KVTransferConfig", "SharedStorageConnector", "TcpConnector", "engine_model_fields"]


def make_connector(config: KVTransferConfig) -> Any:
    extra = config.extra
    if config.kv_connector == "shared_storage":
        return SharedStorageConnector(extra["shared_storage_path"])
    if config.kv_connector == "tcp":
        role = "consumer" if config.kv_role == "kv_consumer" else "producer"
        return TcpConnector(role, extra.get("host", "127.0.0.1"), extra.get("port", 0))
    return extra["channel"]


class KVTransfer:
    """One engine's KV-transfer side: connector, codec, faults, and the scheduler wrapper.

    ``model_fields`` are this engine's descriptor fields; ``codec`` reads and writes its paged
    KV. :meth:`wrap` returns the scheduler the engine core must step.
    """

    def __init__(self, config: KVTransferConfig, codec: KVPayloadCodec,
                 model_fields: dict[str, Any]) -> None:
        self.config = config
        self.codec = codec
        self.model_fields = model_fields
        self.injector = TransferFaultInjector(config.faults)
        self.connector = make_connector(config)
        self.exporter = EntryExporter(codec.export, model_fields, self.connector, self.injector)
        self.scheduler: RemoteKVScheduler | None = None

    def flush(self) -> None:
        """Send the frames an ``out_of_order`` fault still holds back."""
        self.exporter.flush()

    # the consumer's KVSource (with the deliver-point faults)
    def fetch(self, keys: Sequence[str]) -> list[Delivery]:
        return self.injector.on_deliver(self.connector.fetch(keys))

    def wait(self, timeout: float) -> None:
        self.connector.wait(timeout)

    def wrap(self, scheduler: Any) -> RemoteKVScheduler:
        cfg = self.config
        policy = RemoteKVPolicy(self.model_fields, produce=cfg.produce, consume=cfg.consume,
                                on_failure=cfg.on_failure, timeout_s=cfg.timeout_s)
        self.scheduler = RemoteKVScheduler(
            scheduler, policy, source=self if cfg.consume else None,
            writer=self.codec if cfg.consume else None,
            exporter=self.exporter if cfg.produce else None)
        return self.scheduler

    @property
    def stats(self) -> dict[str, int]:
        """Decisions counted by kind (installed, recomputed, each reject kind, exported...)."""
        return dict(self.scheduler.stats) if self.scheduler is not None else {}

    def close(self) -> None:
        self.connector.close()
