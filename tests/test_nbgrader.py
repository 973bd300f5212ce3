"""The nbgrader course (``tools/course.py``) drives real nbgrader: generate → submit → autograde.

Chapter 2 is built, released with nbgrader's ``generate_assignment`` and two submissions are
autograded with its ``autograde`` (nbgrader's API, as its command line calls it): alice answers
every exercise with the chapter's own worked solution, bob answers one exercise right, one wrong
and leaves the rest unanswered. The gradebook must give alice every point and bob exactly the
points of his right answer; the student version
must hold no solution, no hidden test and no output. Chapter 10 checks the answers graded by
hand (an answer cell, then a task cell whose mark scheme holds the rubric). Chapter 4 goes
through the teacher's workflow without JupyterHub on nbgrader's command line, with a student
carol: release, fetch, submit, collect, autograde, the formgrader's page, feedback. (A few
minutes: nbgrader executes each submission.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
AUTO = "02-page-tables"
MANUAL = "10-pd-disaggregation"
WORKFLOW = "04-prefix-reuse"   # two written parts graded by hand; runs in seconds
# bob's submission: one exercise right, one wrong (its answer one slot off), rest blank
RIGHT_FOR_BOB, WRONG_FOR_BOB = "check_slot_mapping", "check_tail_waste"
WRONG_EDIT = "waste_16 = waste_16 + 1"

# an exercise statement that asks for reasoning; SAY_IS_CHECKED: the "say" is what the check
# grades (a count, an invariant's number)
PROSE = re.compile(r"\b(?:say|explain|argue|why|Would)\b")
SAY_IS_CHECKED = {("05-request-lifecycle", 1), ("12-invariants-faults", 1)}

pytest.importorskip("nbgrader")
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")  # nbgrader internals


def _api(course: Path):
    """nbgrader's own API on ``course``, configured by the course's nbgrader_config.py."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    config.CourseDirectory.root = str(course)
    return NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)


def _ok(result: dict) -> None:
    assert result["success"], result.get("error", "") + result.get("log", "")


