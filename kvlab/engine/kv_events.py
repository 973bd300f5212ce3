"""KV events: the prefix cache's changes published in vLLM's protocol, so that a router can see
which replica holds which prefix (chapter 13).

What ``EngineArgs(kv_events_config=...)`` (``kvlab serve --kv-events-config '<JSON>'``) builds,
read from vLLM 0.32's ``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py`` and
``vllm/v1/core/block_pool.py``:

- **Config**: vLLM's JSON (:class:`KVEventsConfig`): ``enable_kv_cache_events``, ``publisher``
  (``"zmq"`` or ``"null"``), ``endpoint`` (a wildcard, ``ipc://`` or ``inproc://`` address is
  bound, any other connected), ``replay_endpoint``, ``buffer_steps``, ``hwm``,
  ``max_queue_size``, ``topic``. Off by default: no listener, no thread, no socket, and
  neither pyzmq nor msgspec is imported.
- **Events**: :class:`BlockStored` (the new blocks of one insert: their hashes, the parent's,
  their tokens), :class:`BlockRemoved` (one evicted block), :class:`AllBlocksCleared`, sent as
  one :class:`KVEventBatch` per engine step that changed the cache. They are msgspec structs
  declared as vLLM declares them, so the msgpack bytes are the ones vLLM's encoder writes for the
  same values (tested by decoding and re-encoding kvlab's stream with vLLM's own types).
- **Block hashes**: vLLM's default (``prefix_caching_hash_algo="sha256"``): a chain
  ``h_i = sha256(pickle((h_{i-1}, tokens_i, extra_keys_i)))`` from ``NONE_HASH =
  sha256(pickle(seed))``, the seed ``$PYTHONHASHSEED`` or ``"vllm-none-hash"``; published as
  the low 64 bits (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default; ``=0``
  publishes the 32 bytes). A security domain other than the engine's own salts the first block
  as vLLM's ``cache_salt`` does. The same prefix thus has the same hash on a kvlab and a vLLM
  replica.
- **Wire**: a ZMQ PUB socket sends ``(topic, seq, payload)`` frames, ``seq`` an 8-byte
  big-endian counter from 0; a ROUTER replay socket answers ``(client, b"", start_seq)`` with
  every buffered frame from ``start_seq`` on, then ``(b"", -1, b"")``. Encoding and sending run
  in a publisher thread; the engine step only appends events.

:class:`KVEventIndex` is the consumer side: what a router rebuilds from the stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

import msgspec

from kvlab.core.radix_cache import RadixCache, RadixNode

__all__ = ["AllBlocksCleared", "BlockHasher", "BlockRemoved", "BlockStored", "EventBatch",
           "KVEventBatch", "KVEventIndex", "KVEventRecorder", "KVEvents", "KVEventsConfig",
           "ZmqEventPublisher", "decode_batch", "encode_batch", "radix_prefixes"]

#: the storage tier vLLM names the engine's own KV pool (its CPU build says "GPU" too)
MEDIUM = "GPU"
#: vLLM's fixed seed for NONE_HASH when PYTHONHASHSEED is unset (cryptographic hashes)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: the replay socket's end-of-sequence marker, as vLLM sends it
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``): same keys, same defaults;
    ``publisher`` defaults to ``"zmq"`` when events are enabled, else ``"null"``."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events must be a bool, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config: {name} must be a str, "
                                 f"got {getattr(self, name)!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str)
                                      or not value.startswith(("tcp://", "ipc://", "inproc://"))):
                raise ValueError(f"kv_events_config: {name} must be a tcp://, ipc:// or "
                                 f"inproc:// address, got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"kv_events_config: {name} must be a positive int, "
                                 f"got {value!r}")

    @property
    def enabled(self) -> bool:
        """Whether an engine built with this config publishes anything."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """A config from vLLM's JSON (a dict or its text); None stays None. ValueError naming
        an unknown key or a bad value."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"kv_events_config is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"kv_events_config: unknown key {unknown[0]!r} (vLLM's keys: "
                             f"{', '.join(sorted(known))})")
        return cls(**value)


