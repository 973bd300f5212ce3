"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

Shapes as in vLLM 0.32.0 (``vllm/entrypoints/serve/tokenize/protocol.py`` and ``serving.py``):

- ``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true, "return_token_strs":
  false}`` or the chat form ``{"messages": [...], "add_generation_prompt": true,
  "continue_final_message": false, "add_special_tokens": false, "chat_template_kwargs": {},
  "return_token_strs": false}`` (``model`` optional in both) and answers ``{"count",
  "max_model_len", "tokens", "token_strs"}``; ``token_strs`` are the vocabulary's own strings
  (``Ġthe``), null unless asked. The chat form renders the model's chat template exactly as
  ``/v1/chat/completions`` does (:mod:`~kvlab.entrypoints.chat_template`; kvlab's writes the
  BOS, so ``add_special_tokens: true`` adds a second one, as in vLLM).
- ``/detokenize`` takes ``{"tokens": [int, ...]}`` and answers ``{"prompt": str}``, special
  tokens kept (vLLM decodes with the tokenizer's default, which keeps them).
- ``/tokenizer_info`` (only with ``--enable-tokenizer-info-endpoint``, as in vLLM) answers the
  model's ``tokenizer_config.json`` without file paths, plus ``tokenizer_class``, ``eos_token``,
  ``bos_token`` and the chat template the server renders.

Other fields are ignored, as vLLM's models ignore them. A prompt is tokenized whole, as in
vLLM (``/tokenize`` has no context bound: lm-eval counts long documents through it), with the
GIL released; one beyond the context bound at a time, and the memory it took is handed back
to the system afterwards (``malloc_trim``), so a few 2 MiB prompts do not leave the server's
RSS a gigabyte higher.

lm-eval-harness's ``local-completions`` probes ``/tokenizer_info`` and ``/tokenize`` and, when
both answer, tokenizes through the server (its ``remote`` tokenizer backend).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
from typing import Any

from kvlab.engine.llm_engine import LLMEngine
from kvlab.entrypoints.chat_template import ChatTemplate, ChatTemplateError, conversation
from kvlab.entrypoints.openai_protocol import APIError, json_object

__all__ = ["detokenize", "release_memory", "tokenize", "tokenizer_info"]

#: one tokenization beyond the context bound at a time (each can take hundreds of MB)
_LARGE = threading.Lock()


def release_memory() -> None:
    """Give freed heap memory back to the system (glibc's ``malloc_trim``; elsewhere a
    no-op): glibc otherwise keeps what a large tokenization freed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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


def _tokenizer(engine: LLMEngine):
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer.json: it takes token ids only",
                       code="invalid_value")
    return engine.tokenizer


def tokenize(raw: bytes, engine: LLMEngine, served_model: str,
             template: ChatTemplate) -> dict[str, Any]:
    """The answer to ``POST /tokenize`` (see the module docstring); APIError naming the field.
    Tokenizes: call it off the event loop."""
    body = json_object(raw)
    chat = "messages" in body
    _check_model(body, served_model)
    tok = _tokenizer(engine)
    strs = _flag(body, "return_token_strs", False)
    if chat:
        gen = _flag(body, "add_generation_prompt", True)
        cont = _flag(body, "continue_final_message", False)
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise APIError(400, "chat_template_kwargs must be an object",
                           param="chat_template_kwargs", code="invalid_type")
        try:
            messages, _ = conversation(body["messages"])
            text = template.render(messages, add_generation_prompt=gen,
                                   continue_final_message=cont, kwargs=kwargs)
        except ChatTemplateError as err:
            param = "continue_final_message" if "continue_final_message" in str(err) \
                else "messages"
            raise APIError(400, str(err), param=param, code="invalid_value") from None
        special = _flag(body, "add_special_tokens", False)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise APIError(400, f"prompt must be a string, got {type(text).__name__}",
                           param="prompt", code="invalid_value")
        special = _flag(body, "add_special_tokens", True)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"the text has a lone surrogate (U+{ord(text[err.start]):04X}) at "
                            f"character {err.start}: it is not valid Unicode",
                       param="messages" if chat else "prompt", code="invalid_value") from None
    if len(text) > engine.max_model_len * tok.max_chars_per_token:
        with _LARGE:
            ids = tok.encode(text, add_special_tokens=special)
        release_memory()
    else:
        ids = tok.encode(text, add_special_tokens=special)
    names = None
    if strs:
        vocab = {i: s for s, i in tok.get_vocab().items()}
        names = [vocab[i] for i in ids]
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": names}


def detokenize(raw: bytes, engine: LLMEngine, served_model: str) -> dict[str, Any]:
    """The answer to ``POST /detokenize``: ``{"prompt": text}``; APIError naming the field."""
    body = json_object(raw)
    _check_model(body, served_model)
    tok = _tokenizer(engine)
    ids = body.get("tokens")
    vocab = engine.config.vocab_size
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise APIError(400, f"tokens must be a list of token ids in 0..{vocab - 1}",
                       param="tokens", code="invalid_value")
    return {"prompt": tok.decode(ids, skip_special_tokens=False)}


def tokenizer_info(engine: LLMEngine, template: ChatTemplate) -> dict[str, Any]:
    """The answer to ``GET /tokenizer_info``: ``tokenizer_config.json`` (when the model has
    one) less its file paths, ``tokenizer_class``, ``eos_token`` / ``bos_token`` (from the
    engine's ids when the file names none) and the chat template the server renders."""
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
    info["chat_template"] = template.source
    return info
