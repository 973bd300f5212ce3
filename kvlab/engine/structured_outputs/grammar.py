"""Compiling structured-outputs parameters against kvlab's vocabulary, and a request's grammar
state (backed by xgrammar, the library vLLM and SGLang use).

- :class:`GrammarCompiler` builds xgrammar's ``TokenizerInfo`` from a kvlab
  :class:`~kvlab.engine.tokenizer.Tokenizer` (its byte-level / sentencepiece encoding read from
  ``tokenizer.json``'s decoder; special tokens such as BOS never match text; the model's EOS ids
  are the grammar's stop tokens) and compiles :class:`StructuredOutputsParams`, caching the
  result (LRU, thread-safe). A pattern, schema or grammar that does not compile raises
  :class:`GrammarError` (a ValueError) naming it.
- :class:`GrammarState` is one sequence's position in its grammar: the xgrammar matcher plus
  the token ids it has accepted. Invariant kept by the engine: ``accepted_token_ids`` equals
  the request's ``output_token_ids`` after every step. A grammar *terminates* when it accepts
  a stop token (EOS) in a position where the grammar may end; the engine makes EOS a stop
  token of every constrained request, so termination finishes it with ``finish_reason="stop"``.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from kvlab.core.sampling_params import StructuredOutputsParams
from kvlab.engine.structured_outputs.bitmask import allocate_bitmask, unpack_bitmask

if TYPE_CHECKING:
    from kvlab.engine.tokenizer import Tokenizer

__all__ = ["GrammarCompiler", "GrammarError", "GrammarState", "choice_ebnf", "vocab_type"]


class GrammarError(ValueError):
    """A regex, JSON schema, choice list or EBNF grammar that cannot be compiled."""


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (string literals escaped)."""
    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    return "root ::= " + " | ".join(literal(c) for c in choices)


def vocab_type(decoder: dict | None) -> tuple[xgr.VocabType, bool]:
    """(xgrammar vocabulary type, add_prefix_space) for a ``tokenizer.json`` decoder section.

    ``ByteLevel`` (GPT-2 style: each byte a printable char, ``Ġ`` = space) -> BYTE_LEVEL;
    ``ByteFallback`` / ``Metaspace`` (sentencepiece style: ``▁`` = space, ``<0x0A>`` = a raw
    byte) -> BYTE_FALLBACK, with ``add_prefix_space`` when the decoder strips the space that
    encoding prepended to the first word; anything else -> RAW (token strings are the text).
    """
    parts = [] if decoder is None else (
        decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder])
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, False
    if types & {"ByteFallback", "Metaspace"}:
        prefix = any(p.get("type") == "Strip" and p.get("start", 0) >= 1 for p in parts) or any(
            p.get("type") == "Metaspace" and (p.get("prepend_scheme") in ("first", "always")
                                              or p.get("add_prefix_space") is True)
            for p in parts)
        return xgr.VocabType.BYTE_FALLBACK, prefix
    return xgr.VocabType.RAW, False


_CPP_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")


def _clean(err: Exception) -> str:
    """xgrammar's C++ message without its time stamp and source location."""
    return _CPP_PREFIX.sub("", str(err)).strip().splitlines()[0] if str(err).strip() else repr(err)


