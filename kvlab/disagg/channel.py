"""Torch-free transport pieces shared by every connector: the stream inbox, the in-process
channel, and the producer's entry writer (descriptor + header + faults + send)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvlab.core.request import RuntimeRequest
from kvlab.disagg.entry import Delivery, decode_frame, encode_frame, make_descriptor, make_header
from kvlab.disagg.interfaces import scope_domain
from kvlab.disagg.transfer_faults import SendPlan, TransferFaultInjector

__all__ = ["EntryExporter", "InProcessChannel", "Inbox"]


class Inbox:
    """Frames received by a stream consumer, parsed and kept by entry key (thread-safe)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.cond = threading.Condition()
        self._by_key: dict[str, list[Delivery]] = {}
        self._garbage: list[Delivery] = []
        self.frames = 0
        self.history: list[bytes] = []     # every frame received, for replay()

    def put(self, frame: bytes) -> None:
        d = decode_frame(frame, self.source)
        with self.cond:
            self.frames += 1
            self.history.append(frame)
            if d.key is None:
                self._garbage.append(d)
            else:
                self._by_key.setdefault(d.key, []).append(d)
            self.cond.notify_all()

    def fetch(self, keys: Sequence[str]) -> list[Delivery]:
        with self.cond:
            out, self._garbage = self._garbage, []
            for key in keys:
                out += self._by_key.pop(key, [])
            return out

    def wait(self, timeout: float) -> None:
        with self.cond:
            self.cond.wait(timeout)

    def replay(self) -> None:
        """Receive every frame seen so far once more (a restarted consumer re-reading)."""
        with self.cond:
            frames, self.history = self.history, []
            self._by_key, self._garbage = {}, []
        for frame in frames:
            self.put(frame)


class InProcessChannel(Inbox):
    """An in-memory stream between a producer and a consumer in one process."""

    def __init__(self) -> None:
        super().__init__("inprocess")

    def send(self, key: str, plan: SendPlan) -> None:
        for frame in plan.frames:
            self.put(frame)
        if plan.partial is not None:
            self.put(plan.partial)     # the stream ends mid-frame: the reader sees it short

    def close(self) -> None:
        pass



class EntryExporter:
    """The producer's :class:`~kvlab.disagg.interfaces.KVExporter`: ``read(blocks, tokens)``
    gives the payload bytes; the descriptor, sealed header and frame are built here, the
    ``injector`` applies the send-point faults, and ``connector.send`` writes the result."""

    def __init__(self, read: Callable[[Sequence[int], int], bytes],
                 model_fields: Mapping[str, Any], connector: Any,
                 injector: TransferFaultInjector | None = None) -> None:
        self.read, self.model_fields, self.connector = read, dict(model_fields), connector
        self.injector = injector if injector is not None else TransferFaultInjector()
        self.exported_bytes = 0
        self.exported = 0

    def export(self, request: RuntimeRequest, blocks: Sequence[int], num_tokens: int) -> None:
        payload = self.read(blocks, num_tokens)
        desc = make_descriptor(request.request_id, request.prompt_token_ids,
                               scope_domain(request.scope), self.model_fields)
        header = make_header(desc, num_tokens, payload)
        self.exported_bytes += len(payload)
        self.exported += 1
        self.connector.send(header["key"], self.injector.on_send(encode_frame(header, payload)))

    def flush(self) -> None:
        """Send the frames an ``out_of_order`` fault still holds back."""
        held = self.injector.flush()
        if held:
            self.connector.send("", SendPlan(held))
