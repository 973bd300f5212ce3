"""One HTTP request on the engine: its prompts tokenized and checked, then its choices' text.

:func:`prepare` turns a parsed request into ``(token ids, SamplingParams, prompt text)`` per
prompt, with a 400 naming the field for anything the engine would refuse (call it off the event
loop: it tokenizes). :class:`RequestRun` follows the engine requests of one HTTP request (one
per prompt; choice ``k = prompt * n + sample``) and turns their deltas into :class:`Event`
objects: each choice's text is detokenized incrementally and cut at stop strings
(:class:`ChoiceText`), the echoed prompt is prepended to its first event, and with logprobs each
new token comes with its :class:`~kvlab.entrypoints.openai_responses.TokenLogprob` (the engine's
values, and where the token's text starts).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.detokenizer import IncrementalDetokenizer, TextStream
from kvlab.engine.structured_outputs.grammar import GrammarError
from kvlab.entrypoints.async_engine import AsyncEngine, RequestStream, StreamDelta
from kvlab.entrypoints.openai_protocol import APIError, ParsedRequest
from kvlab.entrypoints.openai_responses import TokenLogprob

__all__ = ["ChoiceText", "Event", "RequestRun", "Work", "prepare"]


@dataclass(frozen=True)
class Work:
    """One prompt, ready for the engine: its token ids, its sampling parameters and its text
    (the prompt string, or its token ids decoded; what ``echo`` prepends)."""

    token_ids: tuple[int, ...]
    params: SamplingParams
    prompt_text: str


def _text_ids(engine, text: str, parsed: ParsedRequest, param: str) -> tuple[int, ...]:
    """A string prompt's token ids, bounded first: a text longer than the context allows
    characters for (its length times the longest token) is refused without tokenizing it, as
    vLLM's ``TokenizeParams._text_len_check`` (``vllm/renderers/params.py``) does; a lone
    surrogate (not encodable as UTF-8) is refused by name. Tokenizing releases the GIL
    (:meth:`~kvlab.engine.llm_engine.Tokenizer.encode`)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer.json: pass prompts as token ids",
                       param=param, code="invalid_value")
    limit = engine.max_model_len * tokenizer.max_chars_per_token
    if len(text) > limit:
        raise APIError(400, f"This model's maximum context length is {engine.max_model_len} "
                            f"tokens. However, your prompt contains {len(text)} characters "
                            f"(more than {limit} characters, which is the upper bound for "
                            f"{engine.max_model_len} input tokens). Please reduce the length "
                            "of the input prompt.", param=param, code="context_length_exceeded")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"the {param} text has a lone surrogate "
                            f"(U+{ord(text[err.start]):04X}) at character {err.start}: it is not "
                            "valid Unicode, so it cannot be tokenized", param=param,
                       code="invalid_value") from None
    return tuple(tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens))


def prepare(aeng: AsyncEngine, parsed: ParsedRequest) -> list[Work]:
    """Tokenize (once) and validate every prompt of ``parsed`` (worker thread); APIError 400
    naming the field the engine refuses."""
    engine = aeng.engine
    tokenizer = engine.tokenizer
    param = "messages" if parsed.chat else "prompt"
    if tokenizer is None:
        for needs, name in ((parsed.stop, "stop"), (parsed.logprobs is not None, "logprobs")):
            if needs:
                raise APIError(400, f"{name} needs a tokenizer (to find or name text); this "
                                    "model has none", param=name, code="invalid_value")
    parsed.check_max_tokens(engine.max_model_len)
    out = []
    for prompt in parsed.prompts:
        ids = _text_ids(engine, prompt, parsed, param) if isinstance(prompt, str) else prompt
        try:
            _, ids = engine.encode_prompt(list(ids))
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), param=param, code="invalid_value") from None
        if len(ids) >= engine.max_model_len:
            raise APIError(400, f"This model's maximum context length is "
                                f"{engine.max_model_len} tokens; the prompt has {len(ids)} "
                                "and leaves no room to generate", param=param,
                           code="context_length_exceeded")
        params = parsed.params_for(len(ids), engine.max_model_len)
        try:
            aeng.validate(list(ids), params)
        except GrammarError as err:
            raise APIError(400, f"{parsed.structured_param}: {err}",
                           param=parsed.structured_param, code="invalid_value") from None
        except (ValueError, TypeError) as err:
            field = re.match(r"SamplingParams\.(\w+)", str(err))   # the field it names
            name = "n" if str(err).startswith("n=") else field.group(1) if field else param
            raise APIError(400, str(err), param=name, code="invalid_value") from None
        text = prompt if isinstance(prompt, str) else \
            tokenizer.decode(list(ids)) if parsed.echo and tokenizer is not None else ""
        out.append(Work(tuple(ids), params, text))
    return out


