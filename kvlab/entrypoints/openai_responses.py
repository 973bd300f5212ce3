"""OpenAI's response shapes: one choice, and log-probabilities in the completions and chat forms.

The engine reports, per generated token, a dict ``token id -> log-probability`` holding the ``k``
most likely tokens in rank order and then the sampled token if it is not among them (raw
``log_softmax`` of the logits, :class:`~kvlab.core.sampling_params.SamplingParams`). This module
names
those ids and shapes them as the two OpenAI APIs do (the shapes vLLM builds in
``vllm/entrypoints/openai/serving_completion.py`` ``_create_completion_logprobs``, read at
commit 00463e6, and ``serving_chat.py`` ``_create_chat_logprobs``, read at commit 003fe59):

- completions: ``{"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
  "text_offset": [int]}``; each top dict is the engine's whole dict (up to ``k + 1`` entries:
  OpenAI "always returns the logprob of the sampled token"); two ids with the same text
  collapse into one key, as in vLLM.
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}``; ``top_logprobs`` lists exactly the ``k`` most likely tokens, best first.

A token's text is vLLM 0.32's (``LogprobsProcessor`` in ``vllm/v1/engine/logprobs.py``:
``convert_ids_list_to_tokens`` then ``_verify_tokens``): ``decode([id])`` with special tokens kept
(the BOS reads ``<|bos|>``), and a token whose text ends in U+FFFD (part of a multi-byte
character) is decoded again after up to four of the tokens before it: the token that completes
the character reads the whole character, the others ``''`` (``_correct_decoded_token``); the
alternatives at a position use the same tokens before it. Its ``bytes`` (chat) are the token's
real bytes for byte-level BPE tokenizers (GPT-2's byte alphabet inverted) and for sentencepiece
byte-fallback tokens (``<0xE4>``), so a client can join them into the exact text (vLLM gives the
UTF-8 of the token's text); for other tokens they are the UTF-8 of its text. Log-probabilities
below ``-9999.0`` (``-inf`` for tokens a grammar masked) are reported as ``-9999.0``, OpenAI's
floor: JSON has no infinity.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LOGPROB_FLOOR", "TokenLogprob", "TokenNames", "choice", "logprobs_body"]

REPLACEMENT = "\ufffd"

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its id, log-probability, the engine's top dict, where its text starts in
    the choice's text (characters, the echoed prompt included) and the (up to 4) tokens before
    it, which name a token that completes a split character. An echoed prompt's first token
    has no logprob (``logprob`` and ``top`` None, ``null`` in the answer)."""

    token_id: int
    logprob: float | None
    top: dict[int, float] | None
    text_offset: int
    context: tuple[int, ...] = ()


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable character -> the byte it stands for.
    Bytes that are printable Latin-1 stand for themselves; the other 68 are shifted to 256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


class TokenNames:
    """Token id -> its text and its bytes (see the module docstring). ``tokenizer``: kvlab's
    :class:`~kvlab.engine.tokenizer.Tokenizer` (decode, get_vocab, decoder_config,
    special_token_ids). Both lookups are cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self._pieces = {i: s for s, i in vocab.items()}
        self._special = frozenset(tokenizer.special_token_ids)
        self._byte_level = _is_byte_level(tokenizer.decoder_config)
        self._alphabet = _byte_alphabet() if self._byte_level else {}

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per server, ids bounded
    def piece(self, token_id: int) -> str:
        """``decode([token_id])``, special tokens kept."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text(self, token_id: int, context: tuple[int, ...] = ()) -> str:
        """The token's text after ``context`` (see the module docstring)."""
        piece = self.piece(token_id)
        if not piece.endswith(REPLACEMENT):
            return piece
        decode = self.tokenizer.decode
        for n in range(1, min(len(context), 4) + 1):
            ctx = list(context[-n:])
            full = decode([*ctx, token_id])
            if full.endswith(REPLACEMENT):
                continue
            clean = len(ctx)    # context tokens that are themselves part of the character
            while clean and self.piece(ctx[clean - 1]).endswith(REPLACEMENT):
                clean -= 1
            prefix = decode(ctx[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0          # a normalizer changed the prefix: cut the common part
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            return full[common:]
        return ""

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def bytes(self, token_id: int) -> tuple[int, ...]:
        piece = self._pieces.get(token_id)
        if token_id in self._special or piece is None:
            return tuple(self.piece(token_id).encode("utf-8"))
        if self._byte_level and all(ch in self._alphabet for ch in piece):
            return tuple(self._alphabet[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return (int(piece[3:5], 16),)
            except ValueError:
                pass
        return tuple(self.piece(token_id).encode("utf-8"))


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _completion_logprobs(entries: Sequence[TokenLogprob], names: TokenNames) -> dict:
    return {"tokens": [names.text(e.token_id, e.context) for e in entries],
            "token_logprobs": [None if e.logprob is None else _lp(e.logprob) for e in entries],
            "top_logprobs": [None if e.top is None else
                             {names.text(t, e.context): _lp(v) for t, v in e.top.items()}
                             for e in entries],
            "text_offset": [e.text_offset for e in entries]}


def _chat_entry(token_id: int, logprob: float, names: TokenNames,
                context: tuple[int, ...]) -> dict:
    return {"token": names.text(token_id, context), "logprob": _lp(logprob),
            "bytes": list(names.bytes(token_id))}


def _chat_logprobs(entries: Sequence[TokenLogprob], names: TokenNames, k: int) -> dict:
    return {"content": [{**_chat_entry(e.token_id, e.logprob, names, e.context),
                         "top_logprobs": [_chat_entry(t, v, names, e.context)
                                          for t, v in list(e.top.items())[:k]]}
                        for e in entries]}


def logprobs_body(chat: bool, entries: Sequence[TokenLogprob], names: TokenNames,
                  k: int) -> dict:
    """``choice.logprobs`` for ``entries`` (a whole choice, or one streamed chunk's tokens);
    ``k``: the alternatives asked for (chat lists exactly the ``k`` best)."""
    return _chat_logprobs(entries, names, k) if chat else _completion_logprobs(entries, names)


def choice(chat: bool, index: int, text: str, finish: str | None, stop_reason: str | int | None,
           stream: bool, *, first: bool = False, logprobs: dict | None = None) -> dict:
    """One choice: a completions ``text`` choice, a chat ``message``, or (``stream``) a chat
    ``delta`` (``first``: the chunk announcing the role)."""
    if chat:
        if stream:
            body: dict[str, Any] = {"role": "assistant", "content": text} if first \
                else ({"content": text} if text or finish is None else {})
            out = {"index": index, "delta": body, "finish_reason": finish, "logprobs": logprobs}
        else:
            out = {"index": index, "message": {"role": "assistant", "content": text},
                   "finish_reason": finish, "logprobs": logprobs}
    else:
        out = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    out["stop_reason"] = stop_reason
    return out