class GrammarCompiler:
    """Compiles structured-outputs parameters for one tokenizer and one model vocabulary.

    ``vocab_size``: the model's logits width (ids past the tokenizer's vocabulary never match).
    ``stop_token_ids``: the tokens that end a grammar (the model's EOS ids). ``cache_size``:
    compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 cache_size: int = 128, max_threads: int = 2):
        vocab = tokenizer.get_vocab()
        if vocab_size < 1 or not stop_token_ids:
            raise ValueError("GrammarCompiler needs vocab_size >= 1 and at least one stop token")
        encoded = [""] * min(vocab_size, max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            if i < len(encoded):
                encoded[i] = token
        for i in tokenizer.special_token_ids:   # "" marks a special token: it matches no text
            if i < len(encoded):
                encoded[i] = ""
        kind, prefix = vocab_type(tokenizer.decoder_config)
        self.info = xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size,
                                      stop_token_ids=list(stop_token_ids),
                                      add_prefix_space=prefix)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads,
                                             cache_enabled=False)
        self._cache: OrderedDict[StructuredOutputsParams, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compilations = 0   # cache misses (compiler runs), for tests and metrics

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached). GrammarError naming the key and the
        compiler's message if it does not compile; nothing is cached then."""
        if not isinstance(spec, StructuredOutputsParams):
            raise TypeError(f"GrammarCompiler.compile expects StructuredOutputsParams, "
                            f"got {type(spec).__name__}")
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            try:
                if spec.kind == "json":
                    # compact separators, no free whitespace: a bounded schema gives a bounded
                    # output (free whitespace lets a weak model pad forever)
                    compiled = self._compiler.compile_json_schema(spec.json, any_whitespace=False)
                elif spec.kind == "regex":
                    compiled = self._compiler.compile_regex(spec.regex)
                elif spec.kind == "choice":
                    compiled = self._compiler.compile_grammar(choice_ebnf(spec.choice))
                else:
                    compiled = self._compiler.compile_grammar(spec.grammar)
            except (RuntimeError, ValueError, TypeError) as err:
                raise GrammarError(f"SamplingParams.structured_outputs[{spec.kind!r}] does not "
                                   f"compile: {_clean(err)}") from None
            self.compilations += 1
            self._cache[spec] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh :class:`GrammarState` for ``spec`` (compiled or taken from the cache)."""
        return GrammarState(self.compile(spec), spec)


class GrammarState:
    """One sequence's grammar state: which tokens may come next, given those accepted so far.

    Contract (what the engine and the speculative verifier rely on):

    - :meth:`fill_bitmask` writes the allowed next tokens into one row of an int32 bitmask
      (:func:`~kvlab.engine.structured_outputs.bitmask.allocate_bitmask`); it never changes state.
    - :meth:`accept_token` advances by one token and returns True, or returns False and changes
      nothing when the grammar does not allow it (or has terminated).
    - :meth:`rollback` undoes the last ``k`` accepted tokens exactly (any ``k`` up to
      :attr:`num_accepted`): rollback(k) then re-accepting the same tokens gives the same state.
    - :meth:`rebuild` replaces the state by the one reached from the start over ``token_ids``.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, spec: StructuredOutputsParams | None = None):
        self.compiled = compiled
        self.spec = spec
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self._matcher = xgr.GrammarMatcher(compiled)
        self._accepted: list[int] = []

    @property
    def num_accepted(self) -> int:
        return len(self._accepted)

    @property
    def accepted_token_ids(self) -> tuple[int, ...]:
        return tuple(self._accepted)

    def is_terminated(self) -> bool:
        """True once a stop token was accepted where the grammar may end: nothing may follow."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a full sentence (a stop token is allowed next)."""
        return self._matcher.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32, bit ``t % 32`` of
        word ``t // 32`` set = token ``t`` allowed). A terminated grammar allows nothing."""
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def allowed_token_ids(self) -> list[int]:
        """The token ids allowed next, ascending (slow path for tests, widgets, references)."""

        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        return unpack_bitmask(bitmask, self.vocab_size)[0].nonzero()[:, 0].tolist()

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if the grammar does not allow it."""
        if not 0 <= token_id < self.vocab_size or self._matcher.is_terminated():
            return False
        if not self._matcher.accept_token(token_id):
            return False
        self._accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens. ValueError (nothing undone) unless
        ``0 <= num_tokens <= num_accepted``."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not (
                0 <= num_tokens <= len(self._accepted)):
            raise ValueError(f"GrammarState.rollback: num_tokens must be an int in "
                             f"0..{len(self._accepted)}, got {num_tokens!r}")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._accepted[-num_tokens:]

    def rebuild(self, token_ids: Sequence[int]) -> None:
        """Become the state reached from the start by accepting ``token_ids`` (replay). Used
        where a sequence's state is lost (a fresh engine re-running a recorded request).
        ValueError naming the first refused token; the state is unchanged then."""
        fresh = GrammarState(self.compiled, self.spec)
        for i, token in enumerate(token_ids):
            if not fresh.accept_token(int(token)):
                raise ValueError(f"GrammarState.rebuild: token {token} at output position {i} "
                                 "is not allowed by the grammar")
        self._matcher, self._accepted = fresh._matcher, fresh._accepted

    def clone(self) -> GrammarState:
        """An independent copy in the same state (by replay)."""
        copy = GrammarState(self.compiled, self.spec)
        copy.rebuild(self._accepted)
        return copy

    def __repr__(self) -> str:
        kind = self.spec.kind if self.spec is not None else "grammar"
        return (f"GrammarState({kind}, accepted={len(self._accepted)}, "
                f"terminated={self.is_terminated()})")
