"""The OpenAI-compatible request format: parsing, validation and the error object.

Every request body is checked here before anything reaches the engine. A problem raises
:class:`APIError`, which the server turns into OpenAI's error object::

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

with the HTTP status the OpenAI API (and vLLM) use: 400 for a malformed or invalid request,
404 for an unknown model or route, 503 when the engine refused the request at admission
(overload), 500 when it failed while running it.

Accepted fields are OpenAI's plus vLLM's extensions that kvlab implements (``top_k``,
``ignore_eos``, ``stop_token_ids``, ``seed``); an unknown field is an error, not silently
ignored, so a client never believes a setting took effect when it did not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvlab.engine.params import SamplingParams

__all__ = ["APIError", "ParsedRequest", "chat_prompt", "error_body", "parse_request"]


class APIError(Exception):
    """An error answered with OpenAI's error object and ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or {400: "invalid_request_error", 404: "not_found_error",
                             405: "invalid_request_error", 503: "server_overloaded",
                             }.get(status, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream",
          "stream_options", "ignore_eos", "stop_token_ids", "stop", "user", "logprobs",
          "presence_penalty", "frequency_penalty"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}


@dataclass
class ParsedRequest:
    """A validated request: what to send the engine and how to answer."""

    chat: bool
    model: str
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    return body


def _check_null_or_zero(body: dict, name: str, neutral: tuple = (None,)) -> None:
    if name in body and body[name] not in neutral:
        raise APIError(400, f"{name}={body[name]!r} is not supported by kvlab's server",
                       param=name, code="unsupported_parameter")


def chat_prompt(messages: Any) -> str:
    """kvlab's chat template: one ``role: content`` line per message, then ``assistant:``.
    (kvlab's models are not chat-tuned; the template only has to be deterministic.)"""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects",
                       param="messages", code="invalid_value")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} \
                or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise APIError(400, f"messages[{i}] must be an object with string role and content",
                           param="messages", code="invalid_value")
        if m["role"] not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role {m['role']!r} is not system, user or "
                                "assistant", param="messages", code="invalid_value")
        lines.append(f"{m['role']}: {m['content']}")
    return "\n".join(lines) + "\nassistant:"


def parse_request(raw: bytes, *, chat: bool, served_model: str) -> ParsedRequest:
    """Parse and validate one request body; :class:`APIError` naming the problem."""
    body = _json_object(raw)
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}",
                       param=unknown[0], code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "model is required (a string)", param="model",
                       code="missing_required_parameter")
    if model != served_model:
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{served_model}`", param="model", code="model_not_found")
    for name in ("stop", "logprobs", "echo"):
        _check_null_or_zero(body, name, (None, False))
    for name in ("presence_penalty", "frequency_penalty"):
        _check_null_or_zero(body, name, (None, 0, 0.0))
    if chat:
        prompt: str | list[int] = chat_prompt(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise APIError(400, "prompt must be a string or a non-empty list of token ids "
                                "(one prompt per request)", param="prompt",
                           code="invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean, got {stream!r}", param="stream",
                       code="invalid_type")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not stream:
            raise APIError(400, "stream_options must be {\"include_usage\": bool} and only "
                                "with stream=true", param="stream_options", code="invalid_value")
        include_usage = bool(opts.get("include_usage", False))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    kw = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "stop_token_ids"):
        if body.get(name) is not None:
            kw[name] = body[name]
    try:
        params = SamplingParams(**kw)
    except (ValueError, TypeError) as err:
        m = re.search(r"SamplingParams\.(\w+)", str(err))
        raise APIError(400, str(err), param=m.group(1) if m else None,
                       code="invalid_value") from None
    return ParsedRequest(chat, model, prompt, params, stream, include_usage)
