"""A deterministic stand-in for a model, and a driver that runs a scheduler with it (no torch).

:func:`hash_token` makes the next token a function of *all* previous tokens, like a greedy
language model. So a request that is preempted and recomputed must produce exactly the tokens
it would have produced uninterrupted, and any scheduler bug that feeds a request the wrong
tokens (or the right tokens at the wrong positions) changes its output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.engine_core import EngineCore
from kvlab.core.request import RuntimeRequest
from kvlab.core.step_records import SchedulerOutput
from kvlab.sim.executor import CostModelExecutor

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
    check: Callable[[Any], None] | None = None,
    on_step: Callable[[SchedulerOutput], None] | None = None,
) -> DriveResult:
    """Run ``scheduler`` until nothing is left, on the engine's own loop
    (:class:`~kvlab.core.engine_core.EngineCore` with a zero-cost
    :class:`~kvlab.sim.executor.CostModelExecutor` producing ``token_fn``'s tokens).

    ``arrivals[s]`` / ``aborts[s]`` are added / aborted just before step ``s`` (1-based) is
    scheduled. ``check(scheduler)`` runs after every step (e.g.
    :func:`kvlab.labs.invariants.check_scheduler`). Ended requests stay in the
    scheduler's registry for inspection. RuntimeError if ``max_steps`` is exceeded.
    """
    arrivals = dict(arrivals or {})
    aborts = dict(aborts or {})
    core = EngineCore(scheduler, CostModelExecutor(scheduler.get_request, token_fn),
                      forget_ended=False)
    result = DriveResult()
    last = max([0, *arrivals, *aborts])
    step = 0
    while core.has_unfinished_requests() or step < last:
        step += 1
        if step > max_steps:
            raise RuntimeError(f"not done after {max_steps} steps")
        for request in arrivals.pop(step, []):
            core.add_request(request)
        for rid in aborts.pop(step, []):
            core.abort_request(rid)
        done = core.step()
        result.outputs.append(done.output)
        result.ended.append([r.request_id for r in done.ended])
        if on_step is not None:
            on_step(done.output)
        if check is not None:
            check(scheduler)
    return result