# ------------------------------------------------------------------------------- protocol
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A map on the wire, tagged ``{"type": <class name>, ...}``; defaults omitted."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes; msgspec.ValidationError / DecodeError if malformed."""
    return _DECODER.decode(payload)


# --------------------------------------------------------------------------------- hashes
class BlockHasher:
    """vLLM's ``sha256`` prefix-cache hash chain (``hash_block_tokens``, ``init_none_hash``):
    ``block_hash(parent, tokens, extra)`` is sha256 of the pickled ``(parent or NONE_HASH,
    tokens, extra)``. ``as_int``: publish the low 64 bits, as vLLM does by default."""

    def __init__(self, seed: str | None = None, *, as_int: bool | None = None) -> None:
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
        if as_int is None:
            as_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
        self.none_hash = self._sha256(seed)
        self.as_int = as_int

    @staticmethod
    def _sha256(value: object) -> bytes:
        return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    def block_hash(self, parent: bytes | None, tokens: Sequence[int],
                   extra: tuple | None = None) -> bytes:
        return self._sha256((parent or self.none_hash, tuple(tokens), extra))

    def external(self, value: bytes) -> bytes | int:
        """The hash as published (vLLM's ``maybe_convert_block_hash``)."""
        return int.from_bytes(value, "big") & ((1 << 64) - 1) if self.as_int else value


# ------------------------------------------------------------------------------- recorder
class KVEventRecorder:
    """A :class:`~kvlab.core.radix_cache.CacheListener` that turns the radix cache's changes
    into vLLM events, held until :meth:`take`. ``salt_of(scope)`` names the ``cache_salt`` of a
    scope's first block (None: unsalted). Memory: one hash per cached block."""

    def __init__(self, block_size: int, hasher: BlockHasher,
                 salt_of: Callable[[tuple], str | None] = lambda scope: None) -> None:
        self.block_size = block_size
        self.hasher = hasher
        self.salt_of = salt_of
        self._hashes: dict[RadixNode, bytes] = {}
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(self, nodes: Sequence[RadixNode]) -> None:
        parent = nodes[0].parent
        assert parent is not None
        parent_hash = None if parent.is_root else self._hashes[parent]
        hashes, extras, tokens = [], [], []
        previous = parent_hash
        for node in nodes:
            salt = self.salt_of(node.scope) if node.depth == 1 else None
            previous = self.hasher.block_hash(
                previous, node.chunk, (("cache_salt", salt),) if salt else None)
            self._hashes[node] = previous
            hashes.append(self.hasher.external(previous))
            extras.append((salt,) if salt else None)
            tokens.extend(node.chunk)
        self._events.append(BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent_hash is None else self.hasher.external(parent_hash),
            token_ids=tokens, block_size=self.block_size, lora_id=None, medium=MEDIUM,
            lora_name=None, extra_keys=extras, group_idx=0,
            kv_cache_spec_kind="full_attention"))

    def removed(self, node: RadixNode) -> None:
        self._events.append(BlockRemoved(
            block_hashes=[self.hasher.external(self._hashes.pop(node))], medium=MEDIUM,
            group_idx=0))

    def cleared(self) -> None:
        self._hashes.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events


