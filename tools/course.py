"""The nbgrader course: one assignment per chapter, built from the chapters' exercise cells.

    python tools/course.py [--out course] [--chapters 03 04]   # writes OUT/source/, answer key
    cd course && nbgrader generate_assignment 04-prefix-reuse    # the student version

For each chapter ``notebooks/NN-topic.md`` this writes the instructor source
``OUT/source/NN-topic/NN-topic.ipynb``. Every exercise of the chapter's Exercises section
becomes nbgrader cells:

* an exercise cell that calls ``try_check(check_X, a, b)`` becomes an **answer cell** (the
  student's code, unlocked, ``solution``) holding the exercise cell without that call, then the
  worked solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``, ending with the
  assignments ``a = ...`` read off the solution's own ``check_X(...)`` call; and a locked
  **test cell** worth the exercise's points (★ 1, ★★ 2, ★★★ 3) that shows the same feedback
  (``try_check``) and, between ``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS``, calls
  ``check_X`` itself, so an unanswered or wrong exercise fails the cell and scores 0;
  when it also asks for reasoning (its entry in ``course/rubrics.md`` is marked
  ``autograded``), the written part is **graded by hand** (below), worth one point per
  criterion of that rubric;
* an exercise without a check (open-ended: a sketch, a critique, an explanation) is **graded
  by hand**, worth its points.

Graded by hand means two cells: the student's answer cell (markdown; or, when the chapter's
worked solution is code, a code cell whose solution region holds it), then a locked nbgrader
*task* cell that carries the points and holds the exercise's rubric from ``course/rubrics.md``
(model answer and criteria, plus the chapter's worked solution) between ``=== BEGIN MARK
SCHEME ===`` and ``=== END MARK SCHEME ===``. The student version has no mark scheme;
``autograde`` restores the locked cell, so the formgrader shows the rubric under the answer.

Cells outside the exercises are copied unchanged (solution cells elsewhere are dropped); outputs
are cleared. ``nbgrader generate_assignment`` then removes the solutions and hidden tests,
``nbgrader autograde`` scores submissions (``tests/test_nbgrader.py`` runs both). The worked
solutions, gathered per exercise, are also written to ``OUT/answer-key.md``.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from student import (  # noqa: E402
    SOLUTION_LABEL,
    chapter_sources,
    in_student_edition,
    is_solution,
)

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
BEGIN_MARKS, END_MARKS = "=== BEGIN MARK SCHEME ===", "=== END MARK SCHEME ==="
ANSWER_HERE = "YOUR ANSWER HERE"
_STATEMENT = re.compile(r"^(?:\*\*)?(\d+)\.\s", re.M)   # "**2. Derive (★★).**", "3. *(design…"
_EXERCISES = re.compile(r"^#+ .*Exercises", re.M)
_WORDS = {"easy": 1, "medium": 2, "hard": 3, "open": 3}


@dataclass
class Exercise:
    """One exercise of a chapter, as the course grades it."""

    number: int
    statement: str
    points: int
    check: str | None = None            # the check_* it calls (autograded), None: manual
    args: list[str] = field(default_factory=list)     # what the exercise passes to the check
    solution: str = ""                  # the worked solution (the chapter's hidden cell)
    mapped: bool = False                # the solution's check call gave every argument
    written_points: int = 0             # an autograded exercise's written part, by hand


def points_of(statement: str) -> int:
    """★ → 1, ★★ → 2, ★★★ → 3 (or easy / medium / hard, open-ended → 3); 1 if unmarked."""
    head = statement.strip().splitlines()[0] if statement.strip() else ""
    stars = head.count("★")
    if stars:
        return min(stars, 3)
    found = [v for w, v in _WORDS.items() if re.search(rf"\b{w}", head, re.I)]
    return max(found, default=1)


def _try_check_calls(tree: ast.Module) -> list[ast.stmt]:
    """Top-level statements of the form ``[_ =] try_check(check_X, ...)``."""
    found = []
    for stmt in tree.body:
        value = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id == "try_check" and value.args
                and isinstance(value.args[0], ast.Name)):
            found.append(stmt)
    return found


def _without(source: str, statements: list[ast.stmt]) -> str:
    lines = source.splitlines()
    for stmt in sorted(statements, key=lambda s: s.lineno, reverse=True):
        del lines[stmt.lineno - 1:stmt.end_lineno]
    return "\n".join(lines).strip("\n")


def _check_calls(tree: ast.Module, check: str) -> list[tuple[ast.stmt, ast.Call]]:
    """Top-level statements whose expression calls ``check`` (``print(check(...))`` too)."""
    found = []
    for stmt in tree.body:
        if not isinstance(stmt, (ast.Expr, ast.Assign)):
            continue
        calls = [n for n in ast.walk(stmt.value) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == check]
        if calls:
            found.append((stmt, calls[0]))
    return found


def solution_region(ex: Exercise, solution: str) -> str:
    """The solution's code without its own check calls, ending with the exercise's answer
    variables assigned from the arguments of the solution's last check call."""
    source = solution.replace(SOLUTION_LABEL, "", 1).strip("\n")
    tree = ast.parse(source)
    calls = _check_calls(tree, ex.check) if ex.check else []
    body = _without(source, [stmt for stmt, _ in calls]) if calls else source
    lines = [body] if body.strip() else []
    if calls:
        call = calls[-1][1]
        given = [ast.get_source_segment(source, a) for a in call.args]
        given += [ast.get_source_segment(source, k.value) for k in call.keywords]
        names_ok = all(name.isidentifier() for name in ex.args)
        if names_ok and any(isinstance(a, ast.Starred) for a in call.args):
            ex.mapped = True   # check(*answers): unpack in the same order
            lines.append(f"{', '.join(ex.args)} = ({', '.join(given)},)")
        elif len(given) == len(ex.args) and all(
                name.isidentifier() or name == value
                for name, value in zip(ex.args, given, strict=True)):
            ex.mapped = True
            lines += [f"{name} = {value}" for name, value in zip(ex.args, given, strict=True)
                      if name != value]
    return "\n".join(lines)


