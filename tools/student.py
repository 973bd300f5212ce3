"""The student edition: every chapter without its solution cells.

    python tools/student.py [--out student]

A solution cell is a code cell tagged ``solution`` or ``hide-cell`` (the chapter template puts
each exercise's worked solution in a collapsed ``hide-cell`` cell right after the exercise).
Each ``notebooks/NN-topic.md`` becomes ``OUT/NN-topic.ipynb`` with those cells removed and all
outputs cleared (a stored output could show an answer). Exercise cells keep their
``check_*()`` calls, which report "not answered yet" until the student fills them in. Every
exercise cell is marked in nbgrader's metadata format (``grade_id``, read-only off) so the
folder can seed an nbgrader assignment. ``tests/test_student.py`` executes the result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTION_TAGS = frozenset({"solution", "hide-cell"})


def is_solution(cell) -> bool:
    return cell.cell_type == "code" and bool(SOLUTION_TAGS & set(cell.metadata.get("tags", [])))


def student_notebook(source: Path):
    """The student notebook of chapter ``source`` (a ``.md``): solutions out, outputs cleared."""
    import jupytext

    nb = jupytext.read(source)
    kept = []
    for index, cell in enumerate(nb.cells):
        if is_solution(cell):
            continue
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if "check_" in cell.source:
                cell.metadata["nbgrader"] = {"grade": False, "grade_id": f"{source.stem}-{index}",
                                             "locked": False, "schema_version": 3,
                                             "solution": True, "task": False}
        kept.append(cell)
    nb.cells = kept
    nb.metadata.pop("jupytext", None)
    return nb


def write_student_edition(out: Path, sources: list[Path] | None = None) -> list[Path]:
    """Write the student notebooks into ``out``; returns their paths."""
    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sources or sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.md")):
        target = out / f"{source.stem}.ipynb"
        nbformat.write(student_notebook(source), target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "student")
    args = parser.parse_args(argv)
    for path in write_student_edition(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
