"""Chapter 12 exercises: which invariant a bug breaks, which one catches a mutant once a fault
strikes, and a checker for a new invariant.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it by running the fault lab, :mod:`kvlab.labs.chaos.fault_lab`); the
checker exercise runs the reader's checker on the engine. Each raises ``AssertionError`` saying
what is wrong (which implementation, at which step) without printing the answer.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from kvlab.core.engine_core import EngineCore, StepObserver
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import SchedulerOutput
from kvlab.exercises._common import require_answer, sealed
from kvlab.labs.chaos.fault_lab import Mutation
from kvlab.labs.chaos.soak import ChaosExecutor


# ------------------------------------------------------------------ 1. which invariant
class OneMoreToken(ProductionScheduler):
    """Bug A: a request that ends by length gets its last token repeated once more."""

    def update_from_output(self, output, sampled):
        ended = super().update_from_output(output, sampled)
        for r in ended:
            if r.status.value == "finished" and len(r.output_token_ids) == r.max_tokens:
                r.output_token_ids.append(r.output_token_ids[-1])
        return ended


def share_drops_last(scheduler) -> None:
    """Bug B: sharing cached blocks with a request releases the last one right away."""
    pool = scheduler.kv.pool
    share = pool.share

    def buggy_share(blocks, owner):
        share(blocks, owner)
        if blocks:
            pool.release([list(blocks)[-1]], owner)
    pool.share = buggy_share


def free_is_a_no_op(scheduler) -> None:
    """Bug C: freeing a request's KV does nothing (the call returns as if nothing was held)."""
    scheduler.kv.free = lambda request_id: False


#: The bugs of exercise 1, by letter (not among the fault lab's mutants).
BUGS: dict[str, Mutation] = {
    "A": Mutation("bug A", 0, OneMoreToken),
    "B": Mutation("bug B", 0, patch=share_drops_last),
    "C": Mutation("bug C", 0, patch=free_is_a_no_op),
}


def bug_source(letter: str) -> str:
    """The code of bug ``letter``, to read."""
    if letter not in BUGS:
        raise ValueError(f"unknown bug {letter!r}; the bugs are {sorted(BUGS)}")
    m = BUGS[letter]
    return inspect.getsource(m.patch if m.patch is not None else m.scheduler_cls)


def check_bug_invariants(answer) -> str:
    """``answer``: ``{letter: invariant number 1..9}`` for every bug of :data:`BUGS`: the first
    invariant the checker reports when the fault lab runs that bug without a fault."""
    require_answer(answer, "a dict {bug letter: invariant number}")
    answer = dict(answer)
    missing = sorted(set(BUGS) - set(answer))
    if missing:
        raise AssertionError(f"give an invariant for every bug; missing {missing}")
    bad = sorted(k for k, v in answer.items() if not isinstance(v, int) or not 1 <= v <= 9)
    if bad:
        raise AssertionError(f"bugs {bad}: an invariant is a number from 1 to 9")
    # graded as a whole: naming the wrong bugs would let each be found by trying 1..9
    if not sealed("ch12.bug_invariants").is_answer({k: answer[k] for k in sorted(BUGS)}):
        raise AssertionError("not every bug is caught by the invariant you named: for each, "
                             "ask what state the bug leaves wrong, and which check looks at "
                             "that state first")
    return "Correct: every bug is caught, each by the invariant you named."


# ------------------------------------------------------------------ 2. a fault moves the catch
#: Exercise 2: the mutant and the fault whose cell the chapter's table leaves out.
FAULT_MOVES = {"implementation": "abort leaves it queued", "fault": "executor_error"}


def check_fault_moves_catch(invariant) -> str:
    """Exercise 2: the invariant (1..9) that first reports :data:`FAULT_MOVES`'s mutant when
    the fault lab runs it under that fault. Graded by running it; a wrong number is told only
    that it is not the first to report."""
    require_answer(invariant, "an invariant number from 1 to 9")
    if isinstance(invariant, bool) or not isinstance(invariant, int) or not 1 <= invariant <= 9:
        raise AssertionError(f"an invariant is a number from 1 to 9, got {invariant!r}")
    truth = sealed("ch12.fault_moves_catch")
    if not truth.is_answer(invariant):
        raise AssertionError(f"invariant {invariant} is not the first to report this run.")
    return (f"Correct: {truth.revealed(invariant)['violation']}. The fault changed how the "
            "bug showed itself, and another invariant caught it: the reason to check all nine "
            "on every step.")


# ------------------------------------------------------------------ 4. derive: how often it crashes
#: Exercise 4: a schedule ``StepFaultSchedule.from_seed(seed, DERIVE["steps"],
#: rate=DERIVE["rate"])`` over every kind of ``STEP_FAULTS`` (the soak's steps and rate).
DERIVE = {"steps": 200, "rate": 0.15}


