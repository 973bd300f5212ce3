"""The verifier's view of a request's grammar (structured outputs): masks along the drafts.

Speculation walks the grammar *ahead* of what is accepted: each draft token is pushed to learn
the mask of the next position, and once the step's masks are known everything pushed is popped
(:meth:`GrammarState.rollback`), so the state is back at the accepted prefix; the tokens the
verifier finally emits are then accepted for good. Draft and target rows use the same masks.
"""

from __future__ import annotations

import torch

from kvlab.engine.structured_outputs.bitmask import allocate_bitmask, unpack_bitmask

__all__ = ["GrammarCursor"]


class GrammarCursor:
    """Wraps a :class:`~kvlab.engine.structured_outputs.grammar.GrammarState`: ``allowed()``
    is the bool mask ``[V]`` of the next position (all True once the grammar terminated: the
    emitted tokens are cut at the stop token anyway), ``push(t)`` walks ahead, ``pop_all()``
    returns to the accepted prefix, ``commit(tokens)`` accepts the emitted tokens."""

    def __init__(self, state) -> None:
        self.state = state
        self.pushed = 0

    def allowed(self) -> torch.Tensor:
        vocab = self.state.vocab_size
        bitmask = allocate_bitmask(1, vocab)
        self.state.fill_bitmask(bitmask, 0)
        mask = unpack_bitmask(bitmask, vocab)[0].bool()
        return mask if bool(mask.any()) else torch.ones(vocab, dtype=torch.bool)

    def push(self, token: int) -> bool:
        ok = self.state.accept_token(int(token))
        self.pushed += ok
        return ok

    def pop_all(self) -> None:
        self.state.rollback(self.pushed)
        self.pushed = 0

    def commit(self, tokens: tuple[int, ...]) -> None:
        assert self.pushed == 0, "commit with drafts still pushed"
        for t in tokens:
            ok = self.state.accept_token(int(t))
            assert ok or self.state.is_terminated(), f"emitted token {t} outside the grammar"
