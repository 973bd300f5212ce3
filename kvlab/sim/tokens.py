"""A deterministic stand-in for a model, and a loop that drives a scheduler with it (no torch).

:func:`hash_token` makes the next token a function of *all* previous tokens, like a greedy
language model. So a request that is preempted and recomputed must produce exactly the tokens
it would have produced uninterrupted, and any scheduler bug that feeds a request the wrong
tokens (or the right tokens at the wrong positions) changes its output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.scheduler_api import RuntimeRequest, SchedulerOutput

_MASK = (1 << 64) - 1


def hash_token(token_ids: Sequence[int], vocab_size: int = 1000, avoid: int | None = None) -> int:
    """Next token = a 64-bit FNV-1a-style hash of every previous token, mod ``vocab_size``.

    ``avoid`` (e.g. an EOS id) is never returned, so output lengths are set by ``max_tokens``.
    """
    if vocab_size < 2:
        raise ValueError("vocab_size must be >= 2")
    h = 0xCBF29CE484222325
    for t in token_ids:
        h = ((h ^ (t + 1)) * 0x100000001B3) & _MASK
    token = h % vocab_size
    if avoid is not None and token == avoid:
        token = (token + 1) % vocab_size
    return int(token)


TokenFn = Callable[[RuntimeRequest], int]


def greedy_tokens(request: RuntimeRequest) -> int:
    """The default token source: :func:`hash_token` of the request's tokens so far."""
    return hash_token(request.all_token_ids, avoid=request.eos_token_id)


@dataclass
class DriveResult:
    """What :func:`drive` saw: every step's output, and the requests that ended per step."""

    outputs: list[SchedulerOutput] = field(default_factory=list)
    ended: list[list[str]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.outputs)


def drive(
    scheduler: Any,
    token_fn: TokenFn = greedy_tokens,
    *,
    max_steps: int = 100_000,
    arrivals: dict[int, list[RuntimeRequest]] | None = None,
    aborts: dict[int, list[str]] | None = None,
    check: bool = False,
    forks: dict[str, list[RuntimeRequest]] | None = None,
    on_step: Callable[[SchedulerOutput], None] | None = None,
) -> DriveResult:
    """Run ``scheduler`` until nothing is left, playing the engine's part of each step.

    ``arrivals[s]`` / ``aborts[s]`` are added / aborted just before step ``s`` (1-based) is
    scheduled. Copies are completed at once (a metadata-only executor). ``forks[parent]`` are
    forked from ``parent`` (n > 1) at its first sampling chunk, as the engine does. ``check``
    runs ``check_invariants`` after every step. RuntimeError if ``max_steps`` is exceeded.
    """
    forks = {k: list(v) for k, v in (forks or {}).items()}
    arrivals = dict(arrivals or {})
    aborts = dict(aborts or {})
    result = DriveResult()
    last = max([0, *arrivals, *aborts])
    step = 0
    while scheduler.has_unfinished_requests() or step < last:
        step += 1
        if step > max_steps:
            raise RuntimeError(f"not done after {max_steps} steps")
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        for rid in aborts.pop(step, []):
            scheduler.abort_request(rid)
        out = scheduler.schedule()
        if out.copies:
            scheduler.kv.complete_copies(out.copies)
        sampled = {c.request_id: token_fn(scheduler.get_request(c.request_id))
                   for c in out.chunks if c.sample}
        for chunk in out.chunks:
            if chunk.sample and chunk.request_id in forks:
                for child in forks.pop(chunk.request_id):
                    scheduler.fork(chunk.request_id, child)
                    sampled[child.request_id] = token_fn(child)
        ended = scheduler.update_from_output(out, sampled)
        result.outputs.append(out)
        result.ended.append([r.request_id for r in ended])
        if on_step is not None:
            on_step(out)
        if check:
            scheduler.check_invariants()
    return result
