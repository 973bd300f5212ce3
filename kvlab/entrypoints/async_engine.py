"""AsyncEngine: an asyncio front end over the one engine loop (like vLLM's AsyncLLM).

One background thread steps the :class:`~kvlab.engine.llm_engine.LLMEngine` whenever it has
work and sleeps on an event otherwise. Request handlers run on the asyncio event loop: they add
requests with :meth:`LLMEngine.add_request` (thread-safe) and read the request's outputs from an
``asyncio.Queue`` that the engine thread fills through ``loop.call_soon_threadsafe``. Nothing
else crosses threads. Leaving :meth:`AsyncEngine.generate` before the request finished (the
client went away, the handler was cancelled) aborts it, which frees its KV at the next step
boundary.

:class:`~kvlab.entrypoints.server_metrics.ServerMetrics` is updated by the engine thread after
every step and read by ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator

from kvlab.engine.llm_engine import LLMEngine, Prompt
from kvlab.engine.outputs import RequestOutput
from kvlab.engine.params import SamplingParams

from .server_metrics import ServerMetrics

__all__ = ["AsyncEngine"]

log = logging.getLogger("kvlab.serve")


class AsyncEngine:
    """See the module docstring. ``start()`` launches the engine thread, ``shutdown()`` stops
    it (aborting what is left)."""

    def __init__(self, engine: LLMEngine, *, model_name: str = "kvlab-tiny") -> None:
        self.engine = engine
        self.metrics = ServerMetrics(engine, model_name)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.step_errors = 0

    # ------------------------------------------------------------------ the engine thread
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for rid in list(self._streams):
            self.abort(rid)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if not engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception:       # the core failed the step's requests; they are reported
                self.step_errors += 1   # by the next step, and the engine keeps serving
                log.exception("engine step failed")
                continue
            self.metrics.observe_step(engine.last_trace)
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        self.metrics.observe_output(out)
        entry = self._streams.get(out.request_id)
        if entry is None:
            return          # aborted meanwhile
        if out.finished:
            self._streams.pop(out.request_id, None)
        loop, queue = entry
        with contextlib.suppress(RuntimeError):  # the loop is closed (server shutting down)
            loop.call_soon_threadsafe(queue.put_nowait, out)

    # ------------------------------------------------------------------ the asyncio side
    def validate(self, prompt: Prompt, params: SamplingParams):
        """The engine's own checks (ValueError/TypeError naming the problem), nothing queued."""
        return self.engine.validate_request(prompt, params)

    async def generate(self, request_id: str, prompt: Prompt,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Add the request and yield its (cumulative) outputs until it finishes. Raises what
        :meth:`LLMEngine.add_request` raises, with nothing queued. Abandoning the iterator
        early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        try:
            self.engine.add_request(request_id, prompt, params)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self.metrics.observe_arrival(request_id)
        self._wake.set()
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request if it is still in the engine; True when it was."""
        self._streams.pop(request_id, None)
        try:
            out = self.engine.abort_request(request_id)
        except KeyError:
            return False
        self.metrics.observe_output(out)
        self._wake.set()
        return True
