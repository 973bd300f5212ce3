"""Chapter 12: the fault lab, its figures, and the exercise checks (which never print answers)."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.exercises import _common
from kvlab.exercises._common import NotYetAnswered
from kvlab.exercises.ch12 import (
    BUDGET_IMPLEMENTATIONS,
    BUGS,
    bug_source,
    check_budget_checker,
    check_bug_invariants,
    check_expected_crashes,
    run_budget,
)
from kvlab.labs.chaos.fault_lab import LAB_FAULTS, MUTATIONS, Mutation, run_lab


def new_session():
    """A fresh notebook session in a fresh folder: no prediction recorded."""
    _common._PREDICTIONS.clear()
    _common._PREDICTION_FILE.unlink(missing_ok=True)


def test_the_correct_engine_survives_every_lab_fault():
    for fault in LAB_FAULTS:
        trace = run_lab("correct", fault)
        assert trace.violation is None, fault
        assert trace.steps[-1].checks >= 9 * len(trace.steps)
        if fault != "none":
            assert trace.faults[fault] >= 1, fault
    assert set(run_lab("correct").finished) == {"a", "b", "c", "d", "e", "g"}   # f aborted


@pytest.mark.parametrize("name", [n for n in MUTATIONS if n != "correct"])
def test_every_mutant_is_caught_by_the_invariant_it_breaks(name):
    trace = run_lab(name, "none")
    assert trace.caught == MUTATIONS[name].breaks, str(trace.violation)
    assert trace.violation.step == trace.steps[-1].step       # the run stops where it broke


def test_lab_rejects_unknown_names_before_running():
    with pytest.raises(ValueError, match="unknown implementation"):
        run_lab("telepathic scheduler")
    with pytest.raises(ValueError, match="unknown lab fault"):
        run_lab("correct", "meteor")


def test_lab_figure_marks_the_violation_and_the_culprit_block():
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.viz.invariants import FaultLab, lab_figure

    fig = lab_figure("release skips a block", "none")
    assert "invariant 1 (refcount)" in fig._suptitle.get_text()
    fig = lab_figure("correct", "abort_storm", step=2)
    assert "all nine invariants held" in fig._suptitle.get_text()
    with pytest.raises(ValueError):
        FaultLab("no such thing")


def test_check_bug_invariants_grades_by_running_the_bugs():
    truth = {k: run_lab(m, "none").caught for k, m in BUGS.items()}
    assert all(truth.values())
    assert check_bug_invariants(truth).startswith("Correct")
    new_session()
    wrong = {k: (v % 9) + 1 for k, v in truth.items()}
    with pytest.raises(AssertionError) as info:
        check_bug_invariants(wrong)
    for v in truth.values():                  # the message never gives the answer away
        assert f": {v}" not in str(info.value) and f"{v}," not in str(info.value)
    new_session()
    # one bug wrong reads like all wrong: nothing names which bugs to try again
    one_wrong = {**truth, "A": (truth["A"] % 9) + 1}
    with pytest.raises(AssertionError) as one:
        check_bug_invariants(one_wrong)
    assert str(one.value) == str(info.value)
    assert not any(f"'{k}'" in str(one.value) for k in BUGS)
    # graded once: the right answer after a wrong prediction is not graded, and says nothing
    # about itself
    again = check_bug_invariants(truth)
    assert "not right" in again and "Correct" not in again
    assert str(one_wrong) in again           # the recorded prediction, not the new answer
    # a right answer locks nothing: a worked solution run first leaves the reader's turn
    new_session()
    assert check_bug_invariants(truth).startswith("Correct")
    with pytest.raises(AssertionError, match="not every bug"):
        check_bug_invariants(one_wrong)
    with pytest.raises(AssertionError, match="missing"):
        check_bug_invariants({"A": 1})
    with pytest.raises(AssertionError, match="from 1 to 9"):
        check_bug_invariants({k: 10 for k in BUGS})
    with pytest.raises(NotYetAnswered):
        check_bug_invariants(...)
    with pytest.raises(ValueError, match="unknown bug"):
        bug_source("Z")
    assert "def " in bug_source("C") or "class " in bug_source("C")


def test_check_fault_moves_catch_grades_the_first_prediction_only():
    from kvlab.exercises.ch12 import FAULT_MOVES, check_fault_moves_catch

    mutant, fault = FAULT_MOVES["implementation"], FAULT_MOVES["fault"]
    truth = run_lab(mutant, fault).caught
    assert truth is not None and truth != run_lab(mutant, "none").caught   # the fault moves it
    assert check_fault_moves_catch(truth).startswith("Correct")
    for wrong in range(1, 10):
        if wrong != truth:
            new_session()
            with pytest.raises(AssertionError, match="is not the first") as info:
                check_fault_moves_catch(wrong)
            assert str(truth) not in str(info.value).replace(f"invariant {wrong}", "")
    # the looping reader: after a wrong first prediction, every later answer reads the same
    replies = {check_fault_moves_catch(n) for n in range(1, 10) if n != wrong}
    assert len(replies) == 1 and "not right" in replies.pop()
    new_session()
    for bad in (0, 10, "3", True):            # a malformed answer is not recorded
        with pytest.raises(AssertionError, match="from 1 to 9"):
            check_fault_moves_catch(bad)
    with pytest.raises(NotYetAnswered):
        check_fault_moves_catch(...)
    assert check_fault_moves_catch(truth).startswith("Correct")


def test_lab_figure_has_a_legend_for_the_pool_colours():
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.viz.invariants import lab_figure

    fig = lab_figure("correct", "alloc_refusal", step=4)      # blocks withheld by the fault
    top = fig.axes[0]
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert "withheld by the fault" in labels and "free" in labels
    fig = lab_figure("release skips a block", "none")            # a culprit is outlined
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "culprit block" in labels


def _good(output, config):
    assert len(output.chunks) <= config.max_num_seqs
    assert sum(c.num_query_tokens for c in output.chunks) <= config.max_num_batched_tokens


def test_budget_checker_grading_rejects_false_alarms_and_misses():
    assert check_budget_checker(_good).startswith("Correct")
    for name in BUDGET_IMPLEMENTATIONS:
        fired = run_budget(_good, name)
        assert (fired is None) == name.startswith("correct"), name

    def silent(output, config):
        return None

    def strict(output, config):   # forgets that a full budget is allowed
        assert sum(c.num_query_tokens for c in output.chunks) < config.max_num_batched_tokens

    def crashes(output, config):
        raise KeyError("oops")

    def ignores_drafts(output, config):   # counts the chunks' own tokens, not their lookahead
        assert len(output.chunks) <= config.max_num_seqs
        assert sum(c.num_tokens for c in output.chunks) <= config.max_num_batched_tokens

    with pytest.raises(AssertionError, match="never fired"):
        check_budget_checker(silent)
    with pytest.raises(AssertionError, match="false alarm"):
        check_budget_checker(strict)
    with pytest.raises(AssertionError, match=r"mutant 3 .* never fired"):
        check_budget_checker(ignores_drafts)
    with pytest.raises(AssertionError, match="KeyError"):
        check_budget_checker(crashes)
    with pytest.raises(AssertionError, match="function"):
        check_budget_checker(42)


def test_a_custom_mutation_runs_in_the_lab():
    def leak(s):
        s.kv.free = lambda rid: False
    trace = run_lab(Mutation("a leak", 3, patch=leak))
    assert trace.caught in (3, 4)
    assert dataclasses.is_dataclass(trace.steps[0])


def test_chapter_restates_invariant_7_while_its_statement_overpromises():
    """Invariant 7's statement names RNG rollback, which no checker checks; the chapter says so
    and restates it. Once the statement says only what is checked, the note must go."""
    from pathlib import Path

    from kvlab.labs.invariants.spec_invariants import SPEC_INVARIANTS

    statement = next(inv.statement for inv in SPEC_INVARIANTS if inv.number == 7)
    chapter = (Path(__file__).parents[1] / "notebooks" / "12-invariants-faults.md").read_text()
    note = "Statement 7 promises more than its checker checks" in chapter
    assert note == ("RNG" in statement)
    # the statement now says what is checked: blocks within slack, and the engine's grammar probe
    assert "RNG" not in statement and "grammar probe" in statement


def test_expected_crashes_runs_the_readers_function_on_cases_it_does_not_show():
    from kvlab.exercises.ch12 import DERIVE, _crash_cases
    from kvlab.labs.faults.step_faults import STEP_FAULTS, StepFaultSchedule

    def right(steps, rate, kinds):
        crashing = sum(STEP_FAULTS[k] in ("update", "recover") for k in kinds)
        return steps * rate * crashing / len(kinds)

    # the sealed truths are what seeded schedules give on average, case by case
    for steps, rate, kinds in _crash_cases()[:3]:
        seeds = 1500
        mean = sum(sum(f.kind == "crash" for f in StepFaultSchedule.from_seed(
            s, steps, rate=rate, kinds=kinds).faults) for s in range(seeds)) / seeds
        assert mean == pytest.approx(right(steps, rate, kinds), rel=0.08, abs=0.05)
    assert check_expected_crashes(right).startswith("Right")
    wrong = {
        "only 'crash' counts": lambda steps, rate, kinds: steps * rate * ("crash" in kinds)
        / len(kinds),
        "every kind of STEP_FAULTS, whatever kinds says": lambda steps, rate, kinds: (
            steps * rate * 3 / len(STEP_FAULTS)),
        "DERIVE's number, hard-coded": lambda steps, rate, kinds: (
            DERIVE["steps"] * DERIVE["rate"] * 3 / 10),
        "twice for a damaged log": lambda steps, rate, kinds: steps * rate * sum(
            {"update": 1, "recover": 2}.get(STEP_FAULTS[k], 0) for k in kinds) / len(kinds),
    }
    verdicts = set()
    for name, fn in wrong.items():
        with pytest.raises(AssertionError, match="not the expected count") as err:
            check_expected_crashes(fn)
        verdicts.add(str(err.value))
        assert "too" not in str(err.value), name
    assert len(verdicts) == 1              # no case, no direction
    with pytest.raises(AssertionError, match="not a number"):
        check_expected_crashes(lambda steps, rate, kinds: "many")
    with pytest.raises(AssertionError, match="a function"):
        check_expected_crashes(9.0)
    with pytest.raises(NotYetAnswered):
        check_expected_crashes(...)
