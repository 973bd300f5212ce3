"""The OpenAI-compatible request format: parsing, validation and the error object.

Every request body is checked here before anything reaches the engine. A problem raises
:class:`APIError`, which the server turns into OpenAI's error object::

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

with the HTTP status the OpenAI API (and vLLM) use: 400 for a malformed or invalid request,
404 for an unknown model or route, 503 when the engine refused the request at admission
(overload), 500 when it failed while running it.

Accepted fields are OpenAI's plus vLLM's extensions that kvlab implements (``top_k``,
``ignore_eos``, ``stop_token_ids``, ``seed``, ``structured_outputs`` and the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``). Log-probabilities
follow OpenAI's two APIs: completions take ``logprobs: int`` (0..20 alternatives per token),
chat takes ``logprobs: bool`` and ``top_logprobs: int`` (0..20; more than 0 only with
``logprobs: true``, as in vLLM). ``echo`` (completions) prepends the prompt; with ``logprobs`` the
prompt's tokens are scored too (``SamplingParams.prompt_logprobs``, the first one ``null``), and
``max_tokens: 0`` then answers the prompt alone (vLLM runs one token and drops it). A field
OpenAI or vLLM define but kvlab does not implement (:data:`NEUTRAL`: tools, logit_bias, ...) is
accepted only with its "off" value; otherwise, and for a field nobody defines, the answer is a
400 naming it, so a client never believes a setting took effect when it did not.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from kvlab.core.sampling_params import SamplingParams, check_stop

__all__ = ["APIError", "ParsedRequest", "chat_prompt", "error_body", "json_object",
           "parse_request"]


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
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream",
          "stream_options", "ignore_eos", "stop_token_ids", "stop", "user", "logprobs",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "response_format", "structured_outputs",
          "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
#: fields OpenAI or vLLM define that kvlab does not implement: accepted only with the value
#: that means "off", else a 400 naming the field
NEUTRAL: dict[str, tuple] = {
    "logit_bias": (None, {}), "best_of": (None, 1),
    "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "suffix": (None, ""), "include_stop_str_in_output": (None, False),
    # what vllm-router adds to the bodies it forwards, at the values it sends
    "no_stop_trim": (None, False), "skip_special_tokens": (None, True),
    "return_hidden_states": (None, False),
}
#: chat only: vLLM's chat ``echo`` (repeat the last message) is not implemented
CHAT_NEUTRAL: dict[str, tuple] = {**NEUTRAL, "echo": (None, False)}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"} | set(NEUTRAL)
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs"} | set(CHAT_NEUTRAL)
#: most alternatives per token that ``logprobs`` / ``top_logprobs`` may ask for (OpenAI's chat
#: limit and vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant")
STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
              "guided_choice", "guided_grammar")
#: completions' default ``max_tokens`` when the field is absent (OpenAI's); ``null`` and chat's
#: default mean the rest of the context (vLLM's)
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass
class ParsedRequest:
    """A validated request: what to send the engine and how to answer.

    ``prompts``: one entry per prompt (``/v1/completions`` takes an array); ``params`` carries
    every sampling field; its ``max_tokens`` is replaced by :meth:`params_for` once the prompt
    length is known when ``max_tokens`` is None (the rest of the context). ``structured_param``
    names the field that set ``params.structured_outputs`` (for a 400 if it does not compile).
    ``logprobs``: alternatives to report per token (completions' ``logprobs``, chat's
    ``top_logprobs``, 0 for chat's bare ``logprobs: true``), None when not asked; it is also
    ``params.logprobs``. ``echo``: prepend the prompt's text to each choice (completions), and
    with ``logprobs`` its tokens' entries; ``echo_only``: ``echo`` with ``max_tokens: 0`` (the
    engine samples one token, which the answer drops).
    """

    chat: bool
    model: str
    prompts: list[str | list[int]]
    params: SamplingParams
    max_tokens: int | None
    stream: bool
    include_usage: bool
    stop: tuple[str, ...] = ()
    structured_param: str | None = None
    logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False

    @property
    def prompt(self) -> str | list[int]:
        return self.prompts[0]

    def params_for(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """The sampling parameters for a prompt of ``prompt_len`` tokens; APIError 400 naming
        the limit when ``max_tokens`` does not fit the context (vLLM refuses it too)."""
        room = max_model_len - prompt_len
        param = "max_completion_tokens" if self.chat else "max_tokens"
        if self.max_tokens is None:
            if self.params.min_tokens > room:
                raise APIError(400, f"min_tokens={self.params.min_tokens} is too large: the "
                                    f"prompt of {prompt_len} tokens leaves {room} of this "
                                    f"model's {max_model_len}", param="min_tokens",
                               code="context_length_exceeded")
            return dataclasses.replace(self.params, max_tokens=room)
        if self.max_tokens > room:
            raise APIError(400, f"{param}={self.max_tokens} is too large: this model's maximum "
                                f"context length is {max_model_len} tokens and the prompt has "
                                f"{prompt_len}, so at most {room} tokens can be generated",
                           param=param, code="context_length_exceeded")
        return self.params


def json_object(raw: bytes) -> dict:
    """A request body parsed as a JSON object, or APIError 400 naming what is wrong."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply to parse",
                       code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    return body


