"""Batched grammar masking of logits, and the executor's one hook, :func:`sample_with_grammars`.

A token bitmask is an int32 tensor ``[rows, ceil(V / 32)]``: bit ``t % 32`` of word ``t // 32``
set means token ``t`` is allowed (xgrammar's layout). Masking sets the logits of disallowed
tokens to ``-inf`` *in place*, before temperature, top-k, top-p and sampling, so every later
stage (greedy argmax, the random draw, the reported log-probabilities) sees only grammatical
tokens. Rows without a grammar are never touched: their tokens are exactly those of a batch
without constrained requests.

xgrammar is imported only when a batch holds a grammar row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvlab.engine.sampler import SampleResult, SamplerState, sample

__all__ = ["allocate_bitmask", "apply_bitmask", "apply_token_bitmask", "sample_with_grammars",
           "unpack_bitmask"]


class GrammarMask(Protocol):
    """What masking needs of a grammar state
    (:class:`~kvlab.engine.structured_outputs.grammar.GrammarState` is one)."""

    vocab_size: int

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None: ...
    def accept_token(self, token: int) -> bool: ...
    def is_terminated(self) -> bool: ...


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask ``[num_rows, ceil(vocab_size / 32)]`` with every token allowed."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool mask ``[rows, vocab_size]`` (True = allowed) of a packed bitmask."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


@torch.inference_mode()
def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """``logits[r, t] = -inf`` for every ``r`` in ``rows`` and token ``t`` whose bit is clear in
    ``bitmask[r]`` (same row indexing as ``logits``). ``bitmask`` may live on the CPU."""
    import xgrammar as xgr

    if not rows:
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=list(rows))


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int],
                        states: Sequence[GrammarMask]) -> None:
    """Mask ``logits[rows[j]]`` with ``states[j]``'s allowed next tokens, in place, batched (one
    bitmask, one masking call). Other rows are untouched. ValueError on mismatched lengths or a
    grammar compiled for another vocabulary width."""
    if len(rows) != len(states):
        raise ValueError(f"apply_token_bitmask: {len(rows)} rows for {len(states)} states")
    if not rows:
        return
    vocab = logits.shape[-1]
    if any(s.vocab_size != vocab for s in states):
        raise ValueError(f"apply_token_bitmask: a grammar compiled for another vocabulary than "
                         f"the logits' {vocab} tokens")
    bitmask = allocate_bitmask(logits.shape[0], vocab)
    for row, state in zip(rows, states, strict=True):
        state.fill_bitmask(bitmask, row)
    apply_bitmask(logits, bitmask, rows)


def sample_with_grammars(logits: torch.Tensor, states: Sequence[SamplerState],
                         sampler: Callable[[torch.Tensor, Sequence[SamplerState]], SampleResult]
                         = sample) -> SampleResult:
    """The executor's hook: mask the rows whose :class:`SamplerState` has a ``grammar``, sample
    every row with ``sampler``, and advance each grammar by its row's token.

    ``logits`` (``[S, V]``) is modified in place on grammar rows. Without grammar rows this is
    exactly ``sampler(logits, states)``. A masked row always samples an allowed token, so the
    grammar accepts it (asserted). A row whose grammar has ended (overlap scheduling planned
    one more step for a request its last token finished) is sampled unmasked and discarded.
    """
    rows = [i for i, s in enumerate(states)
            if s.grammar is not None and not s.grammar.is_terminated()]
    if rows:
        apply_token_bitmask(logits, rows, [states[i].grammar for i in rows])
    picked = sampler(logits, states)
    for i in rows:
        token = picked.token_ids[i]
        accepted = states[i].grammar.accept_token(token)
        assert accepted, f"row {i}: sampled token {token} outside its grammar's mask"
    return picked
