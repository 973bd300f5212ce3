"""The OpenAI-compatible request format: parsing, validation and the error object.

Every request body is checked here before anything reaches the engine. A problem raises
:class:`APIError`, which the server turns into OpenAI's error object::

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

with the HTTP status the OpenAI API (and vLLM) use: 400 for a malformed or invalid request,
404 for an unknown model or route, 503 when the engine refused the request at admission
(overload), 500 when it failed while running it.

Fields are those of vLLM 0.32's request models (``CompletionRequest`` in
``vllm/entrypoints/openai/completion/protocol.py``, ``ChatCompletionRequest`` in
``vllm/entrypoints/openai/chat_completion/protocol.py``), in three kinds:

- **honoured** (:data:`COMPLETION_FIELDS`, :data:`CHAT_FIELDS`): OpenAI's sampling and output
  fields and vLLM's extensions kvlab implements: ``top_k``, ``min_p``, penalties,
  ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``seed``, ``skip_special_tokens``,
  ``spaces_between_special_tokens``, ``include_stop_str_in_output`` (and SGLang's
  ``no_stop_trim``, which vllm-router sends), ``add_special_tokens``, ``cache_salt``,
  structured outputs, and for chat ``add_generation_prompt``, ``continue_final_message``,
  ``chat_template_kwargs`` (:mod:`~kvlab.entrypoints.chat_template`).
- **refused unless off** (:data:`REFUSED`): fields that change the answer when set and that kvlab
  cannot honour (``logit_bias`` with entries, ``tools`` with a ``tool_choice`` other than
  ``"none"``, ``best_of`` above ``n``, beam search, ...): a 400 naming the field, so a client
  never believes a setting took effect when it did not.
- **ignored**: any other field, as vLLM ignores a field its models do not define (they allow
  extra fields and log them: ``OpenAIBaseModel`` in ``vllm/entrypoints/serve/engine/protocol.py``),
  and fields vLLM defines that cannot change kvlab's answer (``stream_interval``, ``priority``
  0, ``request_id``, ...). :attr:`ParsedRequest.ignored` names them; the server logs them and
  lists them in the ``x-kvlab-ignored-fields`` response header (vLLM only logs them, at DEBUG).

Log-probabilities follow OpenAI's two APIs: completions take ``logprobs: int`` (0..20
alternatives per token), chat takes ``logprobs: bool`` and ``top_logprobs: int`` (0..20; more
than 0 only with ``logprobs: true``, as in vLLM). ``echo`` (completions) prepends the prompt;
with ``logprobs`` the prompt's tokens are scored too (``SamplingParams.prompt_logprobs``, the
first one ``null``), and ``max_tokens: 0`` then answers the prompt alone (vLLM runs one token and
drops it). ``max_tokens`` as vLLM resolves it (``get_max_tokens`` in
``vllm/entrypoints/serve/utils/api_utils.py``): completions default to 16 (``null`` too), chat to
the checkpoint's ``generation_config.json`` ``max_new_tokens`` when it has one; the result is
clamped to what fits the context, and a value above the context length itself is a 400.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.core.sampling_params import SamplingParams, check_stop
from kvlab.entrypoints.chat_template import (
    KVLAB_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    conversation,
)

__all__ = ["APIError", "ParsedRequest", "error_body", "generation_defaults", "json_object",
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


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n",
          "stream", "stream_options", "ignore_eos", "stop_token_ids", "stop", "user", "logprobs",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "skip_special_tokens",
          "spaces_between_special_tokens", "include_stop_str_in_output", "no_stop_trim",
          "add_special_tokens", "cache_salt"}
#: fields kvlab honours on /v1/completions ...
COMPLETION_FIELDS = COMMON | {"prompt", "echo"}
#: ... and on /v1/chat/completions (``tools``, ``documents`` and ``reasoning_effort`` reach the
#: template, as in vLLM, and count as ignored when it does not read them)
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                        "add_generation_prompt", "continue_final_message",
                        "chat_template_kwargs"}
TEMPLATE_FIELDS = ("tools", "documents", "reasoning_effort")


def _falsy(value: Any, body: dict) -> bool:
    return not value


def _null(value: Any, body: dict) -> bool:
    return value is None


def _no_more_than_n(value: Any, body: dict) -> bool:
    n = body.get("n") if body.get("n") is not None else 1
    return value is None or (type(value) is int and type(n) is int and value <= n)


#: fields that change the answer and that kvlab cannot honour: ``name -> is it off?``; set, a
#: 400 naming the field (tools and functions: :func:`_check_tools`)
REFUSED = {
    "logit_bias": _falsy, "best_of": _no_more_than_n, "use_beam_search": _falsy,
    "suffix": _falsy, "truncate_prompt_tokens": _null, "allowed_token_ids": _null,
    "bad_words": _falsy, "prompt_logprobs": _null, "logprob_token_ids": _falsy,
    "prompt_embeds": _null, "kv_transfer_params": _null, "ec_transfer_params": _null,
    "repetition_detection": _null, "watermarking": _falsy, "return_token_ids": _falsy,
    "return_tokens_as_token_ids": _falsy, "priority": _falsy,
}
#: on chat, less the completions-only fields, plus vLLM's chat ``echo`` (repeat the last
#: message), another template, and the rendered prompt text
CHAT_REFUSED = {**{k: v for k, v in REFUSED.items() if k not in ("suffix", "prompt_embeds")},
                "echo": _falsy, "chat_template": _null, "return_prompt_text": _falsy}
#: most alternatives per token that ``logprobs`` / ``top_logprobs`` may ask for (OpenAI's chat
#: limit and vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20
STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
              "guided_choice", "guided_grammar")
#: completions' ``max_tokens`` when absent or null (``CompletionRequest.max_tokens``)
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: the ``generation_config.json`` fields vLLM takes as server defaults
#: (``ModelConfig.get_diff_sampling_param``, ``vllm/config/model.py``): file name -> field
GENERATION_DEFAULTS = {"repetition_penalty": "repetition_penalty",
                       "presence_penalty": "presence_penalty",
                       "frequency_penalty": "frequency_penalty", "temperature": "temperature",
                       "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                       "max_new_tokens": "max_tokens"}


@dataclass
class ParsedRequest:
    """A validated request: what to send the engine and how to answer.

    ``prompts``: one entry per prompt (``/v1/completions`` takes an array; chat has one, the
    rendered template); ``params`` carries every sampling field, its ``max_tokens`` provisional
    until :meth:`params_for` resolves it for the prompt's length (``max_tokens`` None: the rest
    of the context). ``add_special_tokens``: encode string prompts with the BOS (completions'
    default; chat's template writes its own). ``structured_param`` names the field that set
    ``params.structured_outputs`` (for a 400 if it does not compile). ``logprobs``:
    alternatives to report per token (completions' ``logprobs``, chat's ``top_logprobs``, 0 for
    chat's bare ``logprobs: true``), None when not asked; it is also ``params.logprobs``.
    ``echo``: prepend the prompt's text to each choice (completions), and with ``logprobs`` its
    tokens' entries; ``echo_only``: ``echo`` with ``max_tokens: 0`` (the engine samples one
    token, which the answer drops). ``skip_special_tokens`` / ``include_stop``: how each
    choice's text is decoded and cut. ``cache_salt``: the prefix-cache domain. ``ignored``: the
    fields that had no effect (see the module docstring).
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
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    include_stop: bool = False
    cache_salt: str | None = None
    ignored: tuple[str, ...] = ()

    @property
    def prompt(self) -> str | list[int]:
        return self.prompts[0]

    @property
    def limit_param(self) -> str:
        return "max_completion_tokens" if self.chat else "max_tokens"

    def check_max_tokens(self, max_model_len: int) -> None:
        """APIError 400 when ``max_tokens`` exceeds the context length itself (vLLM's
        ``TokenizeParams.__post_init__``, ``vllm/renderers/params.py``); less is clamped."""
        if self.max_tokens is not None and not self.echo_only \
                and self.max_tokens > max_model_len:
            raise APIError(400, f"{self.limit_param}={self.max_tokens} cannot be greater than "
                                f"max_model_len={max_model_len}. Please request fewer output "
                                "tokens.", param=self.limit_param, code="invalid_value")

    def params_for(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """The sampling parameters for a prompt of ``prompt_len`` tokens: ``max_tokens``
        clamped to what fits the context (vLLM's ``get_max_tokens``); APIError 400 naming
        ``min_tokens`` when that no longer fits."""
        room = max_model_len - prompt_len
        limit = room if self.max_tokens is None or self.echo_only \
            else min(self.max_tokens, room)
        if self.echo_only:
            limit = 1
        if self.params.min_tokens > limit:
            raise APIError(400, f"min_tokens={self.params.min_tokens} is too large: the prompt "
                                f"of {prompt_len} tokens leaves {room} of this model's "
                                f"{max_model_len}" + ("" if self.max_tokens is None else
                                                      f" and {self.limit_param} is "
                                                      f"{self.max_tokens}"),
                           param="min_tokens", code="context_length_exceeded")
        if limit == self.params.max_tokens:
            return self.params
        return dataclasses.replace(self.params, max_tokens=limit)


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


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean, got {value!r}"[:300], param=name,
                       code="invalid_type")
    return value


def _check_refused(body: dict, table: dict) -> None:
    for name, off in table.items():
        if name in body and not off(body[name], body):
            raise APIError(400, f"{name}={body[name]!r}"[:200] + " is not supported by kvlab's "
                           "server (it would change the answer, and kvlab cannot honour it)",
                           param=name, code="unsupported_parameter")


def _check_tools(body: dict) -> None:
    """``tools`` / ``functions`` only with ``tool_choice`` / ``function_call`` "none": kvlab
    parses no tool calls. A missing choice with tools is vLLM's default "auto"."""
    for items, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        value = body.get(choice)
        if value is None and body.get(items):
            value = "auto"
        if value not in (None, "none"):
            raise APIError(400, f"{choice}={value!r}"[:200] + " is not supported by kvlab's "
                           f"server: it parses no tool calls (send {choice}=\"none\", or no "
                           f"{items})", param=choice, code="unsupported_parameter")


def _stream_options(body: dict, stream: bool) -> tuple[bool, list[str]]:
    """``(include_usage, ignored keys)`` of ``stream_options`` (vLLM's ``StreamOptions``)."""
    opts = body.get("stream_options")
    if opts is None:
        return False, []
    if not isinstance(opts, dict):
        raise APIError(400, "stream_options must be an object {\"include_usage\": bool}",
                       param="stream_options", code="invalid_type")
    if opts and not stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.",
                       param="stream_options", code="invalid_value")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError(400, f"stream_options.include_usage must be a boolean, got "
                            f"{include!r}"[:300], param="stream_options", code="invalid_type")
    if opts.get("continuous_usage_stats"):
        raise APIError(400, "stream_options.continuous_usage_stats=true is not supported by "
                            "kvlab's server (usage comes in the last chunk)",
                       param="stream_options", code="unsupported_parameter")
    return include, [f"stream_options.{k}" for k in sorted(set(opts) - {
        "include_usage", "continuous_usage_stats"})]


