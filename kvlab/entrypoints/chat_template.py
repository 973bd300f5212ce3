"""Chat messages to prompt text: the model's Jinja chat template, rendered as transformers and
vLLM render it.

A checkpoint's ``tokenizer_config.json`` may carry a ``chat_template``; kvlab-tiny's carries
:data:`KVLAB_CHAT_TEMPLATE`, which is also the fallback for a checkpoint without one. It writes
one ``role: content`` line per message after the BOS token, and ``assistant:`` on a last line
when ``add_generation_prompt`` is set::

    <|bos|>system: Be brief.
    user: Where is Vale?
    assistant: [call lookup {"place": "Vale"}]
    tool: north of the river
    assistant:

Roles are ``system``, ``developer``, ``user``, ``assistant`` and ``tool``; content is a string or
a list of text parts (joined with newlines); an assistant's ``tool_calls`` follow its content as
``[call NAME ARGUMENTS-JSON]``. kvlab's models are not chat-tuned: the format only has to be
deterministic, and the same wherever it is rendered.

:class:`ChatTemplate` renders in the environment transformers' ``apply_chat_template`` uses
(``transformers/utils/chat_template_utils.py``, ``_compile_jinja_template``: a sandbox with
``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``strftime_now`` and a ``tojson``
that keeps non-ASCII), which is also what ``vllm serve`` runs (``vllm/renderers/hf.py``,
``safe_apply_chat_template``). The template writes no literal newline or space next to a block
tag, so ``trim_blocks`` cannot eat one, and it writes the BOS itself: chat prompts are encoded
without special tokens (vLLM's ``add_special_tokens=False`` for chat). What the server adds as
vLLM does (``vllm/renderers/chat_utils.py``): assistant ``tool_calls`` arguments given as a JSON
string are parsed to an object (``_postprocess_messages``), ``chat_template_kwargs`` reach the
template and only the names it reads count as used (``resolve_chat_template_kwargs``), and
``continue_final_message`` cuts the text right after the last message's content, as
transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["KVLAB_CHAT_TEMPLATE", "ROLES", "ChatTemplate", "ChatTemplateError",
           "conversation"]

ROLES = ("system", "developer", "user", "assistant", "tool")

#: kvlab's chat template. One line of Jinja on purpose: newlines and spaces are written as
#: ``{{ '\n' }}`` expressions, never as literal text beside a block tag.
KVLAB_CHAT_TEMPLATE = "".join([
    "{{ bos_token }}",
    "{% for message in messages %}",
    "{% if message['role'] not in ['system', 'developer', 'user', 'assistant', 'tool'] %}",
    "{{ raise_exception('kvlab chat template: roles are system, developer, user, assistant "
    "and tool, not ' + message['role']) }}",
    "{% endif %}",
    "{% if not loop.first %}{{ '\\n' }}{% endif %}",
    "{{ message['role'] + ': ' }}",
    "{% if message['content'] is string %}{{ message['content'] }}",
    "{% elif message['content'] is iterable %}",
    "{% for part in message['content'] %}",
    "{% if not loop.first %}{{ '\\n' }}{% endif %}{{ part['text'] }}",
    "{% endfor %}",
    "{% endif %}",
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}",
    "{% for call in message['tool_calls'] %}",
    "{% if message['content'] or not loop.first %}{{ ' ' }}{% endif %}",
    "{{ '[call ' + call['function']['name'] + ' ' }}",
    "{{ call['function']['arguments'] | tojson }}{{ ']' }}",
    "{% endfor %}",
    "{% endif %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}{{ '\\nassistant:' }}{% endif %}",
])

#: template kwargs vLLM refuses (``resolve_chat_template_kwargs``)
_RESERVED = ("chat_template", "tokenize")
#: transformers' marker for the end of the message to continue (``apply_chat_template``)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A conversation the template cannot render (the template's own message, or ours)."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may name (``bos_token`` ...), as
    transformers passes them (``special_tokens_map``)."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def for_tokenizer(cls, tokenizer_file: Path, bos: str | None,
                      eos: str | None) -> ChatTemplate:
        """The template of the checkpoint whose ``tokenizer.json`` is ``tokenizer_file``: its
        ``tokenizer_config.json``'s ``chat_template`` (and special tokens), else kvlab's.
        ``bos`` / ``eos``: the token strings to use when that file names none."""
        path = tokenizer_file.parent / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        special = {k: v for k, v in config.items()
                   if k.endswith("_token") and isinstance(v, str)}
        for name, value in (("bos_token", bos), ("eos_token", eos)):
            if value is not None:
                special.setdefault(name, value)
        source = config.get("chat_template")
        if not isinstance(source, str):
            source = KVLAB_CHAT_TEMPLATE
        return cls(source, special)

    @cached_property
    def _compiled(self):
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env, env.from_string(self.source)

    @cached_property
    def variables(self) -> frozenset[str]:
        """The names the template reads (what a ``chat_template_kwargs`` key can change)."""
        from jinja2 import meta

        env, _ = self._compiled
        return frozenset(meta.find_undeclared_variables(env.parse(self.source)))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list | None = None,
               documents: list | None = None,
               kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text of ``messages`` (already checked by :func:`conversation`), with
        ``tools``, ``documents`` and ``kwargs`` passed to the template as vLLM passes them;
        :class:`ChatTemplateError` when the template refuses them."""
        import jinja2

        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("Cannot set both `continue_final_message` and "
                                    "`add_generation_prompt` to True.")
        kwargs = dict(kwargs or {})
        if bad := sorted(set(kwargs) & set(_RESERVED)):
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(bad)}")
        for name in ("messages", "add_generation_prompt", "continue_final_message"):
            kwargs.pop(name, None)        # the request's own fields win, as in vLLM
        final = None
        if continue_final_message:
            messages = [*messages[:-1], dict(messages[-1])]
            final = _last_text(messages[-1])
            if final is None:
                raise ChatTemplateError("continue_final_message: the final message has no "
                                        "text to continue")
            _tag_last_text(messages[-1])
        _, template = self._compiled
        try:
            text = template.render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as err:
            raise ChatTemplateError(str(err)) from None
        if final is not None:
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0 or final.strip() not in text:
                raise ChatTemplateError("continue_final_message: the template does not render "
                                        "the final message's text")
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG \
                else text[:at].rstrip()
        return text