def _meta(grade_id: str, *, solution: bool, grade: bool, locked: bool, points: int = 0,
          task: bool = False) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
            "solution": solution, "task": task}
    if grade or task:
        meta["points"] = points
    return meta


def _hand_graded(exercise_id: str, part: str, points: int, rubric: str, answer: str = "", *,
                 code: bool = False) -> list:
    """The cells of an answer graded by hand, worth ``points``: where the student answers (a
    markdown cell, or a code cell whose solution region holds the instructor's ``answer``),
    then a locked nbgrader *task* cell (grade id ``<exercise_id>-<part>``) that carries the
    points and, between the mark-scheme markers, ``rubric`` (with the model answer).
    ``nbgrader generate_assignment`` removes the mark scheme from the student version;
    ``autograde`` puts the locked cell back as it was, so the formgrader shows the rubric right
    under the student's answer (and so does the feedback, once released)."""
    import nbformat

    if code:
        cell = nbformat.v4.new_code_cell(f"{BEGIN}\n{answer}\n{END}")
        cell.metadata["nbgrader"] = _meta(f"{exercise_id}-answer", solution=True, grade=False,
                                          locked=False)
    else:   # a plain cell: its text is the student's, and nothing of the instructor's is in it
        cell = nbformat.v4.new_markdown_cell(ANSWER_HERE)
    task = nbformat.v4.new_markdown_cell(
        f"**Graded by hand: {points} point{'s' * (points != 1)}.** Your answer goes in the cell "
        "above; the grader marks it against the course's rubric.\n\n"
        f"{BEGIN_MARKS}\n{rubric.strip()}\n{END_MARKS}")
    task.metadata["nbgrader"] = _meta(f"{exercise_id}-{part}", solution=False, grade=False,
                                      locked=True, points=points, task=True)
    return [cell, task]


@dataclass
class Rubric:
    """A rubric of ``course/rubrics.md``: its model answer, its criteria (a point each),
    whether it grades the written part of an autograded exercise, and its whole text (what
    graders read in the formgrader)."""

    model: str
    criteria: int
    written: bool
    text: str = ""


def _rubrics() -> dict[tuple[str, int], Rubric]:
    """The rubric file's entries, keyed by (chapter stem, exercise number)."""
    rubrics = ROOT / "course" / "rubrics.md"
    found: dict[tuple[str, int], Rubric] = {}
    if not rubrics.exists():
        return found
    pattern = re.compile(r"^## (\d\d-[\w-]+) #(\d+)\b(.*?)\n(.*?)(?=^## |\Z)", re.M | re.S)
    for stem, number, heading, body in pattern.findall(rubrics.read_text()):
        model = re.search(r"\*\*Model answer\.\*\*\s*(.*?)(?=\n\*\*|\Z)", body, re.S)
        found[(stem, int(number))] = Rubric(model.group(1).strip() if model else "",
                                            len(re.findall(r"^- 1 point", body, re.M)),
                                            "autograded" in heading,
                                            f"**Rubric: {stem} #{number}{heading}**\n\n"
                                            + body.strip())
    return found