def _strip_markers(source: str) -> str:
    return "\n".join(line for line in source.splitlines()
                     if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    import course as builder

    root = tmp_path_factory.mktemp("course")
    built = dict((s.stem, ex) for s, ex in builder.write_course(root, ["02", "04", "10"]))
    # nbgrader runs the `alembic` script of its environment to create the gradebook
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    try:
        api = _api(root)
        _ok(api.generate_assignment(AUTO))
        _ok(api.generate_assignment(MANUAL))
        yield root, built, api
    finally:
        os.environ["PATH"] = path


def _notebook(root: Path, folder: str, name: str):
    return nbformat.read(root / folder / name / f"{name}.ipynb", as_version=4)


def test_source_marks_answers_tests_and_points(course):
    root, built, _ = course
    exercises = built[AUTO]
    assert [e.number for e in exercises] == list(range(1, len(exercises) + 1))
    assert all(e.check and e.mapped for e in exercises), "every answer comes from the solution"
    source = _notebook(root, "source", AUTO)
    graded = [c.metadata["nbgrader"] for c in source.cells if "nbgrader" in c.metadata]
    tests = [g for g in graded if g["grade"] and not g["solution"]]
    answers = [g for g in graded if g["solution"] and not g["grade"]]
    # reasoning, graded by hand: a locked task cell (its points, the rubric) under the answer
    written = [g for g in graded if g.get("task") and g["grade_id"].endswith("-written")]
    assert all(g["locked"] and not g["grade"] and not g["solution"] for g in written)
    assert len(tests) == len(answers) == len(exercises)
    assert all(g["locked"] and g["points"] > 0 for g in tests)
    assert [g["points"] for g in tests] == [e.points for e in exercises]
    assert [g["points"] for g in written] == [e.written_points for e in exercises
                                              if e.written_points]
    # no demo cell is graded: only the exercises' cells carry nbgrader metadata
    demo = [c for c in source.cells if "check_kv_manager(kv)" in c.source]
    assert all("nbgrader" not in c.metadata for c in demo)


def test_student_version_has_no_solution_hidden_test_or_output(course):
    root, built, _ = course

    release = _notebook(root, "release", AUTO)
    text = "\n".join(c.source for c in release.cells)
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
    assert "_ = check_" not in text, "the grading call is hidden from students"
    assert not any(c.get("outputs") for c in release.cells if c.cell_type == "code")
    for exercise in built[AUTO]:
        for line in exercise.solution.splitlines():
            line = line.strip()
            if len(line) > 12 and not line.startswith(("#", "print(", "from ", "import ")) \
                    and "= ..." not in line:
                assert line not in text, f"solution line leaked: {line}"
    # the feedback line stays, so a student sees right / wrong / not answered yet
    assert text.count("_ = try_check(check_") == len(built[AUTO])


def _graded_by_hand(nb, grade_id: str):
    """The (answer cell, task cell) of the answer graded by hand whose task is ``grade_id``."""
    at = next(i for i, c in enumerate(nb.cells)
              if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    return nb.cells[at - 1], nb.cells[at]


def test_open_ended_exercise_is_graded_by_hand_with_its_rubric_in_a_mark_scheme(course):
    """Chapter 10 #4 is open-ended: the student answers in a markdown cell; the locked task
    cell under it carries the points and, in nbgrader's mark-scheme region, the rubric of
    ``course/rubrics.md`` with its model answer, which the student version does not hold."""
    root, built, _ = course
    manual = [e for e in built[MANUAL] if not e.check]
    assert [e.number for e in manual] == [4] and manual[0].points == 3
    rubric = "Rubric: 10-pd-disaggregation #4"
    for folder in ("source", "release"):
        answer, task = _graded_by_hand(_notebook(root, folder, MANUAL), f"{MANUAL}-ex4-task")
        meta = task.metadata["nbgrader"]
        assert task.cell_type == "markdown" and meta["task"] and meta["locked"]
        assert meta["points"] == 3 and "Graded by hand: 3 points" in task.source
        assert answer.cell_type == "markdown" and answer.source == "YOUR ANSWER HERE"
        assert "nbgrader" not in answer.metadata     # the student's own cell
        held = folder == "source"
        assert (rubric in task.source) == held and ("MARK SCHEME" in task.source) == held
        assert ("installs blocks `0 … j-1`" in task.source) == held, "the model answer"


def test_reasoning_asked_by_an_autograded_exercise_is_graded_by_hand(course):
    """Chapter 10 #3 is autograded and also asks which crash point the student's order handles
    differently: the written part is graded by hand, a point per criterion of its rubric."""
    root, built, _ = course
    (ex,) = [e for e in built[MANUAL] if e.number == 3]
    assert ex.check and ex.written_points >= 1
    for folder in ("source", "release"):
        nb = _notebook(root, folder, MANUAL)
        ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]
        at = ids.index(f"{MANUAL}-ex3-written")
        assert ids[at - 2] == f"{MANUAL}-ex3-test"      # right after the exercise's test
        answer, task = nb.cells[at - 1], nb.cells[at]
        assert answer.source == "YOUR ANSWER HERE" and task.metadata["nbgrader"]["task"]
        assert task.metadata["nbgrader"]["points"] == ex.written_points
        assert ("crash" in task.source) == (folder == "source")


def test_autograde_scores_a_right_and_a_wrong_submission(course):
    from nbgrader.api import Gradebook

    root, built, api = course
    source, release = _notebook(root, "source", AUTO), _notebook(root, "release", AUTO)
    solutions = {c.metadata["nbgrader"]["grade_id"]: _strip_markers(c.source)
                 for c in source.cells if c.metadata.get("nbgrader", {}).get("solution")}
    number = {e.check: e.number for e in built[AUTO]}
    right, wrong = (f"{AUTO}-ex{number[c]}-answer" for c in (RIGHT_FOR_BOB, WRONG_FOR_BOB))
    submissions = {"alice": dict(solutions),
                   "bob": {right: solutions[right],
                           wrong: solutions[wrong] + f"\n{WRONG_EDIT}  # one off"}}
    for student, answers in submissions.items():
        nb = nbformat.from_dict(release)
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in answers:
                cell.source = answers[gid]
        folder = root / "submitted" / student / AUTO
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / f"{AUTO}.ipynb")
    for student in submissions:
        _ok(api.autograde(AUTO, student))

    points = {e.number: e.points for e in built[AUTO]}
    written = sum(e.written_points for e in built[AUTO])     # reasoning, graded by hand later
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        assert gb.find_assignment(AUTO).max_score == sum(points.values()) + written
        alice, bob = (gb.find_submission(AUTO, s) for s in ("alice", "bob"))
        assert alice.score == sum(points.values())
        assert bob.score == points[number[RIGHT_FOR_BOB]]
        bob_grades = {g.name: g.score for g in bob.notebooks[0].grades
                      if g.name.endswith("-test")}
        assert bob_grades == {f"{AUTO}-ex{n}-test": (p if n == number[RIGHT_FOR_BOB] else 0)
                              for n, p in points.items()}

    graded = _notebook(root / "autograded", "bob", AUTO)
    failed = next(c for c in graded.cells if c.metadata.get("nbgrader", {}).get("grade_id")
                  == f"{AUTO}-ex{number[WRONG_FOR_BOB]}-test")
    (error,) = [o for o in failed.outputs if o.output_type == "error"]
    assert error.ename == "WrongAnswer" and len(error.traceback) == 1
    assert "not right: revisit" in error.evalue and "too" not in error.evalue   # no direction
    # bob's unanswered exercises printed the hint first, then failed the hidden test
    left = min(set(number.values()) - {number[RIGHT_FOR_BOB], number[WRONG_FOR_BOB]})
    unanswered = next(c for c in graded.cells if c.metadata.get("nbgrader", {}).get("grade_id")
                      == f"{AUTO}-ex{left}-test")
    shown = "".join(o.get("text", "") for o in unanswered.outputs)
    assert "Not answered yet" in shown
    assert [o.ename for o in unanswered.outputs if o.output_type == "error"] == ["NotYetAnswered"]


