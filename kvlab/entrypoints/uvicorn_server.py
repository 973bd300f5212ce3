"""Serving an app with uvicorn: an HTTP/1.1 protocol with a deadline for each request's
headers, and :class:`ServerThread`, a server in a background thread (tests, notebooks).

uvicorn closes a connection left idle after a response (``timeout_keep_alive``), but arms no
timer while a request line and headers arrive: a client that connects and sends nothing, or
one header line a minute (slow-loris), holds its socket and file descriptor for as long as it
likes. :func:`h11_with_header_deadline` closes such a connection once its headers are not
complete ``seconds`` after the connection opened or the request's first byte arrived. The body
has its own deadline in the app (:func:`kvlab.entrypoints.serve.build_app`).
"""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEADER_TIMEOUT", "ServerThread", "h11_with_header_deadline"]

#: default deadline (seconds) for a request's line and headers (nginx's client_header_timeout
#: is 60)
HEADER_TIMEOUT = 30.0


def h11_with_header_deadline(seconds: float) -> type[H11Protocol]:
    """An ``H11Protocol`` subclass for ``uvicorn.Config(http=...)`` that closes a connection
    whose request headers take longer than ``seconds`` to arrive."""
    if not seconds > 0:
        raise ValueError(f"header deadline must be > 0 seconds, got {seconds!r}")

    class HeaderDeadlineProtocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                self.arm()            # bytes of a new request: its headers are due
            super().data_received(data)
            if self.cycle is not cycle:
                self.disarm()         # the headers are complete: the app has the request

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

        def arm(self) -> None:
            if self.deadline is None:
                self.deadline = self.loop.call_later(seconds, self.expire)

        def disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expire(self) -> None:
            self.deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


class ServerThread:
    """Run an app with uvicorn in a background thread on ``host`` and a free port (tests,
    notebooks): ``with ServerThread(app) as srv: srv.url``. Headers are due within
    ``header_timeout`` seconds, as in ``kvlab serve``."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0,
                 header_timeout: float = HEADER_TIMEOUT) -> None:
        self.server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="on",
            http=h11_with_header_deadline(header_timeout)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.host = host

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
