"""``python -m kvlab serve``: an OpenAI-compatible HTTP server over the kvlab engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` answers
with server-sent events, ending ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text, vLLM's metric names). Built on Starlette and uvicorn; the
engine steps in one background thread (:class:`~kvlab.entrypoints.async_engine.AsyncEngine`).

Errors are OpenAI's error object (:mod:`kvlab.entrypoints.openai_protocol`) and never stop the
server. A client that disconnects has its request aborted and its KV freed. A request refused
at admission (``--max-waiting`` requests already queued) is answered 503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .async_engine import AsyncEngine
from .openai_protocol import APIError, ParsedRequest, error_body, parse_request

__all__ = ["ServerThread", "build_app", "main"]


def _usage(out) -> dict:
    gen = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}


def _choice(chat: bool, index: int, text: str, finish: str | None, stream: bool) -> dict:
    if chat:
        key = "delta" if stream else "message"
        body = {"content": text} if stream else {"role": "assistant", "content": text}
        return {"index": index, key: body, "finish_reason": finish, "logprobs": None}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the ASGI server sends ``http.disconnect``; the body
    has been read already, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_or_gone(gen: AsyncIterator, gone: asyncio.Task):
    """The generator's next output, or None if the client disconnected first (the generator
    is then closed, which aborts the request)."""
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    with contextlib.suppress(BaseException):
        await gen.aclose()
    return None


def build_app(aeng: AsyncEngine, served_model: str) -> Starlette:
    """The Starlette application; its lifespan starts and stops ``aeng``'s engine thread."""
    engine = aeng.engine
    metrics = aeng.metrics

    def fail(err: APIError) -> JSONResponse:
        metrics.observe_http_error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    async def completions(request: Request, chat: bool) -> Response:
        try:
            parsed = parse_request(await request.body(), chat=chat, served_model=served_model)
            param = "messages" if chat else "prompt"
            try:
                _, ids = engine.encode_prompt(parsed.prompt)
            except (ValueError, TypeError) as err:
                raise APIError(400, str(err), param=param, code="invalid_value") from None
            if len(ids) >= engine.max_model_len:
                raise APIError(400, f"This model's maximum context length is "
                                    f"{engine.max_model_len} tokens; the prompt has {len(ids)} "
                                    "and leaves no room to generate", param=param,
                               code="context_length_exceeded")
            try:
                aeng.validate(parsed.prompt, parsed.params)
            except (ValueError, TypeError) as err:
                raise APIError(400, str(err), param=param, code="invalid_value") from None
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            gen = aeng.generate(rid, parsed.prompt, parsed.params)
            gone = asyncio.ensure_future(_client_gone(request))
            try:
                return await answer(parsed, gen, gone, rid)
            finally:
                gone.cancel()
        except APIError as err:
            return fail(err)

    async def answer(parsed: ParsedRequest, gen: AsyncIterator, gone: asyncio.Task,
                     rid: str) -> Response:
        chat = parsed.chat
        first = await _next_or_gone(gen, gone)
        if first is None:
            return Response(status_code=499)
        reason = first.outputs[0].finish_reason if first.finished else None
        if reason == "rejected":
            raise APIError(503, "the server is overloaded: request refused at admission",
                           code="overloaded")
        if reason == "error":
            raise APIError(500, "the engine failed while running the request",
                           code="engine_error")
        created = int(time.time())
        if parsed.stream:
            return StreamingResponse(_sse(first, gen, rid, parsed, created),
                                     media_type="text/event-stream")
        out = first
        while not out.finished:
            out = await _next_or_gone(gen, gone)
            if out is None:
                return Response(status_code=499)
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": served_model,
            "choices": [_choice(chat, c.index, c.text, c.finish_reason, False)
                        for c in out.outputs],
            "usage": _usage(out)})

    async def _sse(first, gen: AsyncIterator, rid: str, parsed: ParsedRequest,
                   created: int) -> AsyncIterator[str]:
        chat = parsed.chat
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, usage: dict | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": kind, "created": created,
                                    "model": served_model, "choices": choices}
            if parsed.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        sent: dict[int, str] = {}
        ended: set[int] = set()
        out = first
        try:
            if chat:
                yield event([{"index": c.index, "delta": {"role": "assistant"},
                              "finish_reason": None, "logprobs": None} for c in out.outputs])
            while True:
                choices = []
                for c in out.outputs:
                    if c.index in ended:
                        continue
                    text, before = c.text, sent.get(c.index, "")
                    delta = text[len(before):] if text.startswith(before) else text
                    sent[c.index] = text
                    reason = c.finish_reason
                    if reason is not None:
                        ended.add(c.index)
                    if delta or reason is not None:
                        choices.append(_choice(chat, c.index, delta, reason, True))
                if choices:
                    yield event(choices)
                if out.finished:
                    break
                out = await gen.__anext__()
            if parsed.include_usage:
                yield event([], _usage(out))
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()     # a disconnect lands here first: aborts the request

    async def v1_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def v1_chat(request: Request) -> Response:
        return await completions(request, chat=True)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": served_model, "object": "model", "created": 0, "owned_by": "kvlab",
            "max_model_len": engine.max_model_len}]})

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
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error}, lifespan=lifespan)


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
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    try:
        engine = make_engine(args)
    except (FileNotFoundError, ValueError, TypeError) as err:
        print(f"kvlab serve: cannot start the engine: {err}", file=sys.stderr)
        return 1
    name = args.served_model_name or str(args.model)
    aeng = AsyncEngine(engine, model_name=name)
    print(f"kvlab serve: {name} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(build_app(aeng, name), host=args.host, port=args.port,
                log_level=args.log_level)
    return 0
