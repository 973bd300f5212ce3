"""``python -m kvlab serve``: an OpenAI-compatible HTTP server over the kvlab engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` answers
with server-sent events, ending ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's metric names), and vLLM's ``POST
/tokenize``, ``POST /detokenize`` and (opt-in) ``GET /tokenizer_info``
(:mod:`~kvlab.entrypoints.tokenization`). Built on Starlette
and uvicorn; the engine steps in one background thread
(:class:`~kvlab.entrypoints.async_engine.AsyncEngine`).

This module wires HTTP to the parts: a body is read here up to ``max_body_bytes`` (413
beyond), then parsed (:mod:`~kvlab.entrypoints.openai_protocol`), tokenized once and validated
(:func:`~kvlab.entrypoints.request_run.prepare`) in worker threads, so nothing slow runs on the
event loop. :class:`~kvlab.entrypoints.request_run.RequestRun` turns the engine's deltas into
each choice's text (incremental detokenization: never half a UTF-8 character, never resent;
stop strings end a sample, the match excluded, ``finish_reason="stop"``, ``stop_reason`` the
string, and abort its engine request once every sample has ended; ``echo``) and logprobs, which
:mod:`~kvlab.entrypoints.openai_responses` shapes as OpenAI does. A streamed chunk carries one
choice.

Request fields are vLLM 0.32's: a field kvlab does not use is ignored, as vLLM ignores it, and
named in the ``x-kvlab-ignored-fields`` response header; one that would change the answer and
that kvlab cannot honour is a 400 naming it (:mod:`kvlab.entrypoints.openai_protocol`). Chat
prompts are rendered by the checkpoint's Jinja chat template
(:mod:`kvlab.entrypoints.chat_template`). Errors are OpenAI's error object and never stop the
server. A client that disconnects has its request aborted and its KV freed; one that reads too
slowly is aborted once it owes ``max_backlog_tokens`` tokens. A request refused at admission
(``--max-waiting`` requests already queued) is answered 503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.entrypoints.async_engine import MAX_BACKLOG_TOKENS, AsyncEngine, RequestStream
from kvlab.entrypoints.chat_template import ChatTemplate
from kvlab.entrypoints.openai_protocol import (
    APIError,
    ParsedRequest,
    error_body,
    generation_defaults,
    parse_request,
)
from kvlab.entrypoints.openai_responses import TokenNames, choice, logprobs_body
from kvlab.entrypoints.request_run import Event, RequestRun, prepare
from kvlab.entrypoints.tokenization import detokenize, tokenize, tokenizer_info
from kvlab.entrypoints.uvicorn_server import HEADER_TIMEOUT, h11_with_header_deadline

__all__ = ["BODY_TIMEOUT", "IGNORED_HEADER", "MAX_BODY_BYTES", "build_app", "main"]

log = logging.getLogger("kvlab.serve")

#: response header naming the request fields that had no effect (kvlab's; vLLM only logs them)
IGNORED_HEADER = "x-kvlab-ignored-fields"

#: default limit of a request body (a 2,048-token context is ~10 KB of text)
MAX_BODY_BYTES = 2 * 1024 * 1024
#: default deadline (seconds) for a request's body (nginx's client_body_timeout is 60)
BODY_TIMEOUT = 60.0


class ErrorResponse(JSONResponse):
    """An error body, ASCII-escaped: a message may quote what the client sent, and a lone
    surrogate in it (valid in JSON text, not in UTF-8) must not turn a 4xx into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, or APIError 413 as soon as it is known to exceed ``limit`` bytes, or 408 when
    it has not all arrived ``timeout`` seconds after the handler started reading."""
    def too_large() -> APIError:
        return APIError(413, f"request body exceeds the server's limit of {limit} bytes",
                        code="request_too_large", kind="invalid_request_error")

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large()

    async def read() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large()
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", kind="invalid_request_error") from None


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the ASGI server sends ``http.disconnect``; the body
    has been read already, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(aeng: AsyncEngine, served_model: str, *, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout: float = BODY_TIMEOUT,
              tokenizer_info_endpoint: bool = False, dev_routes: bool = False) -> Starlette:
    """The Starlette application; its lifespan starts and stops ``aeng``'s engine thread (and
    closes the engine's KV-event publisher). A body is refused beyond ``max_body_bytes`` (413)
    or ``body_timeout`` seconds (408). ``tokenizer_info_endpoint``: serve ``GET
    /tokenizer_info`` (off by default, as in vLLM). ``dev_routes``: vLLM's development route
    ``POST /reset_prefix_cache`` (``{"success": bool}``; vLLM serves it under
    ``VLLM_SERVER_DEV_MODE=1``, and so does ``kvlab serve``)."""
    engine = aeng.engine
    metrics = aeng.metrics
    started = int(time.time())   # the model card's `created`: when this server started
    tokenizer = engine.tokenizer
    names = TokenNames(tokenizer) if tokenizer is not None else None
    template = chat_template(engine)
    defaults = generation_defaults(engine.checkpoint.path)
    warned: set[str] = set()

    def decoder(parsed: ParsedRequest) -> Callable[[list[int]], str]:
        if tokenizer is None:
            return lambda ids: ""
        return functools.partial(tokenizer.decode,
                                 skip_special_tokens=parsed.skip_special_tokens)

    def note_ignored(parsed: ParsedRequest, response: Response) -> Response:
        """Name the fields that had no effect: a header, and a log line (a warning the first
        time a field is seen, as vLLM warns once)."""
        if parsed.ignored:
            response.headers[IGNORED_HEADER] = ", ".join(parsed.ignored)
            new = sorted(set(parsed.ignored) - warned)
            warned.update(new)
            (log.warning if new else log.debug)(
                "request fields ignored (they have no effect on kvlab): %s",
                ", ".join(parsed.ignored))
        return response

    def shaped(chat: bool, entries: list | None, k: int | None) -> dict | None:
        """``choice.logprobs``: None unless the request asked for logprobs (``k``)."""
        if k is None or names is None:
            return None
        return logprobs_body(chat, entries or [], names, k)

    def fail(err: APIError) -> Response:
        response = ErrorResponse(err.body(), status_code=err.status)
        metrics.observe_http_error(err.status)   # once the response exists: counted once
        return response

    async def completions(request: Request, chat: bool) -> Response:
        run: RequestRun | None = None
        gone: asyncio.Future | None = None
        try:
            raw = await _read_body(request, max_body_bytes, body_timeout)
            parsed = await asyncio.to_thread(parse_request, raw, chat=chat,
                                             served_model=served_model, template=template,
                                             defaults=defaults)
            work = await asyncio.to_thread(prepare, aeng, parsed)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            loop = asyncio.get_running_loop()
            streams: list[RequestStream] = []
            domain = None if parsed.cache_salt is None else f"cache_salt:{parsed.cache_salt}"
            try:
                for i, w in enumerate(work):
                    streams.append(await asyncio.to_thread(
                        aeng.add, rid if len(work) == 1 else f"{rid}-{i}", list(w.token_ids),
                        w.params, loop, domain))
            except (ValueError, TypeError) as err:
                for st in streams:
                    st.close()
                raise APIError(400, str(err), code="invalid_value") from None
            run = RequestRun(streams, parsed, work, decoder(parsed), keep=not parsed.stream,
                             eos_ids=engine.eos_token_ids)
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
                return note_ignored(parsed, response)
            while not run.done:
                if await run.next(gone) is None:
                    return Response(status_code=499)
            return note_ignored(parsed, JSONResponse({
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": served_model,
                "choices": [choice(chat, k, run.text(k), run.finish[k], run.stop_reason[k],
                                   False, logprobs=shaped(chat, run.entries[k], parsed.logprobs))
                            for k in range(len(run.finish))],
                "usage": run.usage()}))
        except APIError as err:
            return fail(err)
        except ClientDisconnect:   # gone while sending the body: nobody reads an answer
            return Response(status_code=499)
        finally:
            if gone is not None:
                gone.cancel()
            if run is not None:
                run.close()

    async def _sse(run: RequestRun, first: list[Event], parsed: ParsedRequest, rid: str,
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
            k, reason = ev.index, ev.finish
            return event([choice(chat, k, ev.text, reason,
                                 run.stop_reason[k] if reason else None, True,
                                 logprobs=shaped(chat, ev.logprobs, parsed.logprobs))])

        try:
            if chat:
                for k in range(len(run.finish)):
                    yield event([choice(chat, k, "", None, None, True, first=True)])
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
        return {"id": served_model, "object": "model", "created": started, "owned_by": "kvlab",
                "max_model_len": engine.max_model_len}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["model_id"]
        if name != served_model:
            return fail(APIError(404, f"The model `{name}` does not exist; this server serves "
                                      f"`{served_model}`", param="model", code="model_not_found"))
        return JSONResponse(model_card())

    async def tokenizer_route(request: Request) -> Response:
        """``/tokenize`` and ``/detokenize``: body read with the size limit, worked off-loop."""
        work = functools.partial(tokenize, template=template) \
            if request.url.path == "/tokenize" else detokenize
        try:
            raw = await _read_body(request, max_body_bytes, body_timeout)
            return JSONResponse(await asyncio.to_thread(work, raw, engine, served_model))
        except APIError as err:
            return fail(err)
        except ClientDisconnect:
            return Response(status_code=499)

    async def tokenizer_info_route(request: Request) -> Response:
        try:
            return JSONResponse(await asyncio.to_thread(tokenizer_info, engine, template))
        except APIError as err:
            return fail(err)

    async def health(request: Request) -> Response:
        if not aeng.running:
            return ErrorResponse(error_body("engine thread is not running", "server_error"),
                                 status_code=503)
        return Response(status_code=200)

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        response = ErrorResponse(error_body(f"{request.method} {request.url.path}: "
                                            f"{getattr(exc, 'detail', exc)}", kind, None, code),
                                 status_code=status)
        metrics.observe_http_error(status)
        return response

    async def server_error(request: Request, exc: Exception) -> Response:
        metrics.observe_http_error(500)
        return ErrorResponse(error_body(f"internal error: {type(exc).__name__}: {exc}"[:500],
                                        "server_error", None, "internal_error"), status_code=500)

    async def reset_prefix_cache(request: Request) -> Response:
        return JSONResponse({"success": await asyncio.to_thread(engine.reset_prefix_cache)})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not aeng.running:
            aeng.start()
        yield
        aeng.shutdown()
        engine.close()

    routes = [Route("/tokenizer_info", tokenizer_info_route, methods=["GET"])] \
        if tokenizer_info_endpoint else []
    if dev_routes:
        routes.append(Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]))
    return Starlette(routes=[
        *routes,
        Route("/tokenize", tokenizer_route, methods=["POST"]),
        Route("/detokenize", tokenizer_route, methods=["POST"]),
        Route("/v1/completions", v1_completions, methods=["POST"]),
        Route("/v1/chat/completions", v1_chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan)


def chat_template(engine: LLMEngine) -> ChatTemplate:
    """The chat template ``engine``'s checkpoint ships (kvlab's when it ships none), with its
    BOS and EOS strings."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return ChatTemplate.for_tokenizer(engine.checkpoint.path / "tokenizer.json", None, None)
    names = {i: s for s, i in tokenizer.get_vocab().items()}
    bos = names.get(engine.config.bos_token_id) if engine.config.bos_token_id is not None \
        else None
    eos = names.get(engine.eos_token_ids[0]) if engine.eos_token_ids else None
    return ChatTemplate.for_tokenizer(tokenizer.path, bos, eos)


