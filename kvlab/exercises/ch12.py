"""Chapter 12 exercises: which invariant a bug breaks, which one catches a mutant once a fault
strikes, a checker for a new invariant, and how often a seeded schedule crashes.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it by running the fault lab, :mod:`kvlab.labs.chaos.fault_lab`). The two
predictions (exercises 1 and 2) have few possible answers, so each is graded once
(``_common.earlier_prediction``, recorded beside the notebook, so a kernel restart does not
clear it): the first wrong answer given is the prediction, and trying others after it learns
nothing; exercise 1's written part (the state each bug leaves wrong) is graded by hand.
The checker and the derivation are functions the check runs, on the
engine and on cases the reader does not see. Each raises ``AssertionError`` naming the concept
to revisit, never a direction or the answer.
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
from kvlab.exercises._common import earlier_prediction, graded_once, require_answer, sealed
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
    invariant the checker reports when the fault lab runs that bug without a fault. A
    prediction, graded as a whole and once."""
    require_answer(answer, "a dict {bug letter: invariant number}")
    answer = dict(answer)
    missing = sorted(set(BUGS) - set(answer))
    if missing:
        raise AssertionError(f"give an invariant for every bug; missing {missing}")
    bad = sorted(k for k, v in answer.items() if not isinstance(v, int) or not 1 <= v <= 9)
    if bad:
        raise AssertionError(f"bugs {bad}: an invariant is a number from 1 to 9")
    answer = {k: answer[k] for k in sorted(BUGS)}
    # graded as a whole (naming the wrong bugs would let each be found by trying 1..9), and
    # once: the first answer is the prediction
    right = sealed("ch12.bug_invariants").is_answer(answer)
    earlier = earlier_prediction("ch12.bug_invariants", answer, right)
    if earlier is not None:
        return graded_once(earlier)
    if not right:
        raise AssertionError("not every bug is caught by the invariant you named: for each, "
                             "ask what state the bug leaves wrong, and which check looks at "
                             "that state first; now run each bug in the fault lab and see")
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
    right = truth.is_answer(invariant)
    earlier = earlier_prediction("ch12.fault_moves_catch", invariant, right)
    if earlier is not None:
        return graded_once(earlier)
    if not right:
        raise AssertionError(f"invariant {invariant} is not the first to report this run: "
                             "revisit what the fault does to the requests running when it "
                             "strikes, then read the trace")
    return (f"Correct: {truth.revealed(invariant)['violation']}. The fault changed how the "
            "bug showed itself, and another invariant caught it: the reason to check all nine "
            "on every step.")


# ------------------------------------------------------------------ 4. derive: how often it crashes
#: Exercise 4: a schedule ``StepFaultSchedule.from_seed(seed, DERIVE["steps"],
#: rate=DERIVE["rate"])`` over every kind of ``STEP_FAULTS`` (the soak's steps and rate).
DERIVE = {"steps": 200, "rate": 0.15}
#: The cases the check runs the reader's function on, besides :data:`DERIVE` with every kind:
#: ``(steps, rate, kinds)``. Their expected values are sealed, not stated.
CRASH_CASES = (
    (50, 0.2, ("crash", "alloc_refusal")),
    (120, 0.05, ("executor_error", "late_copy", "kv_shrink")),
    (300, 0.3, ("corrupt_log", "truncated_log", "abort_storm", "spec_reject_all")),
    (80, 1.0, ("crash", "corrupt_log", "sampling_error", "kv_shrink", "alloc_refusal")),
    (1000, 0.01, ("truncated_log",)),
)


def _crash_cases() -> list[tuple[int, float, tuple[str, ...]]]:
    from kvlab.labs.faults.step_faults import STEP_FAULTS

    return [(DERIVE["steps"], DERIVE["rate"], tuple(STEP_FAULTS)), *CRASH_CASES]


def check_expected_crashes(expected_crash_records) -> str:
    """Exercise 4: ``expected_crash_records(steps, rate, kinds)``, the mean number of ``crash``
    records in ``StepFaultSchedule.from_seed(seed, steps, rate=rate, kinds=kinds)`` over seeds
    (``kinds``: distinct kinds of ``STEP_FAULTS``). The check runs it on :data:`DERIVE` with
    every kind and on cases it does not show, each within 0.1 %; a wrong value is told which
    concept to revisit, never its direction or the case."""
    require_answer(expected_crash_records, "a function expected_crash_records(steps, rate, kinds)")
    if not callable(expected_crash_records):
        raise AssertionError("pass a function expected_crash_records(steps, rate, kinds)")
    for i, (steps, rate, kinds) in enumerate(_crash_cases()):
        truth = sealed(f"ch12.expected_crashes.{i}").value()
        got = expected_crash_records(steps, rate, kinds)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"your function returned {got!r}, not a number") from None
        if not abs(got - truth) <= 1e-3 * max(truth, 1e-9):
            raise AssertionError("not the expected count on every case: revisit how from_seed "
                                 "draws one step (whether it has a fault, which kind) and which "
                                 "kinds leave a crash record; linearity of expectation does the "
                                 "rest")
    return ("Right on every case. Now compare DERIVE's value with the soak's recoveries per run "
            "(each seed ran twice), and say why a crash record need not become a recovery.")


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