def test_every_chapter_builds_an_assignment_without_grading_its_demo_cells():
    import student

    import course as builder

    demos = manual = 0
    for source in student.chapter_sources()[1:]:
        nb, exercises = builder.instructor_notebook(source)
        assert exercises, f"{source.stem}: no exercise found"
        assert [e.number for e in exercises] == list(range(1, len(exercises) + 1)), source.stem
        unmapped = [e.number for e in exercises if e.check and not e.mapped]
        assert not unmapped, f"{source.stem}: solutions of {unmapped} do not give the answers"
        graded = [c for c in nb.cells if "nbgrader" in c.metadata]
        tests = [c for c in graded if not c.metadata["nbgrader"]["solution"]
                 and not c.metadata["nbgrader"]["task"]]
        assert len(tests) == sum(1 for e in exercises if e.check)
        assert all(c.metadata["nbgrader"]["locked"] and c.metadata["nbgrader"]["points"] > 0
                   for c in tests)
        assert not any(student.is_solution(c) for c in nb.cells)
        demo = [c for c in nb.cells if "check_kv_manager(kv)" in c.source]
        assert all("nbgrader" not in c.metadata for c in demo), source.stem
        demos += len(demo)
        manual += sum(1 for e in exercises if not e.check)
        for e in exercises:   # an autograded exercise that asks for prose has a cell for it
            prose = PROSE.search(" ".join(e.statement.split())) and e.check
            if prose and (source.stem, e.number) not in SAY_IS_CHECKED:
                assert e.written_points, f"{source.stem} #{e.number}: no written-answer cell"
        written = [c.metadata["nbgrader"] for c in graded
                   if c.metadata["nbgrader"]["grade_id"].endswith("-written")]
        tasks = [c for c in graded if c.metadata["nbgrader"]["task"]]
        assert len(tasks) == sum(1 for e in exercises if not e.check or e.written_points)
        assert all("=== BEGIN MARK SCHEME ===\n**Rubric: " in c.source for c in tasks), \
            f"{source.stem}: a task graded by hand without its rubric"
        assert [g["points"] for g in written] == [e.written_points for e in exercises
                                                  if e.written_points]
        by_hand = {e.number for e in exercises if not e.check}
        if source.stem.startswith(("10-", "11-")):
            assert 4 in by_hand, f"{source.stem} #4 is open-ended: graded by hand"
    assert demos >= 1 and manual >= 2


def test_rubrics_and_the_course_plan_follow_the_hand_graded_exercises():
    # the chapters' auditors renumber exercises: every hand-graded exercise of the course must
    # have its rubric (and the course plan must name it), and a rubric must not grade by hand
    # an exercise that is now autograded without saying so
    import re

    from student import chapter_sources

    from course import instructor_notebook

    by_hand = set()
    for source in chapter_sources():
        _, exercises = instructor_notebook(source)
        by_hand |= {(source.stem, e.number) for e in exercises if e.check is None}
    assert by_hand, "the course has open-ended exercises"
    rubrics = (ROOT / "course" / "rubrics.md").read_text()
    headings = {(stem, int(n)): rest for stem, n, rest in
                re.findall(r"^## (\d\d-[\w-]+) #(\d+)(.*)$", rubrics, re.M)}
    assert by_hand <= set(headings), f"no rubric for {sorted(by_hand - set(headings))}"
    stale = {k for k, rest in headings.items() if k not in by_hand and "autograded" not in rest}
    assert not stale, f"rubrics for exercises that are not graded by hand: {sorted(stale)}"
    plan = (ROOT / "notebooks" / "course-plan.md").read_text()
    named = re.search(r"open-ended ones \(([^)]*)\)", plan).group(1)
    listed = {(int(ch), int(n)) for ch, n in re.findall(r"chapter (\d+) #(\d+)", named)}
    assert listed == {(int(stem[:2]), n) for stem, n in by_hand}, named


