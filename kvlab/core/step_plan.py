"""StepPlan: the mutable accumulator of one scheduler step's decisions."""

from __future__ import annotations

from .scheduler_api import ScheduledChunk


class StepPlan:
    """Mutable accumulator of one step's decisions (budgets are enforced by ``add_chunk``)."""

    def __init__(self, token_budget: int, max_seqs: int) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.chunks: list[ScheduledChunk] = []
        self.copies: list[tuple[int, int]] = []
        self.preempted: list[str] = []
        self.admitted: list[str] = []
        self.used = 0
        self.scheduled: set[str] = set()

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.used

    @property
    def seqs_left(self) -> int:
        return self.max_seqs - len(self.chunks)

    def add_chunk(self, chunk: ScheduledChunk) -> None:
        if chunk.request_id in self.scheduled:
            raise AssertionError(f"{chunk.request_id} scheduled twice in one step")
        n = chunk.num_query_tokens
        if n <= 0 or n > self.tokens_left or self.seqs_left <= 0:
            raise AssertionError("a chunk would break the step's budgets")
        self.chunks.append(chunk)
        self.used += n
        self.scheduled.add(chunk.request_id)

    def replace_chunk(self, index: int, chunk: ScheduledChunk) -> None:
        """Swap chunk ``index`` for a larger version of itself (same request; lookahead added)."""
        old = self.chunks[index]
        extra = chunk.num_query_tokens - old.num_query_tokens
        if chunk.request_id != old.request_id or not 0 <= extra <= self.tokens_left:
            raise AssertionError("replace_chunk: another request, or beyond the token budget")
        self.chunks[index] = chunk
        self.used += extra
