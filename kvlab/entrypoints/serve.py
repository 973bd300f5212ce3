"""``python -m kvlab serve``: an OpenAI-compatible HTTP server over the kvlab engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` answers
with server-sent events, ending ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` and ``GET /metrics`` (Prometheus text, vLLM's metric names). Built on Starlette
and uvicorn; the engine steps in one background thread
(:class:`~kvlab.entrypoints.async_engine.AsyncEngine`).

Nothing slow runs on the event loop: a request body is read up to ``max_body_bytes`` (413
beyond), then parsed, tokenized (once) and validated in a worker thread. Text is detokenized
incrementally per sample (:class:`~kvlab.engine.detokenizer.TextStream`): a stream never sends
half a UTF-8 character and never resends text; stop strings end a sample (the match excluded,
``finish_reason="stop"``, ``stop_reason`` the string) and abort its engine request once every
sample of it has ended. A streamed chunk carries one choice.

Errors are OpenAI's error object (:mod:`kvlab.entrypoints.openai_protocol`) and never stop the
server. A client that disconnects has its request aborted and its KV freed; one that reads too
slowly is aborted once it owes ``max_backlog_tokens`` tokens. A request refused at admission
(``--max-waiting`` requests already queued) is answered 503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvlab.engine.detokenizer import TextStream
from kvlab.engine.structured_outputs.grammar import GrammarError

from .async_engine import MAX_BACKLOG_TOKENS, AsyncEngine, RequestStream, StreamDelta
from .openai_protocol import APIError, ParsedRequest, error_body, parse_request

__all__ = ["MAX_BODY_BYTES", "ServerThread", "build_app", "main"]

#: default limit of a request body (a 2,048-token context is ~10 KB of text)
MAX_BODY_BYTES = 2 * 1024 * 1024

Event = tuple[int, str, "str | None"]     # (choice index, new text, finish reason)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or APIError 413 as soon as it is known to exceed ``limit`` bytes."""
    def too_large() -> APIError:
        return APIError(413, f"request body exceeds the server's limit of {limit} bytes",
                        code="request_too_large", kind="invalid_request_error")

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large()
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        parts.append(chunk)
    return b"".join(parts)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the ASGI server sends ``http.disconnect``; the body
    has been read already, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Run:
    """The engine requests of one HTTP request (one per prompt) and their choices' text.

    Choice ``k = prompt * n + sample``. :meth:`next` waits for any request's next delta and
    turns it into events; :meth:`close` aborts what is unfinished (always call it)."""

    def __init__(self, streams: list[RequestStream], parsed: ParsedRequest,
                 decode: Callable[[list[int]], str]) -> None:
        self.streams = streams
        self.n = n = parsed.params.n
        total = len(streams) * n
        self.texts = [TextStream(decode, parsed.stop) for _ in range(total)]
        self.finish: list[str | None] = [None] * total
        self.stop_reason: list[str | int | None] = [None] * total
        self.tokens = [0] * total
        self.prompt_tokens = [0] * len(streams)
        self.stop_ids = frozenset(parsed.params.stop_token_ids)
        self.pending: dict[asyncio.Future, int] = {}
        self.error: str | None = None
        self.seen = [False] * len(streams)

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.finish)

    def _apply(self, s: int, delta: StreamDelta) -> list[Event]:
        self.seen[s] = True
        self.prompt_tokens[s] = delta.num_prompt_tokens
        self.error = self.error or delta.error
        events = []
        for c in delta.choices:
            k = s * self.n + c.index
            if self.finish[k] is not None:
                continue                        # ended by a stop string: the rest is dropped
            ts = self.texts[k]
            self.tokens[k] += len(c.token_ids)
            text = ts.push(c.token_ids)
            reason = "stop" if ts.stopped else None
            if reason is None and c.finish_reason is not None:
                text += ts.finish()
                reason = "stop" if ts.stopped else c.finish_reason
                if not ts.stopped and reason == "stop" and ts.token_ids \
                        and ts.token_ids[-1] in self.stop_ids:
                    self.stop_reason[k] = ts.token_ids[-1]     # vLLM: the stop token's id
            if ts.stopped:
                self.stop_reason[k] = ts.stop_reason
            self.finish[k] = reason
            if text or reason is not None:
                events.append((k, text, reason))
        stream = self.streams[s]
        if not stream.finished and all(self.finish[s * self.n + j] is not None
                                       for j in range(self.n)):
            stream.close({j: "stop" for j in range(self.n)})   # every sample hit a stop string
        return events

    async def next(self, gone: asyncio.Future | None = None) -> list[Event] | None:
        """Events of the next delta(s) to arrive; None if ``gone`` finished first."""
        armed = set(self.pending.values())
        for s, stream in enumerate(self.streams):
            if not stream.finished and s not in armed:
                self.pending[asyncio.ensure_future(stream.next())] = s
        if not self.pending:
            return []
        waits = set(self.pending) | ({gone} if gone is not None else set())
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        events: list[Event] = []
        got = False
        for fut in done:
            if fut is gone:
                continue
            got = True
            events += self._apply(self.pending.pop(fut), fut.result())
        return events if got else None

    async def first(self, gone: asyncio.Future) -> list[Event] | None:
        """Events until every request delivered once (an admission reject shows then)."""
        events: list[Event] = []
        while not all(self.seen) and not self.done:
            got = await self.next(gone)
            if got is None:
                return None
            events += got
        return events

    def close(self) -> None:
        for fut in self.pending:
            fut.cancel()
        self.pending.clear()
        for s, stream in enumerate(self.streams):
            stream.close({j: "stop" for j in range(self.n)
                          if self.finish[s * self.n + j] == "stop"})

    def usage(self) -> dict:
        prompt, gen = sum(self.prompt_tokens), sum(self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}


