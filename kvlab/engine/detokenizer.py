"""Incremental detokenization and stop strings: token ids in, text deltas out, never resent.

A byte-level tokenizer splits one character into several tokens (a CJK character is three
UTF-8 bytes, an emoji four), so the text of a prefix of the tokens can end in half a character,
which decodes to U+FFFD. Sending that and later the real character would corrupt the stream.
:class:`IncrementalDetokenizer` holds such an incomplete tail back until it completes, and
decodes only a short window of tokens per update (the idea of vLLM's
``detokenize_incrementally``, ``vllm/transformers_utils/detokenizer_utils.py``): the text of
the window minus the text of its first, already-sent tokens is the new text. Decoding a window
instead of everything keeps each update O(1) in the length of the output, and decoding the
already-sent tokens with it keeps decoders that treat the first token specially (sentencepiece's
leading space) exact.

Contract: the deltas of :meth:`IncrementalDetokenizer.push` and then :meth:`~.flush`,
concatenated, equal ``decode(all token ids)`` for any decoder whose lossy UTF-8 decoding restarts
at a complete character (``tokenizers``' byte-level, sentencepiece and BPE decoders do).

:class:`StopStringMatcher` finds stop strings in a stream of text deltas. It returns the text
before the first match (the match itself is excluded, as in vLLM and OpenAI), and holds back the
longest tail that could still become a stop string, so streamed text never contains a prefix of
a stop string that later completes. :class:`TextStream` chains the two for one sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvlab.core.sampling_params import check_stop

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "TextStream"]

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of a growing list of token ids, one stable delta at a time.

    ``decode(ids) -> str`` decodes a list of token ids (special tokens skipped or not, as the
    caller wants). Tokens ``[prefix, read)`` are the window's already-sent part; ``[read, end)``
    the part whose text is still held back (it ends in an incomplete character).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.token_ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, new_ids: Iterable[int]) -> str:
        """Append ``new_ids``; return the text they complete ('' while it is incomplete)."""
        self.token_ids.extend(new_ids)
        if len(self.token_ids) == self._read:
            return ""
        sent = self.decode(self.token_ids[self._prefix:self._read])
        window = self.decode(self.token_ids[self._prefix:])
        if len(window) <= len(sent) or window.endswith(REPLACEMENT):
            return ""          # nothing new yet, or half a character: wait for more tokens
        self._prefix, self._read = self._read, len(self.token_ids)
        return window[len(sent):]

    def flush(self) -> str:
        """At the end: the text still held back, as ``decode`` renders it (an incomplete last
        character becomes U+FFFD, exactly as in the text of all tokens)."""
        if self._read == len(self.token_ids):
            return ""
        sent = self.decode(self.token_ids[self._prefix:self._read])
        window = self.decode(self.token_ids[self._prefix:])
        self._prefix = self._read = len(self.token_ids)
        return window[len(sent):]

    @property
    def pending(self) -> int:
        """Tokens whose text is held back."""
        return len(self.token_ids) - self._read


class StopStringMatcher:
    """Feed text deltas; get back what may be sent and the stop string once one matched.

    The occurrence that is complete first (the one ending leftmost; of two ending at the same
    place, the longer) ends the text: ``matched`` is that stop string and the text from its start
    on is dropped, or with ``include`` kept up to its end (vLLM's
    ``include_stop_str_in_output``; nothing is then held back). This rule does not depend on how
    the text was cut into deltas. ``feed(text, armed=False)`` passes text on without matching
    in it (the first ``min_tokens`` tokens' text): a later occurrence must end in armed text,
    as in vLLM (``BaseIncrementalDetokenizer.update``, ``vllm/v1/engine/detokenizer.py``).
    """

    def __init__(self, stop: str | Sequence[str] | None, include: bool = False) -> None:
        self.stop = check_stop(stop)
        self.include = include
        self._longest = max((len(s) for s in self.stop), default=0)
        self._tail = ""       # the last (longest - 1) characters fed, sent or not
        self._unsent = 0      # how many of them are held back
        self.matched: str | None = None

    def feed(self, text: str, armed: bool = True) -> str:
        """The part of the held text and ``text`` that can be sent now ('' after a match)."""
        if self.matched is not None:
            return ""
        if not self.stop:
            return text
        buf = self._tail + text
        first_unsent = len(self._tail) - self._unsent
        if armed:
            new_from = len(self._tail)      # an occurrence must end in ``text``
            best: tuple[int, int, str] | None = None
            for s in self.stop:
                at = buf.find(s, max(0, new_from - len(s) + 1))
                if at >= 0 and (best is None or (at + len(s), at) < best[:2]):
                    best = (at + len(s), at, s)
            if best is not None:
                self.matched = best[2]
                self._tail, self._unsent = "", 0
                return buf[first_unsent:max(best[0] if self.include else best[1],
                                            first_unsent)]
        keep = 0 if self.include else min(self._partial_tail(buf), len(buf) - first_unsent)
        self._unsent = keep
        self._tail = buf[max(0, len(buf) - self._longest + 1):]
        return buf[first_unsent:len(buf) - keep]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[len(buf) - n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """At an end that is not a stop: the held-back tail (it never became a stop string)."""
        out = self.held
        self._tail, self._unsent = "", 0
        return "" if self.matched is not None else out

    @property
    def held(self) -> str:
        return self._tail[len(self._tail) - self._unsent:] if self._unsent else ""


class TextStream:
    """One sample's text: token ids in (:meth:`push`), sendable text deltas out, until a stop
    string matches (``stop_reason`` is then that string and :attr:`stopped` is True).
    ``text`` is everything returned so far. Stop strings are looked for only in the text of
    tokens after the first ``min_tokens`` (vLLM's rule); ``include_stop``: the matched string
    stays in the text."""

    def __init__(self, decode: Callable[[list[int]], str],
                 stop: str | Sequence[str] | None = None, *, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        self.detok = IncrementalDetokenizer(decode)
        self.matcher = StopStringMatcher(stop, include_stop)
        self.min_tokens = min_tokens
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.matcher.matched is not None

    @property
    def stop_reason(self) -> str | None:
        return self.matcher.matched

    @property
    def token_ids(self) -> list[int]:
        return self.detok.token_ids

    def _feed(self, new_ids: list[int]) -> str:
        """Detokenize ``new_ids`` and match stop strings in text past ``min_tokens``."""
        quiet = min(len(new_ids), max(0, self.min_tokens - len(self.detok.token_ids)))
        out = ""
        if quiet:
            out = self.matcher.feed(self.detok.push(new_ids[:quiet]), armed=False)
        if quiet < len(new_ids):
            out += self.matcher.feed(self.detok.push(new_ids[quiet:]))
        return out

    def push(self, new_ids: Iterable[int]) -> str:
        out = self._feed(list(new_ids))
        self.text += out
        return out

    def finish(self) -> str:
        """The rest of the text at the sample's end (a stop string may still match in it)."""
        out = self.matcher.feed(self.detok.flush(),
                                armed=len(self.detok.token_ids) > self.min_tokens)
        out += self.matcher.flush()
        self.text += out
        return out