def _last_text(message: dict) -> str | None:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p["text"] for p in content if isinstance(p, dict) and "text" in p]
        return texts[-1] if texts else None
    return None


def _tag_last_text(message: dict) -> None:
    content = message["content"]
    if isinstance(content, str):
        message["content"] = content + _CONTINUE_TAG
        return
    parts = [dict(p) for p in content]
    for part in reversed(parts):
        if "text" in part:
            part["text"] += _CONTINUE_TAG
            break
    message["content"] = parts


#: what a message may carry, by role, and reach the template (vLLM's parsed message fields)
_PASSED = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning",
           "reasoning_content"}


def _content(i: int, m: dict) -> str | None:
    """Message ``i``'s text: a str, text parts joined with newlines (as vLLM joins them for
    templates that take strings), or None (an assistant turn with no content)."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m["role"] == "assistant":
        return None
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(
                    f"messages[{i}].content[{j}]: only text parts {{\"type\": \"text\", "
                    f"\"text\": str}} are supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(
        f"messages[{i}].content must be a string or a non-empty list of text parts"
        + (" (null only for assistant turns)" if content is None else ""))


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant's ``tool_calls``, arguments as objects (vLLM parses a JSON string and
    reads anything that is not a JSON object as ``{}``)."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(
                f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", "
                "\"function\": {\"name\": str, \"arguments\": str}}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except ValueError:
                args = {}
        out.append({**call, "function": {**fn, "arguments": args if isinstance(args, dict)
                                         else {}}})
    return out


def conversation(messages: Any) -> tuple[list[dict], list[str]]:
    """``(messages for the template, ignored fields)`` from a request's ``messages``;
    :class:`ChatTemplateError` naming the message and field for anything malformed. Content is
    given as text; fields no template reads (``refusal``, ``audio``, ...) are dropped and
    named ``messages[].field``."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    ignored: set[str] = set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string role")
        if m["role"] not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role {m['role']!r} is not one of "
                                    f"{', '.join(ROLES)}")
        if not isinstance(m.get("name", ""), str):
            raise ChatTemplateError(
                f"messages[{i}].name must be a string, got {m['name']!r}"[:300])
        text = _content(i, m)
        msg: dict[str, Any] = {"role": m["role"], "content": text}
        for key in ("name", "tool_call_id", "reasoning", "reasoning_content"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None and (calls := _tool_calls(i, calls)):
            msg["tool_calls"] = calls
        ignored.update(f"messages[].{k}" for k in set(m) - _PASSED
                       | ({"tool_calls"} & set(m) if m["role"] != "assistant" else set()))
        out.append(msg)
    return out, sorted(ignored)