def _choice(chat: bool, index: int, text: str, finish: str | None, stop_reason, stream: bool,
            first: bool = False) -> dict:
    if chat:
        if stream:
            body: dict[str, Any] = {"role": "assistant", "content": text} if first \
                else ({"content": text} if text or finish is None else {})
            out = {"index": index, "delta": body, "finish_reason": finish, "logprobs": None}
        else:
            out = {"index": index, "message": {"role": "assistant", "content": text},
                   "finish_reason": finish, "logprobs": None}
    else:
        out = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    out["stop_reason"] = stop_reason
    return out


def build_app(aeng: AsyncEngine, served_model: str, *,
              max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The Starlette application; its lifespan starts and stops ``aeng``'s engine thread."""
    engine = aeng.engine
    metrics = aeng.metrics
    tokenizer = engine.tokenizer
    decode: Callable[[list[int]], str] = tokenizer.decode if tokenizer is not None \
        else (lambda ids: "")

    def fail(err: APIError) -> JSONResponse:
        metrics.observe_http_error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    def prepare(parsed: ParsedRequest) -> list[tuple[tuple[int, ...], Any]]:
        """Tokenize (once) and validate every prompt: ``[(token ids, params)]`` (worker thread)."""
        param = "messages" if parsed.chat else "prompt"
        if parsed.stop and tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none",
                           param="stop", code="invalid_value")
        out = []
        for prompt in parsed.prompts:
            try:
                _, ids = engine.encode_prompt(prompt)
            except (ValueError, TypeError) as err:
                raise APIError(400, str(err), param=param, code="invalid_value") from None
            if len(ids) >= engine.max_model_len:
                raise APIError(400, f"This model's maximum context length is "
                                    f"{engine.max_model_len} tokens; the prompt has {len(ids)} "
                                    "and leaves no room to generate", param=param,
                               code="context_length_exceeded")
            params = parsed.params_for(len(ids), engine.max_model_len)
            try:
                aeng.validate(list(ids), params)
            except GrammarError as err:
                raise APIError(400, f"{parsed.structured_param}: {err}",
                               param=parsed.structured_param, code="invalid_value") from None
            except (ValueError, TypeError) as err:
                name = "n" if str(err).startswith("n=") else param
                raise APIError(400, str(err), param=name, code="invalid_value") from None
            out.append((ids, params))
        return out

    async def completions(request: Request, chat: bool) -> Response:
        run: _Run | None = None
        gone: asyncio.Future | None = None
        try:
            raw = await _read_body(request, max_body_bytes)
            parsed = await asyncio.to_thread(parse_request, raw, chat=chat,
                                             served_model=served_model)
            work = await asyncio.to_thread(prepare, parsed)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            loop = asyncio.get_running_loop()
            streams: list[RequestStream] = []
            try:
                for i, (ids, params) in enumerate(work):
                    streams.append(await asyncio.to_thread(
                        aeng.add, rid if len(work) == 1 else f"{rid}-{i}", list(ids), params,
                        loop))
            except (ValueError, TypeError) as err:
                for st in streams:
                    st.close()
                raise APIError(400, str(err), code="invalid_value") from None
            run = _Run(streams, parsed, decode)
            gone = asyncio.ensure_future(_client_gone(request))
            first = await run.first(gone)
            if first is None:
                return Response(status_code=499)
            if "rejected" in run.finish:
                raise APIError(503, "the server is overloaded: request refused at admission",
                               code="overloaded")
            if "error" in run.finish:
                raise APIError(500, "the engine failed while running the request",
                               code="engine_error")
            created = int(time.time())
            if parsed.stream:
                gone.cancel()     # StreamingResponse watches for the disconnect itself
                response = StreamingResponse(_sse(run, first, parsed, rid, created),
                                             media_type="text/event-stream")
                run = None        # the stream owns it now
                return response
            while not run.done:
                if await run.next(gone) is None:
                    return Response(status_code=499)
            return JSONResponse({
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": served_model,
                "choices": [_choice(chat, k, run.texts[k].text, run.finish[k],
                                    run.stop_reason[k], False)
                            for k in range(len(run.finish))],
                "usage": run.usage()})
        except APIError as err:
            return fail(err)
        finally:
            if gone is not None:
                gone.cancel()
            if run is not None:
                run.close()

    async def _sse(run: _Run, first: list[Event], parsed: ParsedRequest, rid: str,
                   created: int) -> AsyncIterator[str]:
        chat = parsed.chat
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, usage: dict | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": kind, "created": created,
                                    "model": served_model, "choices": choices}
            if parsed.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def chunk(ev: Event) -> str:
            k, text, reason = ev
            return event([_choice(chat, k, text, reason,
                                  run.stop_reason[k] if reason else None, True)])

        try:
            if chat:
                for k in range(len(run.finish)):
                    yield event([_choice(chat, k, "", None, None, True, first=True)])
            for ev in first:
                yield chunk(ev)
            while not run.done and run.error is None:
                for ev in await run.next():
                    yield chunk(ev)
            if run.error is not None:
                yield "data: " + json.dumps(error_body(
                    f"the client read too slowly: more than {aeng.max_backlog_tokens} tokens "
                    "were waiting to be sent, so the request was aborted", "server_error",
                    None, run.error)) + "\n\n"
            if parsed.include_usage:
                yield event([], run.usage())
            yield "data: [DONE]\n\n"
        finally:
            run.close()     # a disconnect lands here first: aborts the requests

    async def v1_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def v1_chat(request: Request) -> Response:
        return await completions(request, chat=True)

    def model_card() -> dict:
        return {"id": served_model, "object": "model", "created": 0, "owned_by": "kvlab",
                "max_model_len": engine.max_model_len}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["model_id"]
        if name != served_model:
            return fail(APIError(404, f"The model `{name}` does not exist; this server serves "
                                      f"`{served_model}`", param="model", code="model_not_found"))
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        if not aeng.running:
            return JSONResponse(error_body("engine thread is not running", "server_error"),
                                status_code=503)
        return Response(status_code=200)

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        metrics.observe_http_error(status)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: "
                                       f"{getattr(exc, 'detail', exc)}", kind, None, status),
                            status_code=status)

    async def server_error(request: Request, exc: Exception) -> Response:
        metrics.observe_http_error(500)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}"[:500],
                                       "server_error", None, "internal_error"), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not aeng.running:
            aeng.start()
        yield
        aeng.shutdown()

    return Starlette(routes=[
        Route("/v1/completions", v1_completions, methods=["POST"]),
        Route("/v1/chat/completions", v1_chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan)


class ServerThread:
    """Run an app with uvicorn in a background thread on ``host`` and a free port (tests,
    notebooks): ``with ServerThread(app) as srv: srv.url``."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level="warning", lifespan="on"))
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


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="kvlab-tiny", help="shipped model name or HF directory")
    ap.add_argument("--served-model-name", default=None,
                    help="model name clients must send (default: --model)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-prefill-chunk", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--no-enable-prefix-caching", action="store_true")
    ap.add_argument("--scheduler", choices=("baseline", "production"), default="baseline")
    ap.add_argument("--max-waiting", type=int, default=None,
                    help="production scheduler: refuse requests (HTTP 503) when this many wait")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")


def add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_BODY_BYTES,
                    help="larger request bodies are refused with HTTP 413")
    ap.add_argument("--max-stream-backlog", type=int, default=MAX_BACKLOG_TOKENS,
                    help="abort a stream whose client owes this many unread tokens")


def make_engine(args: argparse.Namespace):
    """An LLMEngine from parsed ``add_engine_args`` arguments (ValueError on bad ones)."""
    import dataclasses

    import torch

    from kvlab.core.scheduler import ProductionScheduler
    from kvlab.engine.llm_engine import LLMEngine

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    scheduler: Any = args.scheduler
    if args.max_waiting is not None:
        if args.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
        limit = args.max_waiting

        def scheduler(kv, cfg):
            return ProductionScheduler(kv, dataclasses.replace(cfg, max_waiting=limit))
    return LLMEngine(args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                     max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     max_prefill_chunk=args.max_prefill_chunk, max_model_len=args.max_model_len,
                     enable_prefix_caching=not args.no_enable_prefix_caching, device=args.device,
                     dtype=args.dtype, seed=args.seed, scheduler=scheduler)


def main(argv: list[str] | None = None) -> int:
    import sys

    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m kvlab serve",
                                 description=__doc__.split("\n")[0])
    add_engine_args(ap)
    add_server_args(ap)
    args = ap.parse_args(argv)
    if args.max_request_bytes < 1:
        ap.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.max_stream_backlog < 1:
        ap.error(f"--max-stream-backlog must be >= 1, got {args.max_stream_backlog}")
    try:
        engine = make_engine(args)
    except (FileNotFoundError, ValueError, TypeError) as err:
        print(f"kvlab serve: cannot start the engine: {err}", file=sys.stderr)
        return 1
    name = args.served_model_name or str(args.model)
    aeng = AsyncEngine(engine, model_name=name, max_backlog_tokens=args.max_stream_backlog)
    print(f"kvlab serve: {name} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(build_app(aeng, name, max_body_bytes=args.max_request_bytes), host=args.host,
                port=args.port, log_level=args.log_level)
    return 0
