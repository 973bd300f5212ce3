"""Stop strings of the engine's own outputs (``SamplingParams.stop``), off the default path.

The output processor makes a :class:`StopStrings` when the first request with stop strings is
added. After each step, before the step's outputs are built, :meth:`StopStrings.end_matched`
feeds every such sample's new tokens to its :class:`~kvlab.engine.detokenizer.TextStream`
(incremental detokenization, a stop string matched across token boundaries, the match
excluded) and aborts a sample whose text matched in the engine core, which frees its KV at
once. Its output then ends with ``finish_reason="stop"``, ``stop_reason`` the string, the text
before the match and every token up to the one that completed it. vLLM does the same in its
output processor (``OutputProcessor.process_outputs`` in ``vllm/v1/engine/output_processor.py``,
v0.32.0: the detokenizer's ``update`` returns the stop string, the request is aborted in the
core). One difference: with speculative decoding, tokens accepted in the same step after the
one that completed the match stay in ``token_ids`` (the text is cut all the same); vLLM trims
them (``_trim_surplus_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kvlab.core.engine_core import StepResult
from kvlab.core.request import RuntimeRequest
from kvlab.engine.detokenizer import TextStream

__all__ = ["StopStrings"]


class StopStrings:
    """The text streams of the samples whose requests have stop strings (``decode``: the
    tokenizer's)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.streams: dict[str, TextStream] = {}

    def add(self, seq_ids: Sequence[str], stop: tuple[str, ...], min_tokens: int = 0) -> None:
        """Follow ``seq_ids``' text; stop strings count only past ``min_tokens`` tokens."""
        for sid in seq_ids:
            self.streams[sid] = TextStream(self.decode, stop, min_tokens=min_tokens)

    def end_matched(self, result: StepResult,
                    abort: Callable[[str], RuntimeRequest | None]) -> StepResult:
        """``result`` with the samples whose text matched a stop string this step among its
        ended requests (``abort`` ends each in the core at once, between steps; with overlap
        scheduling the token a step in flight samples for it is discarded)."""
        ended = {r.request_id for r in result.ended}
        stopped = []
        for sid, tokens in result.model.sampled.items():
            stream = self.streams.get(sid)
            if stream is None or stream.stopped:
                continue
            stream.push(tokens)
            if stream.stopped and sid not in ended:
                request = abort(sid)
                assert request is not None, sid
                stopped.append(request)
        return replace(result, ended=[*result.ended, *stopped]) if stopped else result

    def ending(self, seq_id: str, reason: str | None) -> tuple[str | None, str | None, str | None]:
        """``(finish_reason, stop_reason, text)`` of a sample that has ended with ``reason``:
        ``"stop"``, the string and the text before it when a stop string matched, else
        ``reason`` and no override (the text is all tokens' and stays lazily decoded)."""
        stream = self.streams.get(seq_id)
        if stream is not None and reason is not None and stream.stopped:
            return "stop", stream.stop_reason, stream.text
        return reason, None, None

    def drop(self, seq_ids: Sequence[str]) -> None:
        """Forget the samples of a request that was reported finished or was dropped."""
        for sid in seq_ids:
            self.streams.pop(sid, None)