def _cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= 1024):
        raise APIError(400, "cache_salt must be a string of 1 to 1024 characters",
                       param="cache_salt", code="invalid_value")
    return salt


def _chat(body: dict, template: ChatTemplate) -> tuple[str, list[str]]:
    """``(prompt text, ignored names)`` of a chat request: its messages rendered with
    ``template`` and the request's template fields."""
    try:
        messages, ignored = conversation(body.get("messages"))
    except ChatTemplateError as err:
        raise APIError(400, str(err), param="messages", code="invalid_value") from None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise APIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs",
                       code="invalid_type")
    kwargs = dict(kwargs or {})
    reads = template.variables
    ignored += [f"chat_template_kwargs.{k}" for k in sorted(kwargs) if k not in reads]
    extra = {}
    for name in TEMPLATE_FIELDS:
        if body.get(name) is not None:
            if name in reads:
                extra[name] = body[name]
            else:
                ignored.append(name)
    if "reasoning_effort" in extra:
        kwargs["reasoning_effort"] = extra.pop("reasoning_effort")
    generation = _flag(body, "add_generation_prompt", True)
    try:
        text = template.render(messages, add_generation_prompt=generation,
                               continue_final_message=_flag(body, "continue_final_message",
                                                            False),
                               tools=extra.get("tools"), documents=extra.get("documents"),
                               kwargs=kwargs)
    except ChatTemplateError as err:
        param = "continue_final_message" if "continue_final_message" in str(err) else \
            "chat_template_kwargs" if "chat_template_kwargs" in str(err) else "messages"
        raise APIError(400, str(err), param=param, code="invalid_value") from None
    return text, ignored


