"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

Shapes as in vLLM 0.32.0 (``vllm/entrypoints/serve/tokenize/protocol.py`` and ``serving.py``):

- ``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true, "return_token_strs":
  false}`` or the chat form ``{"messages": [...], "add_generation_prompt": true,
  "continue_final_message": false, "return_token_strs": false}`` (``model`` optional in
  both) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``token_strs`` are
  the vocabulary's own strings (``Ġthe``), null unless asked.
- ``/detokenize`` takes ``{"tokens": [int, ...]}`` and answers ``{"prompt": str}``, special
  tokens kept (vLLM decodes with the tokenizer's default, which keeps them).
- ``/tokenizer_info`` (only with ``--enable-tokenizer-info-endpoint``, as in vLLM) answers the
  model's ``tokenizer_config.json`` without file paths, plus ``tokenizer_class`` and kvlab's
  chat template as Jinja (:data:`CHAT_TEMPLATE`), which renders exactly what
  :func:`~kvlab.entrypoints.openai_protocol.chat_prompt` builds for text messages.

lm-eval-harness's ``local-completions`` probes ``/tokenizer_info`` and ``/tokenize`` and, when
both answer, tokenizes through the server (its ``remote`` tokenizer backend).

Differences from vLLM, each a 400 naming the field rather than a silent change: the chat form
takes no ``tools``, ``chat_template`` or media fields, and its ``add_special_tokens`` must be
false: kvlab's template has no BOS of its own, so the chat tokens always start with the BOS
that ``/v1/chat/completions`` runs with (in vLLM the template writes it).
"""

from __future__ import annotations

import json
from typing import Any

from kvlab.engine.llm_engine import LLMEngine
from kvlab.entrypoints.openai_protocol import APIError, chat_prompt, json_object

__all__ = ["CHAT_TEMPLATE", "detokenize", "tokenize", "tokenizer_info"]

#: kvlab's chat template (:func:`chat_prompt`) in Jinja, for clients that render it themselves
CHAT_TEMPLATE = ("{% for m in messages %}{% if not loop.first %}\n{% endif %}"
                 "{{ m['role'] }}: {{ m['content'] if m['content'] is not none else '' }}"
                 "{% endfor %}{% if add_generation_prompt %}\nassistant:{% endif %}")

_COMPLETION = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT = {"model", "messages", "add_generation_prompt", "continue_final_message",
         "add_special_tokens", "return_token_strs"}


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean, got {value!r}", param=name,
                       code="invalid_type")
    return value


def _check_model(body: dict, served_model: str) -> None:
    model = body.get("model")
    if model is not None and model != served_model:
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{served_model}`", param="model", code="model_not_found")


def _unknown(body: dict, allowed: set[str]) -> None:
    if extra := sorted(set(body) - allowed):
        raise APIError(400, f"Unrecognized request argument supplied: {extra[0]}",
                       param=extra[0], code="unknown_parameter")


def _tokenizer(engine: LLMEngine):
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer.json: it takes token ids only",
                       code="invalid_value")
    return engine.tokenizer


def tokenize(raw: bytes, engine: LLMEngine, served_model: str) -> dict[str, Any]:
    """The answer to ``POST /tokenize`` (see the module docstring); APIError naming the field.
    Tokenizes: call it off the event loop."""
    body = json_object(raw)
    chat = "messages" in body
    _unknown(body, _CHAT if chat else _COMPLETION)
    _check_model(body, served_model)
    tok = _tokenizer(engine)
    strs = _flag(body, "return_token_strs", False)
    if chat:
        gen = _flag(body, "add_generation_prompt", True)
        if _flag(body, "continue_final_message", False) and gen:
            raise APIError(400, "Cannot set both `continue_final_message` and "
                                "`add_generation_prompt` to True.",
                           param="continue_final_message", code="invalid_value")
        if _flag(body, "add_special_tokens", False):
            raise APIError(400, "add_special_tokens=true is not supported with messages: "
                                "kvlab's chat tokens always start with BOS, as /v1/chat/"
                                "completions runs them", param="add_special_tokens",
                           code="unsupported_parameter")
        text = chat_prompt(body["messages"])
        if not gen:
            text = text.removesuffix("\nassistant:")
        ids = tok.encode(text)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, f"prompt must be a string, got {type(prompt).__name__}",
                           param="prompt", code="invalid_value")
        ids = tok.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    names = None
    if strs:
        vocab = {i: s for s, i in tok.get_vocab().items()}
        names = [vocab[i] for i in ids]
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": names}


def detokenize(raw: bytes, engine: LLMEngine, served_model: str) -> dict[str, Any]:
    """The answer to ``POST /detokenize``: ``{"prompt": text}``; APIError naming the field."""
    body = json_object(raw)
    _unknown(body, {"model", "tokens"})
    _check_model(body, served_model)
    tok = _tokenizer(engine)
    ids = body.get("tokens")
    vocab = engine.config.vocab_size
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise APIError(400, f"tokens must be a list of token ids in 0..{vocab - 1}",
                       param="tokens", code="invalid_value")
    return {"prompt": tok.decode(ids, skip_special_tokens=False)}


def tokenizer_info(engine: LLMEngine) -> dict[str, Any]:
    """The answer to ``GET /tokenizer_info``: ``tokenizer_config.json`` (when the model has
    one) less its file paths, ``tokenizer_class``, ``eos_token`` / ``bos_token`` (from the
    engine's ids when the file names none) and :data:`CHAT_TEMPLATE`."""
    tok = _tokenizer(engine)
    path = tok.path.parent / "tokenizer_config.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    for key in ("vocab_file", "merges_file", "tokenizer_file"):
        info.pop(key, None)
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")  # what HF loads it as
    names = {i: s for s, i in tok.get_vocab().items()}
    if engine.eos_token_ids:
        info.setdefault("eos_token", names.get(engine.eos_token_ids[0]))
    if engine.config.bos_token_id is not None:
        info.setdefault("bos_token", names.get(engine.config.bos_token_id))
    info["chat_template"] = CHAT_TEMPLATE
    return info
