"""The exercises' sealed answers: they match what the instructor edition computes with kvlab
(``course/answers.py``), a check accepts exactly the truth, and no answer can be read from the
student-facing modules."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import seal_answers  # noqa: E402

from kvlab.exercises._common import Sealed, canonical, seal, sealed  # noqa: E402


@pytest.fixture(scope="module")
def truths():
    return seal_answers.compute()     # every truth, from the instructor code, once


def test_the_committed_seals_are_what_kvlab_computes_now(truths):
    # regenerates every truth from the instructor code: a change in kvlab or in an exercise's
    # stated assumptions that moves an answer fails here until the seals are rewritten
    committed = seal_answers.SEALED_FILE.read_text()
    assert seal_answers.drifted(seal_answers.render(truths), committed) == []


def test_drift_is_named_by_key(truths):
    text = seal_answers.render(truths)
    key = "ch01.mixed_pool"
    table = json.loads(text)
    stale = seal(key, 1, number=1.0)
    forged = json.dumps({**table, key: [stale.salt, stale.digest, stale.number, None, None]})
    assert seal_answers.drifted(text, forged) == [key]
    assert seal_answers.drifted(text, json.dumps({k: v for k, v in table.items()
                                                  if k != key})) == [key]


def test_every_seal_opens_with_its_truth_and_no_neighbour(truths):
    for key, t in truths.items():
        s = sealed(key)
        assert s.is_answer(t.answer), key
        if isinstance(t.answer, (int, float)) and not isinstance(t.answer, bool):
            assert not s.is_answer(t.answer + 1) and not s.is_answer(t.answer - 1), key
        if t.number is not None:
            assert s.value() == t.number and s.direction(t.number) is None, key
            assert s.direction(t.number + 1) == "too high", key
            assert s.direction(t.number - 1) == "too low", key
        if t.reveal:
            assert s.revealed(t.answer) == t.reveal, key
        for option, text in t.notes.items():
            assert s.note(option) == text, (key, option)
        if t.notes:       # a choice question has a verdict for the right option too
            assert t.answer in t.notes, key


def test_no_answer_is_written_in_the_student_facing_modules(truths):
    # a casual read (or check_...??) of the chapter's exercise module and of the sealed file
    # shows no truth (another chapter's module may hold the same number for its own reasons)
    exercises = ROOT / "kvlab" / "exercises"
    sealed_text = (exercises / "sealed_answers.json").read_text()
    for key, t in truths.items():
        text = (exercises / f"{key.split('.')[0]}.py").read_text() + sealed_text
        # a tuple of options an exercise offers ((128, 256, 512, ...)) holds the answer too,
        # and a comment may name a setting of another exercise
        text = re.sub(r"\((?:\s*[\d_.]+\s*,)+\s*[\d_.]*\s*\)", "(options)", text)
        text = re.sub(r"#.*", "", text)
        if isinstance(t.answer, (int, float)) and abs(t.answer) >= 100:
            for shown in {f"{t.answer}", f"{t.answer:,}", f"{t.answer:_}"}:
                assert not re.search(rf"(?<![\w.]){re.escape(shown)}(?![\w.])", text), (
                    key, shown)
        if isinstance(t.answer, str) and len(t.answer) > 3:
            assert repr(t.answer) not in text, key
        for note in t.notes.values():      # no option's verdict is written out either
            assert note[:40] not in text, (key, note)


def test_canonical_form_and_the_reveal_lock():
    assert canonical((1, 2.0)) == canonical([1, 2]) == "[1,2]"
    assert canonical({"b": 1, "a": (2,)}) == '{"a":[2],"b":1}'
    with pytest.raises(TypeError, match="cannot seal"):
        canonical(object())
    with pytest.raises(TypeError, match="finite"):
        canonical(float("nan"))
    s = seal("test.key", ["x", 3], number=3.5, reveal={"runs": 12})
    assert s.is_answer(("x", 3)) and not s.is_answer(["x", 4]) and not s.is_answer(object())
    assert s.revealed(["x", 3]) == {"runs": 12}
    with pytest.raises(ValueError, match="only the right answer"):
        s.revealed(["x", 4])
    assert s.direction(3.4, tolerance=0.2) is None and s.direction(3.0) == "too low"
    assert Sealed("k", s.salt, s.digest).reveal is None
    choice = seal("test.choice", "b", notes={"a": "(a) fails: no.", "b": "Correct: (b)."})
    assert choice.note("a") == "(a) fails: no." and choice.note("b") == "Correct: (b)."
    assert choice.note("c") is None and choice.note(object()) is None
    assert "no." not in repr(choice) and "(b)" not in repr(choice)


def test_a_missing_seal_names_the_command():
    with pytest.raises(KeyError, match=r"seal_answers\.py --write"):
        sealed("ch99.nothing")


def test_checks_grade_through_the_seals():
    ch01 = importlib.import_module("kvlab.exercises.ch01")
    source = Path(ch01.__file__).read_text()
    for name in ("check_kv_bytes_per_token", "check_mixed_pool"):
        body = source.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
        assert "plan_capacity" not in body and "RooflineCostModel" not in body, name


def test_a_recorded_prediction_survives_a_kernel_restart():
    """The first wrong prediction is kept in the record's file, so restarting the kernel (a
    fresh ``_PREDICTIONS``) does not give the reader another try; a right one locks nothing."""
    from kvlab.exercises import _common
    from kvlab.exercises._common import earlier_prediction

    assert not hasattr(_common, "forget_predictions")      # nothing public clears the record
    assert earlier_prediction("test.key", 7, right=True) is None     # locks nothing
    assert earlier_prediction("test.key", (1, 2), right=False) is None
    assert _common._PREDICTION_FILE.is_file()
    _common._PREDICTIONS.clear()                            # the kernel restarts
    assert earlier_prediction("test.key", 3, right=False) == [1, 2]
    assert earlier_prediction("test.key", [1, 2], right=False) is None    # the same answer
    _common._PREDICTION_FILE.write_text("not json")         # a damaged record is ignored
    _common._PREDICTIONS.clear()
    assert earlier_prediction("test.other", 1, right=False) is None
