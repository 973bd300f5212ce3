"""Spec rule 6 — continuous batching: the reference decode-first ``build_batch``.

Each decoding request needs one token per step; prefills may be chunked. The baseline serves
every decode first and fills what is left of the token budget with prefill chunks, in order.
It can starve a long prefill; the production scheduler (:mod:`kvlab.core.scheduler`) adds
admission, ageing, priorities, KV budgets, cache affinity and an overload policy.
"""

from __future__ import annotations

from kvlab.reference.rule05_request import Phase

__all__ = ["build_batch"]


def build_batch(requests, token_budget, max_sequences, prefill_chunk):
    """Return [(request_id, phase, scheduled_tokens)] within both budgets."""
    if min(token_budget, max_sequences, prefill_chunk) <= 0:
        raise ValueError("scheduler budgets must be positive")
    request_ids = [request.request_id for request in requests]
    if len(request_ids) != len(set(request_ids)):
        raise ValueError("request ids must be unique within a scheduling round")
    batch, used = [], 0
    decode = [r for r in requests if r.phase == Phase.DECODE]
    prefill = [r for r in requests if r.phase in {Phase.WAITING, Phase.PREFILL}]
    for request in decode + prefill:
        if len(batch) == max_sequences or used == token_budget:
            break
        tokens = 1 if request.phase == Phase.DECODE else min(
            request.prompt_left, prefill_chunk, token_budget - used
        )
        if tokens > 0 and used + tokens <= token_budget:
            batch.append((request.request_id, request.phase, tokens))
            used += tokens
    return batch
