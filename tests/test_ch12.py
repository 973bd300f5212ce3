"""Chapter 12: the fault lab, its figures, and the exercise checks (which never print answers)."""

from __future__ import annotations

import dataclasses

import pytest

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
    wrong = {k: (v % 9) + 1 for k, v in truth.items()}
    with pytest.raises(AssertionError) as info:
        check_bug_invariants(wrong)
    for v in truth.values():                  # the message never gives the answer away
        assert f": {v}" not in str(info.value) and f"{v}," not in str(info.value)
    # one bug wrong reads like all wrong: nothing names which bugs to try again
    one_wrong = {**truth, "A": (truth["A"] % 9) + 1}
    with pytest.raises(AssertionError) as one:
        check_bug_invariants(one_wrong)
    assert str(one.value) == str(info.value)
    assert not any(f"'{k}'" in str(one.value) for k in BUGS)
    with pytest.raises(AssertionError, match="missing"):
        check_bug_invariants({"A": 1})
    with pytest.raises(AssertionError, match="from 1 to 9"):
        check_bug_invariants({k: 10 for k in BUGS})
    with pytest.raises(NotYetAnswered):
        check_bug_invariants(...)
    with pytest.raises(ValueError, match="unknown bug"):
        bug_source("Z")
    assert "def " in bug_source("C") or "class " in bug_source("C")


def test_check_fault_moves_catch_grades_by_running_the_lab():
    from kvlab.exercises.ch12 import FAULT_MOVES, check_fault_moves_catch

    mutant, fault = FAULT_MOVES["implementation"], FAULT_MOVES["fault"]
    truth = run_lab(mutant, fault).caught
    assert truth is not None and truth != run_lab(mutant, "none").caught   # the fault moves it
    assert check_fault_moves_catch(truth).startswith("Correct")
    for wrong in range(1, 10):
        if wrong != truth:
            with pytest.raises(AssertionError, match="is not the first") as info:
                check_fault_moves_catch(wrong)
            assert str(truth) not in str(info.value).replace(f"invariant {wrong}", "")
    for bad in (0, 10, "3", True):
        with pytest.raises(AssertionError, match="from 1 to 9"):
            check_fault_moves_catch(bad)
    with pytest.raises(NotYetAnswered):
        check_fault_moves_catch(...)


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


def test_expected_crashes_is_the_mean_of_seeded_schedules_and_gives_only_a_direction():
    from kvlab.exercises.ch12 import DERIVE
    from kvlab.labs.faults.step_faults import StepFaultSchedule

    seeds = 2000
    crashes = sum(sum(f.kind == "crash" for f in StepFaultSchedule.from_seed(
        s, DERIVE["steps"], rate=DERIVE["rate"]).faults) for s in range(seeds)) / seeds
    assert check_expected_crashes(crashes).startswith("Right")   # the sampled mean passes
    for factor, word in ((0.8, "low"), (1.25, "high")):
        with pytest.raises(AssertionError, match=f"too {word}") as err:
            check_expected_crashes(factor * crashes)
        assert f"{crashes:.0f}" not in str(err.value)
    # forgetting that a damaged-log fault brings its crash is wrong
    with pytest.raises(AssertionError, match="too low"):
        check_expected_crashes(DERIVE["steps"] * DERIVE["rate"] / 10)
    with pytest.raises(AssertionError, match="a number"):
        check_expected_crashes("many")
    with pytest.raises(AssertionError, match=">= 0"):
        check_expected_crashes(-1)
    with pytest.raises(NotYetAnswered):
        check_expected_crashes(...)
