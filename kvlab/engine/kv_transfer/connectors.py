"""The transports of KV entries: shared storage, TCP on the loopback, and an in-process channel.

All three move the same bytes (an entry: header + payload, see :mod:`kvlab.disagg.entry`)
and expose the same two sides: the producer's ``send(key, plan)`` (a
:class:`~kvlab.disagg.transfer_faults.SendPlan`: the frames to write, plus the partial write of a
producer that crashed) and the consumer's ``fetch(keys)`` / ``wait(timeout)``.

**Shared storage** (vLLM's SharedStorageConnector is the model). An entry is the directory
``<root>/<key>/`` with ``descriptor.json`` (the header) and ``kv.safetensors`` (the payload).
Writes are atomic: both files are written into ``<root>/.tmp-<key>-<unique>/``, flushed and
fsynced, the directory is fsynced, and only then renamed to ``<root>/<key>`` (``rename`` of a
directory is atomic on POSIX), and the root is fsynced. A reader looks only at names without
the ``.tmp-`` prefix, so it sees a complete entry or none; a producer that dies mid-write leaves
a ``.tmp-`` directory nobody reads. The first complete entry for a key wins.

**TCP.** The consumer listens on the loopback; a receiver thread accepts one connection per
frame (connect, write the frame, close) and reads it to EOF, so a frame cut short by a crash is
seen as short, never glued to the next one. Frames are parsed into an inbox keyed by entry key;
``fetch`` takes what arrived for the asked keys. Frames whose header cannot be parsed are handed
out once, to be counted. **In-process** does the same with a shared list instead of a socket
(the property tests' transport).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvlab.disagg.channel import Inbox, InProcessChannel
from kvlab.disagg.entry import Delivery, decode_frame, parse_entry
from kvlab.disagg.transfer_faults import SendPlan

__all__ = ["InProcessChannel", "Inbox", "SharedStorageConnector", "TcpConnector"]

HEADER_FILE, PAYLOAD_FILE = "descriptor.json", "kv.safetensors"


class SharedStorageConnector:
    """Entries as atomically renamed directories under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.written = 0
        self.skipped = 0      # a complete entry for the key already existed

    def entry_dir(self, key: str) -> Path:
        return self.root / key

    def send(self, key: str, plan: SendPlan) -> None:
        for frame in plan.frames:   # a held-back (out-of-order) frame names its own key
            self._write(decode_frame(frame).key or key, frame)
        if plan.partial is not None:
            self._write(key, plan.partial, crash=True)

    def _write(self, key: str, frame: bytes, crash: bool = False) -> None:
        n = int.from_bytes(frame[8:12], "big") if len(frame) >= 12 else 0
        header, payload = frame[12:12 + n], frame[12 + n:]
        tmp = self.root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        _write_file(tmp / HEADER_FILE, header)
        if crash:      # the producer dies here: half a payload in a directory nobody reads
            _write_file(tmp / PAYLOAD_FILE, payload[:len(payload) // 2])
            return
        _write_file(tmp / PAYLOAD_FILE, payload)
        _fsync_dir(tmp)
        try:
            os.rename(tmp, self.entry_dir(key))
        except OSError:          # the key exists: first writer wins, drop ours
            shutil.rmtree(tmp, ignore_errors=True)
            self.skipped += 1
            return
        _fsync_dir(self.root)
        self.written += 1

    def fetch(self, keys: Sequence[str]) -> list[Delivery]:
        out = []
        for key in keys:
            d = self.entry_dir(key)
            try:
                header = (d / HEADER_FILE).read_bytes()
                payload = (d / PAYLOAD_FILE).read_bytes()
            except FileNotFoundError:
                continue
            delivery = parse_entry(header, payload, "storage")
            delivery.meta["key"] = key
            out.append(delivery)
        return out

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)

    def close(self) -> None:
        pass


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TcpConnector:
    """Loopback TCP. ``role="consumer"`` listens (``port`` 0: any free port, see
    :attr:`port`); ``role="producer"`` connects to ``host:port`` once per frame."""

    def __init__(self, role: str, host: str = "127.0.0.1", port: int = 0,
                 connect_timeout_s: float = 10.0) -> None:
        self.role, self.host = role, host
        self.connect_timeout_s = connect_timeout_s
        self.inbox = Inbox("tcp")
        self._closed = threading.Event()
        self._server: socket.socket | None = None
        if role == "consumer":
            srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((host, port))
            srv.listen(64)
            srv.settimeout(0.2)
            self._server = srv
            self.port = srv.getsockname()[1]
            self._thread = threading.Thread(target=self._serve, name="kvlab-kv-recv",
                                            daemon=True)
            self._thread.start()
        else:
            self.port = port

    # -- consumer side -------------------------------------------------------------------
    def _serve(self) -> None:
        srv = self._server
        assert srv is not None
        while not self._closed.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5.0)
                chunks = []
                with contextlib.suppress(OSError):
                    while True:
                        data = conn.recv(1 << 20)
                        if not data:
                            break
                        chunks.append(data)
                if chunks:   # parsed before the close that tells the sender it is in
                    self.inbox.put(b"".join(chunks))

    def fetch(self, keys: Sequence[str]) -> list[Delivery]:
        return self.inbox.fetch(keys)

    def wait(self, timeout: float) -> None:
        self.inbox.wait(timeout)

    # -- producer side -------------------------------------------------------------------
    def send(self, key: str, plan: SendPlan) -> None:
        for frame in plan.frames:
            self._send_one(frame)
        if plan.partial is not None:
            self._send_one(plan.partial)   # then the connection closes: the reader sees it short

    def _send_one(self, frame: bytes) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=5.0) as s:
                    s.sendall(frame)
                    s.shutdown(socket.SHUT_WR)
                    with contextlib.suppress(OSError):
                        s.recv(1)        # wait for the reader to close: the frame is in
                return
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
            self._thread.join(timeout=2.0)