@dataclass
class Event:
    """What choice ``index`` gained: new ``text``, the ``finish`` reason at its end, and with
    logprobs one entry per new token (``[]`` when none arrived)."""

    index: int
    text: str
    finish: str | None
    logprobs: list[TokenLogprob] | None = None


class ChoiceText(TextStream):
    """A :class:`~kvlab.engine.detokenizer.TextStream` that can also say where each token's
    text starts: ``push(ids, offsets)`` appends one offset per token, the number of characters
    decoded before it plus ``start`` (the echoed prompt's length). Tokens that end inside a
    character share the offset of that character's start. Offsets count decoded text, so a
    token after a stop string's start points past the (cut) choice text. ``mute_last``: the
    last token is a stop token whose text vLLM leaves out (its offset is where it would be)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...],
                 start: int = 0, *, min_tokens: int = 0, include_stop: bool = False) -> None:
        super().__init__(decode, stop, min_tokens=min_tokens, include_stop=include_stop)
        self.decoded = start
        self.context: list[int] = []    # the last tokens, for naming split characters

    def push(self, new_ids: Iterable[int], offsets: list[int] | None = None,
             mute_last: bool = False) -> str:
        ids = list(new_ids)
        spoken = ids[:-1] if mute_last else ids
        self.context = (self.context + ids)[-8:]
        if offsets is None:
            return super().push(spoken)
        out = ""
        for t in spoken:    # per token: the offset where its text starts, the text it completes
            offsets.append(self.decoded)
            armed = len(self.detok.token_ids) >= self.min_tokens
            piece = self.detok.push([t])
            self.decoded += len(piece)
            out += self.matcher.feed(piece, armed=armed)
        if mute_last and ids:
            offsets.append(self.decoded)
        self.text += out
        return out


class RequestRun:
    """The engine requests of one HTTP request and their choices' text (see the module
    docstring). :meth:`next` waits for any request's next delta and turns it into events;
    :meth:`close` aborts what is unfinished (always call it). ``keep``: also keep each choice's
    logprob entries for the whole answer (non-streaming)."""

    def __init__(self, streams: list[RequestStream], parsed: ParsedRequest, work: list[Work],
                 decode: Callable[[list[int]], str], keep: bool,
                 eos_ids: Iterable[int] = ()) -> None:
        self.streams = streams
        self.n = n = parsed.params.n
        total = len(streams) * n
        self.echo = [w.prompt_text if parsed.echo else "" for w in work for _ in range(n)]
        self.echo_logprobs = parsed.echo and parsed.logprobs is not None
        self.echo_only = parsed.echo_only        # max_tokens 0: the sampled token is dropped
        self.prompt_ids = [w.token_ids for w in work]
        self.prompt_lps: list[list | None] = [None] * len(streams)
        self.texts = [ChoiceText(decode, parsed.stop, len(self.echo[k]),
                                 min_tokens=parsed.params.min_tokens,
                                 include_stop=parsed.include_stop) for k in range(total)]
        self.decode = decode
        self.want_logprobs = parsed.logprobs is not None
        self.keep = keep and self.want_logprobs
        self.entries: list[list[TokenLogprob]] = [[] for _ in range(total)]
        self.echoed = [not parsed.echo] * total
        self.finish: list[str | None] = [None] * total
        self.stop_reason: list[str | int | None] = [None] * total
        self.tokens = [0] * total
        self.prompt_tokens = [0] * len(streams)
        self.stop_ids = frozenset(parsed.params.stop_token_ids)
        # a sample that ends on one of these leaves its text out (vLLM's stop_terminated),
        # unless include_stop_str_in_output
        self.mute_ids = frozenset() if parsed.include_stop else self.stop_ids | set(eos_ids)
        self.pending: dict[asyncio.Future, int] = {}
        self.error: str | None = None
        self.seen = [False] * len(streams)

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.finish)

    def text(self, k: int) -> str:
        """Choice ``k``'s whole text so far (echoed prompt included)."""
        return self.echo[k] + self.texts[k].text

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, float]] | None,
                  offsets: list[int], before: list[int]) -> list[TokenLogprob]:
        """Entries of new tokens; ``before``: the sample's tokens before them (context)."""
        if lps is None or len(lps) != len(token_ids):
            raise RuntimeError(f"the engine returned {0 if lps is None else len(lps)} logprob "
                               f"entries for {len(token_ids)} tokens")
        seq = [*before, *token_ids]
        return [TokenLogprob(t, top[t], top, off, tuple(seq[max(0, j - 4):j]))
                for j, t, top, off in zip(range(len(before), len(seq)), token_ids, lps,
                                          offsets, strict=True)]

    def _prompt_entries(self, s: int) -> list[TokenLogprob]:
        """The echoed prompt's entries (first token: no logprob), offsets into its decoded
        text; RuntimeError if the engine sent no prompt logprobs."""
        lps, ids = self.prompt_lps[s], self.prompt_ids[s]
        if lps is None or len(lps) != len(ids):
            raise RuntimeError("the engine returned no prompt logprobs for an echo request")
        detok, decoded, out = IncrementalDetokenizer(self.decode), 0, []
        for j, (t, top) in enumerate(zip(ids, lps, strict=True)):
            out.append(TokenLogprob(t, None if top is None else top[t], top, decoded,
                                    tuple(ids[max(0, j - 4):j])))
            decoded += len(detok.push([t]))
        return out

    def _apply(self, s: int, delta: StreamDelta) -> list[Event]:
        self.seen[s] = True
        self.prompt_tokens[s] = delta.num_prompt_tokens
        self.error = self.error or delta.error
        if delta.prompt_logprobs is not None:
            self.prompt_lps[s] = delta.prompt_logprobs
        events = []
        for c in delta.choices:
            k = s * self.n + c.index
            if self.finish[k] is not None:
                continue                        # ended by a stop string: the rest is dropped
            ts = self.texts[k]
            ids, lps = ([], [] if c.logprobs is not None else None) if self.echo_only \
                else (c.token_ids, c.logprobs)
            self.tokens[k] += len(ids)
            offsets: list[int] | None = [] if self.want_logprobs else None
            before = list(ts.context)
            mute = c.finish_reason == "stop" and bool(ids) and ids[-1] in self.mute_ids
            text = ts.push(ids, offsets, mute_last=mute)
            entries = None if offsets is None else self._logprobs(ids, lps, offsets, before)
            reason = "stop" if ts.stopped else None
            if reason is None and c.finish_reason is not None:
                text += ts.finish()
                reason = "stop" if ts.stopped else c.finish_reason
                if not ts.stopped and reason == "stop" and ts.context \
                        and ts.context[-1] in self.stop_ids:
                    self.stop_reason[k] = ts.context[-1]     # vLLM: the stop token's id
            if ts.stopped:
                self.stop_reason[k] = ts.stop_reason
            self.finish[k] = reason
            first = not self.echoed[k]
            if first:
                text, self.echoed[k] = self.echo[k] + text, True
                if entries is not None and self.echo_logprobs:
                    entries = self._prompt_entries(s) + entries
            if self.keep and entries:
                self.entries[k].extend(entries)
            if text or reason is not None or entries or first:
                events.append(Event(k, text, reason, entries))
        stream = self.streams[s]
        if not stream.finished and all(self.finish[s * self.n + j] is not None
                                       for j in range(self.n)):
            stream.close({j: "stop" for j in range(self.n)})   # every sample hit a stop string
        return events

    async def next(self, gone: asyncio.Future | None = None) -> list[Event] | None:
        """Events of the next delta(s) to arrive; None if ``gone`` finished first."""
        armed = set(self.pending.values())
        for s, stream in enumerate(self.streams):
            if not stream.finished and s not in armed:
                self.pending[asyncio.ensure_future(stream.next())] = s
        if not self.pending:
            return []
        waits = set(self.pending) | ({gone} if gone is not None else set())
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        events: list[Event] = []
        got = False
        for fut in done:
            if fut is gone:
                continue
            got = True
            events += self._apply(self.pending.pop(fut), fut.result())
        return events if got else None

    async def first(self, gone: asyncio.Future) -> list[Event] | None:
        """Events until every request delivered once (an admission reject shows then)."""
        events: list[Event] = []
        while not all(self.seen) and not self.done:
            got = await self.next(gone)
            if got is None:
                return None
            events += got
        return events

    def close(self) -> None:
        for fut in self.pending:
            fut.cancel()
        self.pending.clear()
        for s, stream in enumerate(self.streams):
            stream.close({j: "stop" for j in range(self.n)
                          if self.finish[s * self.n + j] == "stop"})

    def usage(self) -> dict[str, Any]:
        prompt, gen = sum(self.prompt_tokens), sum(self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}
