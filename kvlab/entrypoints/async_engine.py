"""AsyncEngine: an asyncio front end over the one engine loop (like vLLM's AsyncLLM).

One background thread steps the :class:`~kvlab.engine.llm_engine.LLMEngine` whenever it has
work and sleeps on an event otherwise. Request handlers run on the asyncio event loop: they add
requests with :meth:`AsyncEngine.add` (which registers a :class:`RequestStream`, then calls the
thread-safe :meth:`LLMEngine.add_request`) and read the request's :class:`StreamDelta` objects
from the stream's ``asyncio.Queue``, which the engine thread fills through
``loop.call_soon_threadsafe``. Nothing else crosses threads.

**Deltas, not snapshots.** Requests run with ``SamplingParams.output_kind=DELTA`` (vLLM's
``RequestOutputKind.DELTA``, which its OpenAI server uses for streams too): each step's output
carries only the tokens (and logprobs) that are new, so neither the engine nor a stream's queue
copies what was already sent, and a slow reader costs memory linear in what it owes.
**Bounded.** A stream whose reader falls more than ``max_backlog_tokens`` tokens behind is
aborted (its KV freed) and ended with ``error="client_too_slow"``.

Closing a stream before the request finished (the client went away, a stop string matched)
aborts the request, which frees its KV at the next step boundary.

:class:`~kvlab.entrypoints.server_metrics.ServerMetrics` is updated by the engine thread after
every step and read by ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from kvlab.core.sampling_params import RequestOutputKind, SamplingParams
from kvlab.engine.llm_engine import LLMEngine, Prompt
from kvlab.engine.outputs import RequestOutput
from kvlab.entrypoints.server_metrics import ServerMetrics

__all__ = ["AsyncEngine", "ChoiceDelta", "RequestStream", "StreamDelta"]

log = logging.getLogger("kvlab.serve")

#: default bound of one stream's unread tokens before the server gives up on its reader
MAX_BACKLOG_TOKENS = 4096


@dataclass
class ChoiceDelta:
    """What one sample gained in one step: new token ids, their logprobs (one engine dict
    ``token id -> log-probability`` per new token, when the request asked for logprobs) and,
    at its end, the finish reason."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class StreamDelta:
    """One step's news for a request. ``finished``: the last delta of the stream; ``error``:
    why the server ended it early (``"client_too_slow"``), else None. ``prompt_logprobs``: the
    request's prompt entries (``SamplingParams.prompt_logprobs``), in the first delta that has
    them, else None."""

    choices: list[ChoiceDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


@dataclass
class RequestStream:
    """The consumer side of one request: ``await stream.next()`` until a delta is
    ``finished``; :meth:`close` (always, e.g. in ``finally``) aborts it if it is not."""

    request_id: str
    engine: AsyncEngine
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    backlog: int = 0            # tokens queued and not yet read (engine thread adds, loop takes)
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    prompt_sent: bool = False   # the prompt logprobs went out (engine thread)

    async def next(self) -> StreamDelta:
        delta = await self.queue.get()
        with self.lock:
            self.backlog -= delta.num_tokens
        if delta.finished:
            self.finished = True
        return delta

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        while not self.finished:
            yield await self.next()

    def close(self, reasons: Mapping[int, str] | None = None) -> bool:
        """Abort the request unless it finished; ``reasons`` relabels samples for the metrics
        (a stop string that matched is a ``"stop"``, not an ``"abort"``). True if aborted."""
        if self.finished:
            return False
        self.finished = True
        return self.engine.abort(self.request_id, reasons)


class AsyncEngine:
    """See the module docstring. ``start()`` launches the engine thread, ``shutdown()`` stops
    it (aborting what is left)."""

    def __init__(self, engine: LLMEngine, *, model_name: str = "kvlab-tiny",
                 max_backlog_tokens: int = MAX_BACKLOG_TOKENS) -> None:
        if not isinstance(max_backlog_tokens, int) or max_backlog_tokens < 1:
            raise ValueError(f"max_backlog_tokens must be an int >= 1, got {max_backlog_tokens!r}")
        self.engine = engine
        self.metrics = ServerMetrics(engine, model_name)
        self.max_backlog_tokens = max_backlog_tokens
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.step_errors = 0
        self.slow_aborts = 0            # streams aborted for their slow reader ...
        self.last_slow_backlog = 0      # ... and the last one's unread tokens at that moment

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
        """Queue a step's output, a delta (``RequestOutputKind.DELTA``), on its stream (engine
        thread)."""
        stream = self._streams.get(out.request_id)
        if stream is None:          # aborted: :meth:`abort` observed its final output
            if not out.finished:    # a delta made by the step just before the abort
                self.metrics.observe_output(out)
            return
        self.metrics.observe_output(out)
        choices = [ChoiceDelta(c.index, c.token_ids, c.finish_reason, c.logprobs)
                   for c in out.outputs if c.token_ids or c.finish_reason is not None]
        delta = StreamDelta(choices, out.finished, len(out.prompt_token_ids),
                            out.num_cached_tokens)
        if out.prompt_logprobs is not None and not stream.prompt_sent:
            delta.prompt_logprobs, stream.prompt_sent = out.prompt_logprobs, True
        with stream.lock:
            stream.backlog += delta.num_tokens
            too_slow = not out.finished and stream.backlog > self.max_backlog_tokens
        if too_slow:
            self.slow_aborts += 1
            self.last_slow_backlog = stream.backlog
            self.abort(out.request_id)
            delta.finished, delta.error = True, "client_too_slow"
            for c in delta.choices:
                c.finish_reason = c.finish_reason or "abort"
        elif out.finished:
            self._streams.pop(out.request_id, None)
        with contextlib.suppress(RuntimeError):  # the loop is closed (server shutting down)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    # ------------------------------------------------------------------ the asyncio side
    def validate(self, prompt: Prompt, params: SamplingParams):
        """The engine's own checks (ValueError/TypeError naming the problem), nothing queued.
        Returns ``(text or None, token ids, params)``; tokenizes a str prompt (call it off the
        event loop, then pass the ids on)."""
        return self.engine.validate_request(prompt, params)

    def add(self, request_id: str, prompt: Prompt, params: SamplingParams,
            loop: asyncio.AbstractEventLoop,
            security_domain: str | None = None) -> RequestStream:
        """Register a stream and add the request (thread-safe: call it in a worker thread so
        the event loop never waits on the engine). ``security_domain``: the prefix-cache
        domain (None: the engine's). Raises what :meth:`LLMEngine.add_request` raises, with
        nothing queued."""
        if params.output_kind is not RequestOutputKind.DELTA:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        stream = RequestStream(request_id, self, loop)
        self._streams[request_id] = stream
        try:
            self.engine.add_request(request_id, prompt, params, security_domain=security_domain)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self.metrics.observe_arrival(request_id)
        self._wake.set()
        return stream

    async def generate(self, request_id: str, prompt: Prompt,
                       params: SamplingParams) -> AsyncIterator[StreamDelta]:
        """Add the request and yield its deltas until it finishes; leaving early aborts it."""
        loop = asyncio.get_running_loop()
        stream = await asyncio.to_thread(self.add, request_id, prompt, params, loop)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def queued_tokens(self) -> int:
        """Tokens queued for all streams and not yet read by their handlers."""
        return sum(s.backlog for s in list(self._streams.values()))

    def abort(self, request_id: str, reasons: Mapping[int, str] | None = None) -> bool:
        """Abort a request if it is still in the engine; True when it was. ``reasons`` (sample
        index -> finish reason) relabels aborted samples in the metrics."""
        self._streams.pop(request_id, None)
        try:
            out = self.engine.abort_request(request_id)
        except KeyError:
            return False
        if reasons:
            out = dataclasses.replace(out, outputs=[
                dataclasses.replace(c, finish_reason=reasons.get(c.index, c.finish_reason))
                if c.finish_reason == "abort" else c for c in out.outputs])
        self.metrics.observe_output(out)
        self._wake.set()
        return True
