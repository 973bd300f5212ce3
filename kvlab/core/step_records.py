"""The records that cross the engine core's seams each step: what the scheduler decided
(:class:`SchedulerOutput` of :class:`ScheduledChunk`, with each new request's state sent once
as a :class:`NewRequest`) and what the executor answered (:class:`ModelOutput`, checked by
:func:`check_sampled`). Plain, torch-free data: nothing the executor needs reaches it any other
way, and it never reads the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """What the executor keeps of a request, sent once, in the step that first schedules it
    (vLLM's ``NewRequestData``): its tokens so far, how it samples (``sampling_params`` and
    ``seed``; None for executors without a sampler) and its stop conditions. Its table comes
    with its chunk, whole; after a preemption only the table is sent again."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    max_tokens: int
    max_model_len: int | None
    stop_token_ids: frozenset[int]
    eos_token_id: int | None
    ignore_eos: bool
    sampling_params: SamplingParams | None = None
    seed: int | None = None


@dataclass(frozen=True)
class ScheduledChunk:
    """Work for one request in one step: feed ``token_ids`` at positions ``start_pos...``.

    The table travels as a delta (vLLM v1's ``new_block_ids``): the first ``num_kept_blocks``
    entries of the table last sent, then ``new_block_ids``. ``sample``: its last logits give the
    next token. ``num_lookahead`` (:mod:`.spec_plan`): draft slots verified in the same forward.
    ``group_deltas``: a model with several KV cache groups (:mod:`.hybrid_kv_cache_manager`)
    has a table per group; the fields above are group 0's, these ``(num_kept_blocks,
    new_block_ids)`` the other groups' (empty with one group).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    new_block_ids: tuple[int, ...]
    sample: bool
    is_prefill: bool
    num_lookahead: int = 0
    num_kept_blocks: int = 0
    group_deltas: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_query_tokens(self) -> int:
        """Tokens this chunk may put through the forward: its own plus the lookahead."""
        return len(self.token_ids) + self.num_lookahead


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decisions; ``copies`` are (src_block, dst_block) KV copies to run first.
    ``new_requests``: the state of each request scheduled here for the first time;
    ``finished_ids``: requests that ended since the last output (the executor drops them)."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    copies: tuple[tuple[int, int], ...] = ()
    preempted: tuple[str, ...] = ()        # request ids preempted (KV released) this step:
                                           # their tables are gone (resent whole on resume)
    admitted: tuple[str, ...] = ()         # request ids given a KV table this step (first
                                           # admission, or re-admission after a preemption)
    rejected: tuple[str, ...] = ()         # request ids refused at admission this step
    num_batched_tokens: int = 0
    new_requests: tuple[NewRequest, ...] = ()
    finished_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def check_sampled(output: SchedulerOutput, sampled: Mapping[str, Any]
                  ) -> dict[str, tuple[int, ...]]:
    """``request id -> tokens`` of one step's executor answer: an int >= 0 for each chunk with
    ``sample=True`` (a tuple of 1..num_lookahead+1 with lookahead), nothing for the others.
    ValueError names the first problem."""
    expected = {c.request_id: c for c in output.chunks if c.sample}
    missing = set(expected) - set(sampled)
    extra = set(sampled) - set(expected)
    if missing:
        raise ValueError(f"no sampled token for {sorted(missing)}")
    if extra:
        raise ValueError(f"sampled tokens for requests that did not sample: {sorted(extra)}")
    tokens: dict[str, tuple[int, ...]] = {}
    for rid, chunk in expected.items():
        got = sampled[rid]
        seq = tuple(got) if isinstance(got, (tuple, list)) else (got,)
        if not 1 <= len(seq) <= chunk.num_lookahead + 1:
            raise ValueError(f"{rid!r}: {len(seq)} tokens for a chunk with "
                             f"{chunk.num_lookahead} lookahead slots")
        for token in seq:
            if type(token) is not int or token < 0:
                raise ValueError(f"sampled token for {rid!r} must be an int >= 0, got {token!r}")
        tokens[rid] = seq
    return tokens


@dataclass
class ModelOutput:
    """An executor's answer for one step. ``sampled``: request id -> its new tokens, for each
    chunk with ``sample=True`` (one; up to ``num_lookahead + 1`` when it speculated; a bare int
    is accepted for one). Per token, where the executor computes them: ``logprobs`` and
    ``top_logprobs`` (a dict, or None when not asked). ``drafts``: request id -> (drafts
    proposed, accepted). ``seconds`` on the executor's clock; ``info``: its own trace of the
    step (timings, metadata) for observers and figures."""

    sampled: Mapping[str, tuple[int, ...] | int]
    seconds: float = 0.0
    info: object = None
    logprobs: Mapping[str, list[float]] = field(default_factory=dict)
    top_logprobs: Mapping[str, list[dict[int, float] | None]] = field(default_factory=dict)
    drafts: Mapping[str, tuple[int, int]] = field(default_factory=dict)
