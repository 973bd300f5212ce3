"""Acceptance counters (vLLM's names) and a bounded per-step history for the chapter's widget."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["SpecDecodeMetrics", "SpecRecord"]


@dataclass(frozen=True)
class SpecRecord:
    """One request's verification in one step: drafts proposed, drafts accepted, and for the
    first rejected draft ``(index, token, p(x), q(x))``."""

    step: int
    request_id: str
    num_draft_tokens: int
    num_accepted: int
    rejected: tuple[int, int, float, float] | None


@dataclass
class SpecDecodeMetrics:
    """Counters since the engine started.

    ``num_drafts``: verifications with at least one draft token; ``num_draft_tokens`` /
    ``num_accepted_tokens``: drafts proposed / accepted; ``accepted_per_pos[i]``: drafts
    accepted at position ``i`` of their run (position ``i`` is accepted only if ``0..i-1``
    were). ``draft_time_s`` / ``target_time_s``: proposer and target-forward wall time.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    history: deque = field(default_factory=lambda: deque(maxlen=4096))

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def reset(self) -> None:
        """Zero every counter and the history (in place: the executor holds this object)."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_speculative_tokens
        self.draft_time_s = self.target_time_s = 0.0
        self.history.clear()

    def record(self, step: int, request_id: str, num_draft: int, num_accepted: int,
               rejected: tuple[int, int, float, float] | None) -> None:
        if num_draft:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft
            self.num_accepted_tokens += num_accepted
            for i in range(num_accepted):
                self.accepted_per_pos[i] += 1
        self.history.append(SpecRecord(step, request_id, num_draft, num_accepted, rejected))

    def as_dict(self) -> dict[str, object]:
        """The counters under vLLM's metric names."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification with drafts: accepted drafts + 1."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
