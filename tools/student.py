"""The student edition: every chapter without its solutions, as notebooks and as a site.

    python tools/student.py [--out student]          # notebooks, solutions out, outputs cleared
    python tools/student.py --site _build/student-src  # the book's sources without solutions
    python tools/student.py --check-sources            # do the chapters follow the conventions?
    python tools/student.py --write-sources            # make them follow them (edits the .md)

A solution cell is a code cell tagged ``solution`` or ``hide-cell`` (the chapter template puts
each exercise's worked solution in a collapsed ``hide-cell`` cell right after the exercise).
Each ``notebooks/NN-topic.md`` becomes ``OUT/NN-topic.ipynb`` with those cells removed and all
outputs cleared (a stored output could show an answer). Exercise cells keep their
``check_*()`` calls, which report "not answered yet" until the student fills them in.
``tests/test_student.py`` executes the result. The graded version of the same material is the
nbgrader course (``tools/course.py``).

``--site`` writes a copy of the book's inputs in which every chapter ``.ipynb`` (with its
stored outputs) lacks its solution cells; ``make book-student`` builds it with the book's
config, so a teacher can publish the book while an exercise set is open.

Text that holds only where the worked solutions are (the preface's "each exercise's worked
solution follows it") sits in its own markdown cell tagged :data:`EDITION_TAG`. Both student
editions drop that cell, or put in its place the text its metadata holds under
:data:`STUDENT_TEXT` (what the same passage says in an edition without solutions):
:func:`for_students` is the one rule both apply.

The source conventions are two, both for JupyterLab: a solution cell's first line is
:data:`SOLUTION_LABEL` (Lab shows a collapsed cell as its first line, so the collapsed bar says
"Solution" instead of the first line of the answer), and the front matter's kernelspec names
the ipykernel display name that Lab writes back (otherwise Lab marks the chapter modified on
open).
"""

from __future__ import annotations

import argparse
import copy
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTION_TAGS = frozenset({"solution", "hide-cell"})
SOLUTION_LABEL = "# Solution (try the exercise first)"
KERNEL_DISPLAY_NAME = "Python 3 (ipykernel)"   # what `python -m ipykernel install` registers
BOOK_INPUTS = ("book.yml", "docs")   # the site's machinery and pages live in docs/
EDITION_TAG = "edition-book"       # a cell that holds only where the solutions are
STUDENT_TEXT = "student_edition"   # its text in the editions without them (else it goes)


def chapter_sources() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.md"))


def is_solution(cell) -> bool:
    return cell.cell_type == "code" and bool(SOLUTION_TAGS & set(cell.metadata.get("tags", [])))


def in_student_edition(cell):
    """``cell`` as an edition without worked solutions has it: a cell tagged
    :data:`EDITION_TAG` becomes a copy holding its :data:`STUDENT_TEXT`, or None (left out)
    without one; any other cell is returned as it is."""
    if EDITION_TAG not in cell.metadata.get("tags", []):
        return cell
    text = cell.metadata.get(STUDENT_TEXT)
    if not text:
        return None
    cell = copy.deepcopy(cell)
    cell.source = text
    cell.metadata.pop(STUDENT_TEXT)
    cell.metadata["tags"] = [t for t in cell.metadata["tags"] if t != EDITION_TAG]
    if not cell.metadata["tags"]:
        del cell.metadata["tags"]
    return cell


def for_students(cells: list) -> list:
    """``cells`` as an edition without worked solutions has them: no solution cell, and each
    cell as :func:`in_student_edition` has it."""
    kept = (in_student_edition(cell) for cell in cells if not is_solution(cell))
    return [cell for cell in kept if cell is not None]


def student_notebook(source: Path):
    """The student notebook of chapter ``source`` (a ``.md``): solutions out, the text of the
    edition without them, outputs cleared."""
    import jupytext

    nb = jupytext.read(source)
    nb.cells = for_students(nb.cells)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("jupytext", None)
    return nb


def write_student_edition(out: Path, sources: list[Path] | None = None) -> list[Path]:
    """Write the student notebooks into ``out``; returns their paths."""
    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sources or chapter_sources():
        target = out / f"{source.stem}.ipynb"
        nbformat.write(student_notebook(source), target)
        written.append(target)
    return written


def write_site_sources(out: Path) -> Path:
    """Copy the book's inputs into ``out`` with every chapter as :func:`for_students` has it
    (stored outputs kept, so the site builds without executing anything). Returns ``out``."""
    import nbformat

    marker = out / ".kvlab-student-site"
    if out.exists() and any(out.iterdir()) and not marker.exists():
        raise ValueError(f"{out} exists and is not a student site written by this tool")
    if out.exists():
        shutil.rmtree(out)
    (out / "notebooks").mkdir(parents=True)
    marker.touch()
    for name in BOOK_INPUTS:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, out / name)
        elif src.exists():
            shutil.copy2(src, out / name)
    chapters = {p.stem for p in chapter_sources()}
    for page in (ROOT / "notebooks").iterdir():
        if page.suffix == ".md" and page.stem not in chapters:
            shutil.copy2(page, out / "notebooks" / page.name)
        elif page.suffix == ".ipynb":
            nb = nbformat.read(page, as_version=4)
            nb.cells = for_students(nb.cells)
            nbformat.write(nb, out / "notebooks" / page.name)
    return out


# ---- the chapter-source conventions (see the module docstring) --------------------------------

_CELL = re.compile(r"(```\{code-cell\} ipython3\n)(.*?)(\n```)", re.S)
_TAGS = re.compile(r"^:tags: \[(.*?)\]\n|^tags: \[(.*?)\]\n", re.M)
_DISPLAY = re.compile(r"^(kernelspec:\n(?:  .*\n)*?  display_name: )(.*)$", re.M)


def _label_cell(match: re.Match) -> str:
    head, body, tail = match.groups()
    options_end = 0
    if body.startswith("---\n"):   # a YAML options block
        options_end = body.index("\n---\n", 4) + 5
    else:
        while re.match(r":\w[\w-]*:", body[options_end:]):
            options_end = body.index("\n", options_end) + 1
    options, code = body[:options_end], body[options_end:]
    tags = [t.strip() for m in _TAGS.finditer(options) for t in (m.group(1) or m.group(2)
                                                                  ).split(",")]
    if not SOLUTION_TAGS & set(tags):
        return match.group(0)
    code = code.lstrip("\n")
    if not code.startswith(SOLUTION_LABEL):
        code = f"{SOLUTION_LABEL}\n{code}"
    return f"{head}{options}\n{code}{tail}" if options else f"{head}{code}{tail}"


def with_conventions(text: str) -> str:
    """``text`` (a chapter's MyST source) with each solution cell labelled and the kernelspec's
    display name set; idempotent."""
    text = _DISPLAY.sub(lambda m: m.group(1) + KERNEL_DISPLAY_NAME, text, count=1)
    return _CELL.sub(_label_cell, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "student")
    parser.add_argument("--site", type=Path, help="write the book's sources without solutions")
    parser.add_argument("--check-sources", action="store_true")
    parser.add_argument("--write-sources", action="store_true")
    args = parser.parse_args(argv)
    if args.check_sources or args.write_sources:
        stale = []
        for source in chapter_sources():
            text = source.read_text()
            if with_conventions(text) != text:
                stale.append(source.name)
                if args.write_sources:
                    source.write_text(with_conventions(text))
        if stale and not args.write_sources:
            print("unlabelled solutions or Lab-rewritten kernelspec:", ", ".join(stale))
            return 1
        return 0
    if args.site:
        print(write_site_sources(args.site))
        return 0
    for path in write_student_edition(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