def _check_neutral(body: dict, name: str, table: dict[str, tuple]) -> None:
    value = body.get(name)
    if name in body and not any(value == v and type(value) is type(v) for v in table[name]):
        raise APIError(400, f"{name}={body[name]!r} is not supported by kvlab's server",
                       param=name, code="unsupported_parameter")


def _content(i: int, m: dict) -> str:
    """The text of message ``i``: a str, a list of ``{"type": "text", "text": ...}`` parts
    (joined with newlines, as vLLM does), or null for an assistant turn."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m["role"] == "assistant":
        return ""
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"messages[{i}].content[{j}]: only text parts "
                                    f"{{\"type\": \"text\", \"text\": str}} are supported, got "
                                    f"{kind!r}", param="messages", code="invalid_value")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(400, f"messages[{i}].content must be a string or a non-empty list of text "
                        "parts" + (" (null only for assistant turns)" if content is None else ""),
                   param="messages", code="invalid_value")


def chat_prompt(messages: Any) -> str:
    """kvlab's chat template: one ``role: content`` line per message, then ``assistant:``.
    (kvlab's models are not chat-tuned; the template only has to be deterministic.)"""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects",
                       param="messages", code="invalid_value")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role",
                           param="messages", code="invalid_value")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise APIError(400, f"messages[{i}].{extra[0]} is not supported by kvlab's server",
                           param="messages", code="unsupported_parameter")
        if not isinstance(m.get("name", ""), str):
            raise APIError(400, f"messages[{i}].name must be a string, got {m['name']!r}"[:300],
                           param="messages", code="invalid_type")
        if m["role"] not in ROLES:
            raise APIError(400, f"messages[{i}].role {m['role']!r} is not one of "
                                f"{', '.join(ROLES)}", param="messages", code="invalid_value")
        lines.append(f"{m['role']}: {_content(i, m)}")
    return "\n".join(lines) + "\nassistant:"


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """``prompt`` of ``/v1/completions``: a str, token ids, or a non-empty array of either."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p)
                                                   for p in prompt):
        return list(prompt)
    raise APIError(400, "prompt must be a string, a non-empty list of token ids, or a "
                        "non-empty array of those", param="prompt", code="invalid_value")


def _count(body: dict, name: str) -> int | None:
    """``body[name]``: None, or an int in 0..MAX_LOGPROBS (a bool is not a count)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be an integer in 0..{MAX_LOGPROBS} (alternatives "
                            f"reported per token), got {value!r}", param=name,
                       code="invalid_value")
    return value


def _logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
    """``(alternatives per token or None, echo)`` from completions' ``logprobs`` / ``echo`` or
    chat's ``logprobs`` / ``top_logprobs``."""
    if not chat:
        count, echo = _count(body, "logprobs"), body.get("echo", False)
        if not isinstance(echo, bool):
            raise APIError(400, f"echo must be a boolean, got {echo!r}", param="echo",
                           code="invalid_type")
        return count, echo
    flag = body.get("logprobs")
    if flag is not None and not isinstance(flag, bool):
        raise APIError(400, f"logprobs must be a boolean on /v1/chat/completions "
                            f"(top_logprobs sets how many alternatives), got {flag!r}",
                       param="logprobs", code="invalid_type")
    top = _count(body, "top_logprobs")
    if top and not flag:
        raise APIError(400, f"top_logprobs={top} needs logprobs=true", param="top_logprobs",
                       code="invalid_value")
    return ((top or 0) if flag else None), False