def _nbgrader(*args: str, cwd: Path, home: Path) -> str:
    """``nbgrader ARGS`` as a teacher or a student types it, in ``cwd``; returns its log."""
    env = {**os.environ, "HOME": str(home),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"nbgrader {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def test_teacher_workflow_without_a_hub_on_one_machine(course, tmp_path):
    """course/README.md's workflow without JupyterHub, command for command: the teacher
    generates chapter 4's assignment and releases it into the exchange that nbgrader_config.py
    names; a student (carol, in her own folder) fetches it, answers, submits; the teacher
    collects, autogrades, grades the written answers in the formgrader (whose page shows each
    rubric under carol's answer), generates and releases feedback; carol fetches it."""
    from nbconvert.exporters import HTMLExporter
    from nbgrader.api import Gradebook
    from nbgrader.server_extensions.formgrader import handlers

    root, built, _ = course
    exchange = root / "exchange"
    assert (root / "nbgrader_config.py").read_text().count('c.Exchange.root = ') == 1
    assert exchange.is_dir() and exchange.stat().st_mode & 0o777 == 0o777
    teacher, carol = root, tmp_path / "carol"
    carol.mkdir()
    as_carol = ["--course", "kvlab", f"--Exchange.root={exchange}"]
    _nbgrader("generate_assignment", WORKFLOW, cwd=teacher, home=tmp_path)
    _nbgrader("release_assignment", WORKFLOW, cwd=teacher, home=tmp_path)
    assert WORKFLOW in _nbgrader("list", *as_carol, cwd=carol, home=carol)
    _nbgrader("fetch_assignment", WORKFLOW, *as_carol, cwd=carol, home=carol)

    # carol answers: the worked solutions where a check grades, her own words elsewhere
    path = carol / WORKFLOW / f"{WORKFLOW}.ipynb"
    nb = nbformat.read(path, as_version=4)
    source = _notebook(root, "source", WORKFLOW)
    solutions = {c.metadata["nbgrader"]["grade_id"]: _strip_markers(c.source)
                 for c in source.cells if c.metadata.get("nbgrader", {}).get("solution")}
    tasks = []
    for i, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade_id") in solutions:
            cell.source = solutions[meta["grade_id"]]
        if meta.get("task"):
            tasks.append(meta["grade_id"])
            nb.cells[i - 1].source = f"carol's answer for {meta['grade_id']}"
    nbformat.write(nb, path)
    _nbgrader("submit", WORKFLOW, *as_carol, "--student", "carol", cwd=carol, home=carol)

    assert "carol" in _nbgrader("collect", WORKFLOW, cwd=teacher, home=tmp_path)
    _nbgrader("autograde", WORKFLOW, "--create", cwd=teacher, home=tmp_path)
    auto = sum(e.points for e in built[WORKFLOW] if e.check)
    by_hand = {f"{WORKFLOW}-ex{e.number}-task": e.points for e in built[WORKFLOW] if not e.check}
    by_hand |= {f"{WORKFLOW}-ex{e.number}-written": e.written_points for e in built[WORKFLOW]
                if e.written_points}
    assert sorted(tasks) == sorted(by_hand) and len(tasks) == 2
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        submission = gb.find_submission(WORKFLOW, "carol")
        assert submission.score == auto and submission.needs_manual_grade
        assert submission.max_score == auto + sum(by_hand.values())

    # the formgrader's page of carol's submission, as its handler renders it
    graded = root / "autograded" / "carol" / WORKFLOW / f"{WORKFLOW}.ipynb"
    exporter = HTMLExporter(template_name="formgrade",
                            extra_template_basedirs=[handlers.template_path])
    html, _ = exporter.from_filename(str(graded), resources={
        "assignment_id": WORKFLOW, "notebook_id": WORKFLOW, "submission_id": "1", "index": 0,
        "total": 1, "base_url": "", "student": "carol", "last_name": None,
        "first_name": None, "notebook_path": str(graded)})
    for task in tasks:
        number = re.search(r"-ex(\d+)-", task).group(1)
        answer_at = html.index(f"carol's answer for {task}")
        rubric_at = html.index(f"Rubric: {WORKFLOW} #{number}")
        assert answer_at < rubric_at, "the rubric shows under the student's answer"

    # the grader gives the hand-graded points (the formgrader writes these same fields)
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for task, points in by_hand.items():
            gb.find_grade(task, WORKFLOW, WORKFLOW, "carol").manual_score = points - 1
        gb.db.commit()
        assert gb.find_submission(WORKFLOW, "carol").score == auto + sum(by_hand.values()) - 2
    _nbgrader("generate_feedback", WORKFLOW, cwd=teacher, home=tmp_path)
    _nbgrader("release_feedback", WORKFLOW, cwd=teacher, home=tmp_path)
    _nbgrader("fetch_feedback", WORKFLOW, *as_carol, "--student", "carol", cwd=carol, home=carol)
    (feedback,) = (carol / WORKFLOW / "feedback").glob(f"*/{WORKFLOW}.html")
    text = re.sub(r"<[^>]+>|\s+", " ", feedback.read_text())
    total = auto + sum(by_hand.values())
    assert f"{WORKFLOW} (Score: {float(total - 2)} / {float(total)})" in text