def add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--served-model-name", default=None,
                    help="model name clients must send (default: --model)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_BODY_BYTES,
                    help="larger request bodies are refused with HTTP 413")
    ap.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                    help="close a connection whose request headers take longer (seconds)")
    ap.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT,
                    help="answer 408 to a request whose body takes longer (seconds)")
    ap.add_argument("--max-stream-backlog", type=int, default=MAX_BACKLOG_TOKENS,
                    help="abort a stream whose client owes this many unread tokens")
    ap.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                    help="serve GET /tokenizer_info (vLLM's flag; lm-eval's remote tokenizer)")


#: capacity of torch's two oneDNN caches in a server process, unless the environment sets
#: them: each keeps a primitive per input shape, and at torch's default of 1,024 a long run's
#: new row counts keep adding native memory (pytorch/pytorch#27971); the README has the figures
ONEDNN_CACHE_CAPACITY = "64"


def make_engine(args: argparse.Namespace) -> LLMEngine:
    """An LLMEngine from the parsed flags (ValueError on bad ones). Process settings first:
    ``--threads`` and the oneDNN cache capacities (read when the caches are first used)."""
    import torch

    for var in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(var, ONEDNN_CACHE_CAPACITY)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return LLMEngine(EngineArgs.from_cli_args(args))


def main(argv: list[str] | None = None) -> int:
    import sys

    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m kvlab serve",
                                 description=__doc__.split("\n")[0])
    EngineArgs.add_cli_args(ap)
    add_server_args(ap)
    args = ap.parse_args(argv)
    if args.max_request_bytes < 1:
        ap.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    for flag in ("header_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            ap.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
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
    app = build_app(aeng, name, max_body_bytes=args.max_request_bytes,
                    body_timeout=args.body_timeout,
                    tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                    dev_routes=os.environ.get("VLLM_SERVER_DEV_MODE") == "1")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                http=h11_with_header_deadline(args.header_timeout))
    return 0