def parse_request(raw: bytes, *, chat: bool, served_model: str,
                  template: ChatTemplate | None = None,
                  defaults: Mapping[str, Any] | None = None) -> ParsedRequest:
    """Parse and validate one request body; :class:`APIError` naming the problem.
    ``template``: the model's chat template (kvlab's when None); ``defaults``: the server's
    default sampling fields (:func:`generation_defaults`)."""
    body = json_object(raw)
    defaults = defaults or {}
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    refused = CHAT_REFUSED if chat else REFUSED
    ignored = sorted(set(body) - allowed - set(refused) - set(TEMPLATE_FIELDS if chat else ()))
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
    _check_refused(body, refused)
    if chat:
        _check_tools(body)
    logprobs, echo = _logprobs(body, chat)
    stream = _flag(body, "stream", False)
    include_usage, more = _stream_options(body, stream)
    ignored += more
    if chat:
        text, more = _chat(body, template or ChatTemplate(KVLAB_CHAT_TEMPLATE))
        ignored += more
        prompts: list[str | list[int]] = [text]
    else:
        prompts = _prompts(body.get("prompt"))
    try:
        stop = check_stop(body.get("stop"))
    except ValueError as err:
        raise APIError(400, str(err), param="stop", code="invalid_value") from None
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens, limit_param = body["max_completion_tokens"], "max_completion_tokens"
    elif chat:
        max_tokens, limit_param = body.get("max_tokens"), "max_tokens"
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
    else:   # completions: absent and null are 16 (vLLM's normalize_null_max_tokens)
        max_tokens, limit_param = body.get("max_tokens"), "max_tokens"
        if max_tokens is None:
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    echo_only = echo and max_tokens == 0 and type(max_tokens) is int
    # provisional until the prompt's length is known (ParsedRequest.params_for): the value
    # asked for, else min_tokens, so SamplingParams checks both as far as they are known
    least = body.get("min_tokens")
    kw: dict[str, Any] = {"max_tokens": 1 if echo_only else max_tokens if max_tokens is not None
                          else least if type(least) is int and least > 1 else 1}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = body.get(name, defaults.get(name))
        if value is not None:
            kw[name] = value
    for name in ("seed", "n", "ignore_eos", "stop_token_ids", "min_tokens"):
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
    _flag(body, "spaces_between_special_tokens", True)   # validated: see serving docs
    include_stop = _flag(body, "include_stop_str_in_output", False) \
        or _flag(body, "no_stop_trim", False)
    return ParsedRequest(
        chat, model, prompts, params, max_tokens, stream, include_usage, stop, structured_param,
        logprobs, echo, echo_only, add_special_tokens=_flag(body, "add_special_tokens", not chat),
        skip_special_tokens=_flag(body, "skip_special_tokens", True), include_stop=include_stop,
        cache_salt=_cache_salt(body), ignored=tuple(sorted(set(ignored))))


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """The server's default sampling fields from ``model_dir/generation_config.json``, as
    ``vllm serve`` takes them (``--generation-config auto``): the fields of
    :data:`GENERATION_DEFAULTS` that the file sets, ``max_new_tokens`` as ``max_tokens``."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {ours: config[theirs] for theirs, ours in GENERATION_DEFAULTS.items()
            if config.get(theirs) is not None}
