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
  corrected or bonus token); :func:`~kvlab.core.engine_core.check_sampled` validates a
  step's answers and
  the scheduler applies them one by one (stopping at a stop token), then
  :meth:`~.kv_cache_manager.KVCacheManager.truncate` gives back the blocks past the accepted
  tokens. Rejected positions inside a kept block are stale slots that the next step overwrites;
  they are never committed to the prefix cache because commits cover computed tokens only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .block_pool import OutOfBlocks
from .request import RuntimeRequest, stop_reason

if TYPE_CHECKING:
    from .scheduler import SchedulerBase, StepPlan

__all__ = ["lookahead_limit", "plan_lookahead", "stop_cut"]


def lookahead_limit(request: RuntimeRequest, k: int) -> int:
    """Draft slots ``request`` may use now: ``min(k, max_kv_slots - num_tokens)`` (>= 0), so the
    accepted drafts plus one more token never exceed ``max_tokens`` or ``max_model_len``."""
    return max(0, min(k, request.max_kv_slots - request.num_tokens))


def plan_lookahead(scheduler: SchedulerBase, plan: StepPlan) -> int:
    """Give the decoding chunks of ``plan`` their lookahead slots (see the module docstring);
    the scheduler calls it when ``num_lookahead_tokens > 0``. Returns the slots granted."""
    k = scheduler.config.num_lookahead_tokens
    granted = 0
    if k <= 0:
        return 0
    for i, chunk in enumerate(plan.chunks):
        if not chunk.sample or chunk.num_tokens != 1 or plan.tokens_left <= 0:
            continue
        request = scheduler.get_request(chunk.request_id)
        if not request.is_decoding:
            continue
        n = min(lookahead_limit(request, k), plan.tokens_left)
        if n <= 0:
            continue
        start = chunk.start_pos
        try:
            copies = scheduler.kv.grow(chunk.request_id, start + 1 + n, write_from=start)
        except OutOfBlocks:
            continue                     # skip speculation for this request; preempt nobody
        plan.copies.extend(copies)
        kept, new = scheduler.kv.table_delta(chunk.request_id)   # what grow changed since
        kept = min(kept, chunk.num_kept_blocks)
        new = tuple(scheduler.kv.block_table(chunk.request_id)[kept:])
        plan.replace_chunk(i, replace(chunk, new_block_ids=new, num_kept_blocks=kept,
                                      num_lookahead=n))
        granted += n
    return granted


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
