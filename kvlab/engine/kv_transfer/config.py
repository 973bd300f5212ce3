"""``kv_transfer_config``: parsed and validated at the engine's boundary (vLLM's dict shape).

``{"kv_connector": "shared_storage" | "tcp" | "inprocess", "kv_role": "kv_producer" |
"kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}``. Extra keys:

==========================  ==================================================================
``shared_storage_path``     shared_storage: the directory of entries (required)
``host``, ``port``          tcp: the consumer listens on ``host:port`` (loopback only; port 0
                            picks a free port, read it from ``connector.port``); the producer
                            connects there (port required)
``channel``                 inprocess: an :class:`~.connectors.InProcessChannel` both share
``on_failure``              ``"recompute"`` (default) or ``"fail"``: what a consumer does with
                            a request whose KV is missing or refused
``timeout_s``               how long a consumer waits for an entry (default 5 s; kv_both: 0)
``fault_schedule``          a :class:`~kvlab.disagg.transfer_faults.FaultSchedule` or its dict
==========================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.disagg.transfer_faults import FaultSchedule

__all__ = ["KV_CONNECTORS", "KV_ROLES", "KVTransferConfig"]

KV_CONNECTORS = ("shared_storage", "tcp", "inprocess")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_EXTRA = {"shared_storage": {"shared_storage_path"}, "tcp": {"host", "port"},
          "inprocess": {"channel"}}
_COMMON = {"on_failure", "timeout_s", "fault_schedule"}
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    on_failure: str = "recompute"
    timeout_s: float = 5.0
    faults: FaultSchedule = field(default_factory=FaultSchedule)

    @property
    def produce(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consume(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, config: Any) -> KVTransferConfig:
        """ValueError / TypeError naming the problem for anything malformed."""
        if isinstance(config, KVTransferConfig):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"kv_transfer_config must be a dict, got {type(config).__name__}")
        unknown = set(config) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}")
        conn, role = config.get("kv_connector"), config.get("kv_role")
        if conn not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector must be one of {KV_CONNECTORS}, "
                             f"got {conn!r}")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {KV_ROLES}, "
                             f"got {role!r}")
        extra = config.get("kv_connector_extra_config") or {}
        if not isinstance(extra, Mapping):
            raise TypeError("kv_transfer_config: kv_connector_extra_config must be a dict")
        bad = set(extra) - _EXTRA[conn] - _COMMON
        if bad:
            raise ValueError(f"kv_connector_extra_config: unknown keys {sorted(bad)} for "
                             f"{conn!r}; allowed: {sorted(_EXTRA[conn] | _COMMON)}")
        _check_extra(conn, role, extra)
        on_failure = extra.get("on_failure", "recompute")
        if on_failure not in ("recompute", "fail"):
            raise ValueError(f"kv_connector_extra_config: on_failure must be 'recompute' or "
                             f"'fail', got {on_failure!r}")
        timeout = extra.get("timeout_s", 0.0 if role == "kv_both" else 5.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"kv_connector_extra_config: timeout_s must be a number >= 0, "
                             f"got {timeout!r}")
        faults = extra.get("fault_schedule", FaultSchedule())
        if isinstance(faults, Mapping):
            faults = FaultSchedule.from_data(dict(faults))
        if not isinstance(faults, FaultSchedule):
            raise TypeError("kv_connector_extra_config: fault_schedule must be a FaultSchedule "
                            "or its dict")
        return cls(conn, role, dict(extra), on_failure, float(timeout), faults)


def _check_extra(conn: str, role: str, extra: Mapping[str, Any]) -> None:
    if conn == "shared_storage":
        path = extra.get("shared_storage_path")
        if not isinstance(path, (str, Path)) or not str(path):
            raise ValueError("shared_storage needs kv_connector_extra_config"
                             "['shared_storage_path'] (a directory)")
    elif conn == "tcp":
        if role == "kv_both":
            raise ValueError("the tcp connector pairs one kv_producer with one kv_consumer; "
                             "kv_both needs shared_storage or inprocess")
        host = extra.get("host", "127.0.0.1")
        if host not in _LOOPBACK:
            raise ValueError(f"the tcp connector runs on the loopback only; host {host!r} is not "
                             f"one of {_LOOPBACK}")
        port = extra.get("port", 0 if role == "kv_consumer" else None)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"tcp needs kv_connector_extra_config['port'] (an int in 0..65535; "
                             f"0 = any free port, consumer only), got {port!r}")
        if port == 0 and role != "kv_consumer":
            raise ValueError("a tcp producer must be given the consumer's port (not 0)")
    elif extra.get("channel") is None:
        raise ValueError("inprocess needs kv_connector_extra_config['channel'] "
                         "(an InProcessChannel)")