def _structured(body: dict) -> tuple[dict | None, str | None]:
    """vLLM's ``structured_outputs`` dict (and the field that set it) from ``response_format``,
    ``structured_outputs`` or the older ``guided_*`` fields (at most one of them)."""
    given = [k for k in STRUCTURED if body.get(k) is not None]
    if not given:
        return None, None
    if len(given) > 1:
        raise APIError(400, f"at most one of {', '.join(given)} may be set", param=given[1],
                       code="invalid_value")
    name = given[0]
    value = body[name]
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text" and set(value) == {"type"}:
            return None, None
        if kind == "json_object" and set(value) == {"type"}:
            return {"json": {"type": "object"}}, name
        if kind == "json_schema" and set(value) == {"type", "json_schema"}:
            spec = value["json_schema"]
            if isinstance(spec, dict) and isinstance(spec.get("schema"), dict) \
                    and not set(spec) - {"name", "schema", "strict", "description"}:
                return {"json": spec["schema"]}, name
            raise APIError(400, "response_format.json_schema must be {name, schema: object, "
                                "strict?, description?}", param=name, code="invalid_value")
        raise APIError(400, f"response_format must be {{\"type\": \"text\"}}, {{\"type\": "
                            f"\"json_object\"}} or {{\"type\": \"json_schema\", \"json_schema\": "
                            f"...}}; got {value!r}"[:300], param=name, code="invalid_value")
    if name == "structured_outputs":
        if isinstance(value, dict) and value.get("json_object") is True and len(value) == 1:
            return {"json": {"type": "object"}}, name
        return value, name
    return {name.removeprefix("guided_"): value}, name


def parse_request(raw: bytes, *, chat: bool, served_model: str) -> ParsedRequest:
    """Parse and validate one request body; :class:`APIError` naming the problem."""
    body = json_object(raw)
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
    if "user" in body and not isinstance(body["user"], (str, type(None))):
        raise APIError(400, f"user must be a string, got {body['user']!r}"[:300], param="user",
                       code="invalid_type")
    neutral = CHAT_NEUTRAL if chat else NEUTRAL
    for name in neutral:
        _check_neutral(body, name, neutral)
    logprobs, echo = _logprobs(body, chat)
    prompts = [chat_prompt(body.get("messages"))] if chat else _prompts(body.get("prompt"))
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
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise APIError(400, f"stream_options.include_usage must be a boolean, got "
                                f"{include_usage!r}", param="stream_options", code="invalid_type")
    try:
        stop = check_stop(body.get("stop"))
    except ValueError as err:
        raise APIError(400, str(err), param="stop", code="invalid_value") from None
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens, limit_param = body["max_completion_tokens"], "max_completion_tokens"
    elif chat or "max_tokens" in body:
        max_tokens, limit_param = body.get("max_tokens"), "max_tokens"
    else:
        max_tokens, limit_param = COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens"
    # max_tokens=None (the rest of the context) is resolved per prompt; until then at least
    # min_tokens, so that the check min_tokens <= max_tokens waits for the real value
    least = body.get("min_tokens")
    echo_only = echo and max_tokens == 0 and type(max_tokens) is int
    if echo_only:
        max_tokens = 1       # vLLM's echo without generation: one token, dropped from the answer
    kw: dict[str, Any] = {"max_tokens": max_tokens if max_tokens is not None else
                          least if type(least) is int and least > 1 else 1}
    for name in ("temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if body.get(name) is not None:
            kw[name] = body[name]
    structured, structured_param = _structured(body)
    if structured is not None:
        kw["structured_outputs"] = structured
    if logprobs is not None:
        kw["logprobs"] = logprobs
        if echo:
            kw["prompt_logprobs"] = logprobs
    try:
        params = SamplingParams(**kw)
    except (ValueError, TypeError) as err:
        m = re.search(r"SamplingParams\.(\w+)", str(err))
        field_name = m.group(1) if m else None
        if field_name == "max_tokens":
            field_name = limit_param
        elif field_name == "structured_outputs":
            field_name = structured_param
        raise APIError(400, str(err), param=field_name, code="invalid_value") from None
    return ParsedRequest(chat, model, prompts, params, max_tokens, stream, include_usage,
                         stop, structured_param, logprobs, echo, echo_only)