# ------------------------------------------------------------------------------ publisher
def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, ipc:// and inproc:// endpoints, connect to the others."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket (and optional ROUTER replay socket) fed from a queue by one thread, with the
    last ``buffer_steps`` payloads kept for replay. ``endpoint``: the address bound or
    connected (a ``:0`` port resolved). Thread-safe :meth:`publish`; :meth:`shutdown` sends
    what is queued, then closes."""

    SHUTDOWN_TIMEOUT = 2.0

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self._zmq = zmq
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = count()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = self._attach(self._pub, config.endpoint)
        self._replay = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = self._attach(self._replay, config.replay_endpoint, bind=True)
        self.published = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvlab-kv-events", daemon=True)
        self._thread.start()

    def _attach(self, sock: Any, endpoint: str, *, bind: bool | None = None) -> str:
        if bind if bind is not None else _binds(endpoint):
            sock.bind(endpoint)
            return sock.getsockopt_string(self._zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch (blocks while ``max_queue_size`` batches wait); RuntimeError once
        shut down."""
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        self._queue.put(batch)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            seq = next(self._seq)
            payload = encode_batch(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        """Send what is queued (up to :attr:`SHUTDOWN_TIMEOUT` s), stop the thread, close."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


class KVEvents:
    """An engine's KV events: the recorder on its radix cache and the publisher. The engine
    calls :meth:`flush` after each step (one batch when the cache changed) and :meth:`close`
    when it stops."""

    def __init__(self, config: KVEventsConfig, cache: RadixCache,
                 salt_of: Callable[[tuple], str | None]) -> None:
        assert config.enabled
        self.config = config
        self.recorder = KVEventRecorder(cache.block_size, BlockHasher(), salt_of)
        self.publisher = ZmqEventPublisher(config)
        cache.listener = self.recorder
        self._cache = cache

    @classmethod
    def create(cls, config: KVEventsConfig | None, cache: RadixCache | None,
               salt_of: Callable[[tuple], str | None]) -> KVEvents | None:
        """None unless ``config`` enables publishing; ValueError without a prefix cache."""
        if config is None or not config.enabled:
            return None
        if cache is None:
            raise ValueError("kv_events_config publishes the prefix cache's changes: it needs "
                             "enable_prefix_caching=True")
        return cls(config, cache, salt_of)

    def flush(self, ts: float | None = None) -> int:
        """Publish the events recorded since the last flush as one batch; how many."""
        events = self.recorder.take()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time() if ts is None else ts,
                                                events=events, data_parallel_rank=0))
        return len(events)

    def close(self) -> None:
        self.flush()
        self._cache.listener = None
        self.publisher.shutdown()


# ------------------------------------------------------------------------------- consumer
Prefix = tuple[tuple | None, tuple[int, ...]]


class KVEventIndex:
    """What a subscriber rebuilds from one publisher's stream: ``hash -> (parent hash, tokens,
    extra keys)`` of every block it holds. :meth:`prefixes` spells each block's whole prefix."""

    def __init__(self) -> None:
        self.blocks: dict[bytes | int, tuple[bytes | int | None, tuple[int, ...],
                                             tuple | None]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent, size = event.parent_block_hash, event.block_size
                extras = event.extra_keys or [None] * len(event.block_hashes)
                for i, block_hash in enumerate(event.block_hashes):
                    chunk = tuple(event.token_ids[i * size:(i + 1) * size])
                    self.blocks[block_hash] = (parent, chunk, extras[i])
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.blocks.pop(block_hash, None)
            else:
                self.blocks.clear()

    def apply_all(self, batches: Iterable[KVEventBatch]) -> KVEventIndex:
        for batch in batches:
            self.apply(batch)
        return self

    def prefixes(self) -> set[Prefix]:
        """``(first block's extra keys, tokens)`` of the prefix each held block ends;
        ValueError on a block whose parent is not held (the stream broke the tree)."""
        out = set()
        for block_hash in self.blocks:
            chunks: list[tuple[int, ...]] = []
            cursor: bytes | int | None = block_hash
            extra = None
            while cursor is not None:
                if cursor not in self.blocks:
                    raise ValueError(f"block {cursor!r} is referenced but not held")
                cursor, chunk, extra = self.blocks[cursor]
                chunks.append(chunk)
            out.add((extra, tuple(t for chunk in reversed(chunks) for t in chunk)))
        return out


def radix_prefixes(cache: RadixCache,
                   salt_of: Callable[[tuple], str | None] = lambda scope: None) -> set[Prefix]:
    """The same set read from a radix cache (each node's path; a salted scope's first block
    carries ``(salt,)`` as its event does), to compare with :meth:`KVEventIndex.prefixes`."""
    out = set()
    for scope, root in cache.roots():
        salt = salt_of(scope)
        extra = (salt,) if salt else None
        stack: list[tuple[RadixNode, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                out.add((extra, path + child.chunk))
                stack.append((child, path + child.chunk))
    return out
