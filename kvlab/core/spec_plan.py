"""Speculative decoding, the scheduler's half (torch-free): lookahead slots and multi-token results.

The engine core's step stays schedule → execute → update. With ``SchedulerConfig.
num_lookahead_tokens = k > 0`` the scheduler, after its policy has planned the step, offers every
decoding request up to ``k`` **lookahead** slots (:func:`plan_lookahead`): the executor proposes
that many draft tokens and verifies them in the same target forward, so the request contributes
up to ``k + 1`` query tokens. The rules:

* a request gets ``k_r = min(k, max_kv_slots - num_tokens, token budget left)`` slots: never a
  slot past what ``prompt + max_tokens`` (or ``max_model_len``) can use, so the admission
  reservation of :class:`~kvlab.core.production_scheduler.ProductionScheduler` still covers it;
* the slots come from ``kv.grow``; when the pool is short the request simply does not
  speculate this step (``k_r = 0``): lookahead never preempts anyone;
* the executor answers with a tuple of ``1 .. k_r + 1`` tokens (accepted drafts, then the
  corrected or bonus token); :func:`~kvlab.core.step_records.check_sampled` validates a
  step's answers and
  the scheduler applies them one by one (stopping at a stop token), then
  :meth:`~.kv_cache_manager.KVCacheManager.truncate` gives back the blocks past the accepted
  tokens. Rejected positions inside a kept block are stale slots that the next step overwrites;
  they are never committed to the prefix cache because commits cover computed tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.request import RuntimeRequest, stop_reason
from kvlab.core.step_records import ScheduledChunk

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheManager

__all__ = ["compose_deltas", "lookahead_limit", "plan_lookahead", "stop_cut"]


def lookahead_limit(request: RuntimeRequest, k: int) -> int:
    """Draft slots ``request`` may use now: ``min(k, max_kv_slots - num_tokens)`` (>= 0), so the
    accepted drafts plus one more token never exceed ``max_tokens`` or ``max_model_len``."""
    return max(0, min(k, request.max_kv_slots - request.num_tokens))


def plan_lookahead(chunks: Sequence[ScheduledChunk], tokens_left: int, k: int,
                   kv: KVCacheManager, get_request: Callable[[str], RuntimeRequest]
                   ) -> list[tuple[int, ScheduledChunk, list[tuple[int, int]]]]:
    """Lookahead slots for the decoding chunks of a planned step (see the module docstring):
    ``(index, the chunk with its slots, copy-on-write copies)`` for each chunk granted some,
    within ``tokens_left``. Grows those requests' tables in ``kv``."""
    granted = []
    for i, chunk in enumerate(chunks):
        if not chunk.sample or chunk.num_tokens != 1 or tokens_left <= 0:
            continue
        request = get_request(chunk.request_id)
        if not request.is_decoding:
            continue
        n = min(lookahead_limit(request, k), tokens_left)
        if n <= 0:
            continue
        start = chunk.start_pos
        try:
            copies = kv.grow(chunk.request_id, start + 1 + n, write_from=start)
        except OutOfBlocks:
            continue                     # skip speculation for this request; preempt nobody
        # the chunk's deltas, then what grow changed since, as one delta per table
        kept, new = compose_deltas((chunk.num_kept_blocks, chunk.new_block_ids),
                                   kv.table_delta(chunk.request_id))
        groups = tuple(compose_deltas(a, b) for a, b in zip(
            chunk.group_deltas, kv.group_deltas(chunk.request_id), strict=True))
        granted.append((i, replace(chunk, new_block_ids=new, num_kept_blocks=kept,
                                   group_deltas=groups, num_lookahead=n), copies))
        tokens_left -= n
    return granted


def compose_deltas(first: tuple[int, tuple[int, ...]], then: tuple[int, tuple[int, ...]]
                   ) -> tuple[int, tuple[int, ...]]:
    """The one ``(kept, new_block_ids)`` table delta that applying ``first`` and then ``then``
    (taken after ``first`` was sent) amounts to."""
    (kept1, new1), (kept2, new2) = first, then
    if kept2 <= kept1:
        return kept2, tuple(new2)
    return kept1, tuple(new1[:kept2 - kept1]) + tuple(new2)


def stop_cut(request: RuntimeRequest, tokens: tuple[int, ...]) -> int:
    """How many of ``tokens`` (about to be appended to ``request``) are kept: up to and
    including the first one that meets a stop condition (stop token, EOS, length)."""
    if not tokens:
        return 0
    probe = replace(request, output_token_ids=list(request.output_token_ids))
    for i, token in enumerate(tokens):
        probe.output_token_ids.append(token)
        if stop_reason(probe) is not None:
            return i + 1
    return len(tokens)