def _as_markdown(answer: str, code: bool) -> str:
    return f"```python\n{answer}\n```" if code else answer


def _print_only(source: str) -> str | None:
    """The string a solution only prints (an explanation), or None if it does more."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
        call = tree.body[0].value
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id == "print" and len(call.args) == 1
                and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value,
                                                                          str)):
            return call.args[0].value
    return None


def instructor_notebook(source: Path):
    """The nbgrader instructor source of chapter ``source`` and its exercises."""
    import jupytext
    import nbformat

    nb = jupytext.read(source)
    # an assignment is a student's edition: text that holds only beside the worked solutions
    # is replaced as in `make student`
    nb.cells = [c for c in map(in_student_edition, nb.cells) if c is not None]
    start = next((i for i, c in enumerate(nb.cells)
                  if c.cell_type == "markdown" and _EXERCISES.search(c.source)), len(nb.cells))
    stem, rubrics = source.stem, _rubrics()
    cells, exercises = [], []
    statement, number, answered = "", 0, True

    def close_statement():
        # an exercise statement with no cell of its own: a manually graded written answer
        if not answered:
            ex = Exercise(number, statement, points_of(statement))
            exercises.append(ex)
            rubric = rubrics.get((stem, number))
            cells.extend(_manual(ex, rubric.model if rubric else "", code=False))

    def _manual(ex: Exercise, answer: str, code: bool) -> list:
        ex.solution = answer
        rubric = rubrics.get((stem, ex.number))
        marks = rubric.text if rubric else ""
        if answer and (rubric is None or answer.strip() != rubric.model):
            marks += f"\n\n**The chapter's worked solution.**\n\n{_as_markdown(answer, code)}"
        return _hand_graded(f"{stem}-ex{ex.number}", "task", ex.points, marks, answer,
                            code=code)

    i = 0
    while i < len(nb.cells):
        cell = nb.cells[i]
        cell.metadata.pop("jupyter", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if i < start:
            if not is_solution(cell):
                cells.append(cell)
            i += 1
            continue
        if cell.cell_type == "markdown":
            after = _EXERCISES.search(cell.source).end() if i == start else 0
            heads = list(_STATEMENT.finditer(cell.source, after))
            if not heads:
                cells.append(cell)
                i += 1
                continue
            close_statement()
            # several statements in one cell: every one but the last has no cell of its own,
            # so the cell is split and each of those gets its hand-graded answer cell
            bounds = [*(h.start() for h in heads[1:]), len(cell.source)]
            starts = [0, *bounds[:-1]]
            for k, (head, lo, hi) in enumerate(zip(heads, starts, bounds, strict=True)):
                piece = cell if len(heads) == 1 else nbformat.v4.new_markdown_cell(
                    cell.source[lo:hi].strip("\n"))
                cells.append(piece)
                statement = cell.source[head.start():hi]
                number, answered = int(head.group(1)), False
                if k < len(heads) - 1:
                    close_statement()
            i += 1
            continue
        following = nb.cells[i + 1] if i + 1 < len(nb.cells) else None
        tree = ast.parse(cell.source) if not is_solution(cell) else None
        calls = _try_check_calls(tree) if tree else []
        if calls:
            call = calls[-1].value
            ex = Exercise(number, statement, points_of(statement), check=call.args[0].id,
                          args=[ast.get_source_segment(cell.source, a) for a in call.args[1:]])
            solution = following.source if following is not None and is_solution(
                following) else ""
            ex.solution = solution.replace(SOLUTION_LABEL, "", 1).strip("\n")
            region = solution_region(ex, solution) if solution else ""
            answer = nbformat.v4.new_code_cell(
                _without(cell.source, calls) + f"\n\n{BEGIN}\n{region}\n{END}")
            gid = f"{stem}-ex{number}"
            answer.metadata["nbgrader"] = _meta(f"{gid}-answer", solution=True, grade=False,
                                                locked=False)
            feedback = "\n".join(ast.get_source_segment(cell.source, s) for s in calls)
            # assigned, so its message is no execute_result (nbgrader would read it as points)
            hidden = f"_ = {ex.check}({', '.join(ex.args)})"
            test = nbformat.v4.new_code_cell(
                f"from kvlab.exercises import {ex.check}\n"
                "from kvlab.exercises._common import try_check\n\n"
                f"{feedback}\n{BEGIN_HIDDEN}\n{hidden}  # raises unless the answer is right\n"
                f"{END_HIDDEN}")
            test.metadata["nbgrader"] = _meta(f"{gid}-test", solution=False, grade=True,
                                              locked=True, points=ex.points)
            cells += [answer, test]
            rubric = rubrics.get((stem, number))
            if rubric is not None and rubric.written:   # the reasoning it also asks for
                ex.written_points = rubric.criteria
                cells += _hand_graded(gid, "written", rubric.criteria, rubric.text)
            exercises.append(ex)
            answered = True
            i += 2 if solution else 1
            continue
        if is_solution(cell):
            if not answered:   # a worked solution without an exercise cell: graded by hand
                ex = Exercise(number, statement, points_of(statement))
                text = _print_only(cell.source.replace(SOLUTION_LABEL, "", 1))
                if text is not None:
                    cells += _manual(ex, text, code=False)
                else:
                    cells += _manual(ex, cell.source.replace(SOLUTION_LABEL, "", 1).strip("\n"),
                                     code=True)
                exercises.append(ex)
                answered = True
            i += 1
            continue
        cells.append(cell)   # setup code of an exercise (prints a listing, builds a case)
        i += 1
    close_statement()
    nb.cells = cells
    nb.metadata.pop("jupytext", None)
    return nb, exercises




def answer_key(chapters: list[tuple[Path, list[Exercise]]]) -> str:
    """The worked solutions and points of every exercise, as Markdown."""
    out = ["# kvlab answer key (instructor edition: do not hand out)", "",
           "Written by `tools/course.py` from the chapters' solution cells; the open-ended "
           "exercises' rubrics are in `rubrics.md`.", ""]
    for source, exercises in chapters:
        out += [f"## {source.stem}", ""]
        for ex in exercises:
            kind = f"autograded by `{ex.check}`" if ex.check else "graded by hand (rubric)"
            if ex.written_points:
                kind += f", and {ex.written_points} for the written part, by hand (rubric)"
            out += [f"### Exercise {ex.number} — {ex.points} point(s), {kind}", "",
                    ex.statement.strip(), ""]
            if ex.solution:
                out += ["```python", ex.solution.strip(), "```", ""]
            else:
                out += ["See `rubrics.md`.", ""]
    return "\n".join(out)


def write_course(out: Path, only: list[str] | None = None) -> list[tuple[Path, list[Exercise]]]:
    """Write ``out/source/<chapter>/<chapter>.ipynb`` and ``out/answer-key.md``, copy
    ``course/nbgrader_config.py`` into ``out`` and create the exchange folder it names
    (``out/exchange``, writable by every account); returns each chapter with its exercises."""
    import nbformat

    built = []
    for source in chapter_sources():
        if only and source.stem[:2] not in only:
            continue
        nb, exercises = instructor_notebook(source)
        if not exercises:
            continue
        folder = out / "source" / source.stem
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, folder / f"{source.stem}.ipynb")
        built.append((source, exercises))
    config = ROOT / "course" / "nbgrader_config.py"
    if (out / "nbgrader_config.py").resolve() != config:
        shutil.copy2(config, out / "nbgrader_config.py")
    (out / "answer-key.md").write_text(answer_key(built))
    exchange = out / "exchange"
    exchange.mkdir(exist_ok=True)
    exchange.chmod(0o777)   # students' accounts submit into it (nbgrader's docs: ugo+rwx)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "course")
    parser.add_argument("--chapters", nargs="*", help="two-digit chapter numbers (default all)")
    args = parser.parse_args(argv)
    for source, exercises in write_course(args.out, args.chapters):
        auto = [e for e in exercises if e.check]
        unmapped = [e.number for e in auto if not e.mapped]
        print(f"{source.stem}: {len(auto)} autograded ({sum(e.points for e in auto)} points), "
              f"{len(exercises) - len(auto)} by hand "
              f"({sum(e.points for e in exercises if not e.check)} points), written parts "
              f"{sum(e.written_points for e in auto)} points by hand"
              + (f"; solutions of {unmapped} do not give every answer" if unmapped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