def check_expected_crashes(answer) -> str:
    """Exercise 4: the expected number of ``crash`` records in a schedule drawn by
    ``StepFaultSchedule.from_seed`` with :data:`DERIVE`'s steps and rate (over seeds), within
    2 %. A wrong answer is told only its direction."""
    require_answer(answer, "the expected number of crash records")
    try:
        got = float(answer)
    except (TypeError, ValueError):
        raise AssertionError(f"give a number, got {answer!r}") from None
    if not got >= 0:
        raise AssertionError(f"an expected count is a number >= 0, got {answer!r}")
    truth = sealed("ch12.expected_crashes")
    way = truth.direction(got, tolerance=0.02 * truth.value())
    if way:
        raise AssertionError(f"{got:g} is {way}")
    return ("Right. Now compare it with the soak's recoveries per run (each seed ran twice), "
            "and say why a crash record need not become a recovery.")


# ------------------------------------------------------------------ 3. a new invariant
BUDGET = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=8,
                         num_lookahead_tokens=3)


def _over_tokens(config: SchedulerConfig) -> SchedulerConfig:
    return dataclasses.replace(config, max_num_batched_tokens=2 * config.max_num_batched_tokens)


def _over_seqs(config: SchedulerConfig) -> SchedulerConfig:
    return dataclasses.replace(config, max_num_seqs=3 * config.max_num_seqs)


class _FreeLookahead(ProductionScheduler):
    """Fills the step's token budget first, then grants draft slots on top of it."""

    def _schedule_into(self, plan) -> None:
        super()._schedule_into(plan)
        plan.token_budget += self.config.num_lookahead_tokens * self.config.max_num_seqs


#: The implementations the grader runs: the declared config, and what the scheduler really uses.
BUDGET_IMPLEMENTATIONS: dict[str, Callable[[SchedulerConfig], SchedulerConfig] | None] = {
    "correct": None, "correct, no speculation": None,
    "mutant 1": _over_tokens, "mutant 2": _over_seqs, "mutant 3": None,
}
#: The scheduler class each implementation runs (ProductionScheduler unless named here).
_BUDGET_SCHEDULERS: dict[str, type[ProductionScheduler]] = {"mutant 3": _FreeLookahead}


def run_budget(checker: Callable[[SchedulerOutput, SchedulerConfig], None],
               implementation: str, steps: int = 40) -> tuple[str, int] | None:
    """Run ``implementation`` with ``checker(output, declared_config)`` before every execute.
    Returns ``(error text, step)`` of the first ``AssertionError`` it raised, or None."""
    declared = BUDGET if implementation != "correct, no speculation" else \
        dataclasses.replace(BUDGET, num_lookahead_tokens=0)
    cls = _BUDGET_SCHEDULERS.get(implementation, ProductionScheduler)
    sched = cls(KVCacheManager(96, 4), declared)
    mutate = BUDGET_IMPLEMENTATIONS[implementation]
    if mutate is not None:
        sched.config = mutate(declared)          # the bug: the limits it really schedules by
    core = EngineCore(sched, ChaosExecutor(sched.get_request, "draft"), forget_ended=False)
    seen: list[tuple[str, int]] = []

    class Probe(StepObserver):
        def before_execute(self, c: Any, output: SchedulerOutput) -> None:
            if not seen:
                try:
                    checker(output, declared)
                except AssertionError as error:
                    seen.append((str(error), output.step))
    core.add_observer(Probe())
    for i in range(12):
        core.add_request(RuntimeRequest(f"r{i}", tuple(range(7 * i, 7 * i + 3 + i % 5)),
                                        6 + i % 4, scope=(("model", "lab"),)))
    for _ in range(steps):
        if not core.has_unfinished_requests():
            break
        core.step()
    return seen[0] if seen else None


def check_budget_checker(checker) -> str:
    """``checker(output, config)``: raise ``AssertionError`` when the step ``output`` breaks the
    batch budget of ``config`` (the invariant of exercise 3); return None otherwise. Graded by
    running it on the correct engine (it must never fire) and on mutated schedulers (it must
    fire on each)."""
    require_answer(checker, "a function checker(output, config)")
    if not callable(checker):
        raise AssertionError("pass a function checker(output, config)")
    for name in BUDGET_IMPLEMENTATIONS:
        try:
            fired = run_budget(checker, name)
        except Exception as error:
            raise AssertionError(f"your checker raised {type(error).__name__} (not an "
                                 f"AssertionError) on {name!r}: {error}") from None
        if name.startswith("correct") and fired is not None:
            raise AssertionError(f"false alarm: your checker fires on the {name} engine at step "
                                 f"{fired[1]}; count what the budget really limits")
        if not name.startswith("correct") and fired is None:
            raise AssertionError(f"{name} breaks the budget and your checker never fired")
    return ("Correct: no false alarm on the correct engine, and every mutant is caught.")
