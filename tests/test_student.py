"""The student edition (``make student``): no solution leaks, and every chapter still runs.

Each chapter's student notebook is executed top to bottom in a real kernel: the exercises run
unsolved, their checks answer "not answered yet" (never "Correct"), and nothing raises — so no
later cell depended on a removed solution. Also here: how a check's verdict looks in a kernel
(one sentence, no traceback), the chapter-source conventions for Lab (labelled solutions, the
kernelspec Lab writes back), the collapsed-solution metadata ``tools/execute_notebook.py``
writes, and the site sources without solutions (``make book-student``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.md"))


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    import student

    out = tmp_path_factory.mktemp("student")
    student.write_student_edition(out)
    return out


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_no_solution_leaks(edition, source):
    import student

    chapter = jupytext.read(source)
    solutions = [c.source.strip() for c in chapter.cells if student.is_solution(c)]
    nb = nbformat.read(edition / f"{source.stem}.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    for cell in nb.cells:
        assert not student.is_solution(cell)
        assert not cell.get("outputs"), "a stored output could give an answer away"
    for solution in solutions:
        assert solution not in text
        defs = [ln for ln in solution.splitlines() if ln.startswith("def solution")]
        assert not any(d in text for d in defs)
    assert [c.source for c in nb.cells] == [c.source for c in student.for_students(chapter.cells)]
    assert not any(student.EDITION_TAG in c.metadata.get("tags", []) for c in nb.cells)


@pytest.mark.parametrize("source", [s for s in SOURCES if "hide-cell]" in s.read_text()],
                         ids=lambda p: p.stem)
def test_every_exercise_runs_unsolved(edition, source):
    from nbclient import NotebookClient

    nb = nbformat.read(edition / f"{source.stem}.ipynb", as_version=4)
    # Now and then nbclient receives a widget cell's execute reply only when its poll for that
    # reply times out (an upstream race, seen here as a 300 s stall on chapter 7's engine
    # widget); every cell of a chapter runs in seconds, so a 60 s poll bounds the stall.
    NotebookClient(nb, timeout=60, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    shown = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                    if o.get("output_type") == "stream")
    assert shown.count("Not answered yet") >= 2
    assert "Correct" not in shown


def test_a_wrong_answer_is_one_sentence_and_an_unanswered_one_lets_run_all_go_on():
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in (
        "from kvlab.exercises._common import try_check\n"
        "from kvlab.exercises.ch03 import check_double_release",
        "_ = try_check(check_double_release, ...)",   # unanswered: a hint, the run goes on
        "_ = try_check(check_double_release, 'a')",   # wrong: one sentence, the cell fails
        "print('still running')",
    )])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    NotebookClient(nb, timeout=60, kernel_name="python3", allow_errors=True).execute()
    hint, wrong, after = nb.cells[1].outputs, nb.cells[2].outputs, nb.cells[3].outputs
    assert [o.output_type for o in hint] == ["stream"] and "Not answered yet" in hint[0].text
    (error,) = wrong
    assert error.output_type == "error" and error.ename == "WrongAnswer"
    assert len(error.traceback) == 1, "a wrong answer shows its sentence, not a traceback"
    assert error.evalue in error.traceback[0] and "Traceback" not in error.traceback[0]
    assert "ch03.py" not in error.traceback[0], "the check's own code stays out of sight"
    assert after[0].text == "still running\n"   # allow_errors: the cell after still ran


def test_a_check_error_that_is_not_a_verdict_keeps_its_traceback():
    from kvlab.exercises._common import NotYetAnswered, WrongAnswer, try_check

    def check(fn):
        return fn()

    with pytest.raises(ZeroDivisionError):
        try_check(check, lambda: 1 / 0)
    with pytest.raises(WrongAnswer, match="is too high") as err:
        try_check(lambda x: (_ for _ in ()).throw(AssertionError(f"{x} is too high.")), 7)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert isinstance(err.value, AssertionError) and not isinstance(err.value, NotYetAnswered)


MYST = """---
jupytext:
  text_representation:
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

```{code-cell} ipython3
x = ...
```

```{code-cell} ipython3
:tags: [hide-cell]

print(check(3))
```

```{code-cell} ipython3
---
tags: [remove-output, hide-cell]
---
y = 4
```
"""


def test_source_conventions_label_every_solution_and_set_the_lab_kernelspec():
    import student

    fixed = student.with_conventions(MYST)
    assert student.with_conventions(fixed) == fixed
    nb = jupytext.reads(fixed, fmt="md:myst")
    assert nb.metadata["kernelspec"]["display_name"] == student.KERNEL_DISPLAY_NAME
    plain, first, second = (c for c in nb.cells if c.cell_type == "code")
    assert plain.source == "x = ..."
    assert first.source.splitlines() == [student.SOLUTION_LABEL, "print(check(3))"]
    assert second.source.splitlines() == [student.SOLUTION_LABEL, "y = 4"]
    assert second.metadata["tags"] == ["remove-output", "hide-cell"]


def test_execute_notebook_collapses_solutions_and_writes_the_kernel_lab_uses():
    import execute_notebook

    nb = jupytext.reads(MYST, fmt="md:myst")
    nb.cells[0].metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    spec = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    done = execute_notebook.finish(nb, spec)
    assert done.metadata["kernelspec"] == spec
    hidden = [c for c in done.cells if c.metadata.get("jupyter")]
    assert len(hidden) == 2 and all(c.metadata["jupyter"] == {"source_hidden": True,
                                                              "outputs_hidden": True}
                                    and c.metadata["collapsed"] for c in hidden)
    assert "execution" not in done.cells[0].metadata
    assert execute_notebook.kernelspec()["name"] == "python3"


def test_student_site_sources_drop_solutions_and_keep_outputs(tmp_path):
    import student

    out = student.write_site_sources(tmp_path / "site")
    for source in SOURCES:
        chapter = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
        site = nbformat.read(out / "notebooks" / f"{source.stem}.ipynb", as_version=4)
        assert not any(student.is_solution(c) for c in site.cells)
        kept = student.for_students(chapter.cells)
        assert [c.source for c in site.cells] == [c.source for c in kept]
        assert [c.get("outputs") for c in site.cells] == [c.get("outputs") for c in kept]
    assert (out / "book.yml").exists() and (out / "notebooks" / "glossary.md").exists()
    with pytest.raises(ValueError, match="not a student site"):
        student.write_site_sources(ROOT / "notebooks")


def test_lab_check_compares_notebooks_as_lab_saves_them():
    import lab_check

    widget = {"output_type": "display_data", "metadata": {}, "data": {
        "application/vnd.jupyter.widget-view+json": {"model_id": "m", "version_major": 2},
        "text/html": ["<div class=\"kvlab-kf\">", "frames</div>"], "text/plain": "[widget]"}}
    stored = {"metadata": {"widgets": {"state": {"m": {}}}}, "cells": [
        {"cell_type": "code", "metadata": {}, "source": ["x = 1\n", "x"], "outputs": [widget]}]}
    as_lab = json.loads(json.dumps(stored))
    as_lab["cells"][0]["source"] = "x = 1\nx"                 # one string instead of lines
    as_lab["cells"][0]["metadata"]["trusted"] = True          # transient, never written
    assert lab_check._differences(stored, as_lab) == []
    assert lab_check.widget_twins(stored) == (1, 1)
    dropped = json.loads(json.dumps(stored))
    dropped["metadata"]["widgets"] = {"state": {}}
    del dropped["cells"][0]["outputs"][0]["data"]["text/html"]
    assert lab_check._differences(stored, dropped) == ["notebook metadata 'widgets' changed",
                                                       "cell 0: outputs changed"]
    assert lab_check.widget_twins(dropped) == (1, 0)
    settings = json.loads((lab_check.check_settings() / "overrides.json").read_text())
    shipped = json.loads((ROOT / ".jupyter/lab/settings/overrides.json").read_text())
    assert settings["@jupyterlab/notebook-extension:tracker"] == {"windowingMode": "none"}
    assert shipped["@jupyter-widgets/jupyterlab-manager:plugin"] == {"saveState": False}


def test_lab_check_finds_a_solution_run_all_expanded_or_saved_open():
    import lab_check

    def cell(tags, jupyter=None, outputs=1):
        meta = {"tags": tags, **({"jupyter": jupyter} if jupyter else {})}
        return {"cell_type": "code", "metadata": meta, "source": "",
                "outputs": [{"output_type": "stream", "text": "x"}] * outputs}

    closed = {"source_hidden": True, "outputs_hidden": True}
    nb = {"cells": [cell([]), cell(["hide-cell"], closed), cell(["solution"], closed)]}
    lab = [{"index": 1, "inputHidden": True, "outputHidden": True, "outputs": 1, "shown": 0},
           {"index": 2, "inputHidden": True, "outputHidden": True, "outputs": 1, "shown": 0}]
    assert lab_check.solutions_kept_collapsed(lab, nb) == []
    # what JupyterLab alone does: a run shows the outputs, and the save drops outputs_hidden
    ran_open = [dict(lab[0], outputHidden=False, shown=1), lab[1]]
    saved_open = {"cells": [nb["cells"][0], cell(["hide-cell"], {"source_hidden": True}),
                            nb["cells"][2]]}
    assert lab_check.solutions_kept_collapsed(ran_open, saved_open) == [
        "after Run All, the outputs of solution cells [1] are shown",
        "saved after Run All, solution cells [1] lost jupyter.source_hidden/outputs_hidden "
        "(they would open expanded)"]
    unrun = {"cells": [nb["cells"][0], nb["cells"][1], cell(["solution"], closed, outputs=0)]}
    assert lab_check.solutions_kept_collapsed(lab, unrun) == [
        "solution cells [2] have no output after Run All (did they run?)"]


def test_the_lab_extension_that_keeps_solutions_collapsed_is_on_labs_path():
    """``make lab`` and Binder read .jupyter/jupyter_server_config.py, which puts the book's
    Lab extension on the server's extension path; its package names a file that exists."""
    from traitlets.config.loader import PyFileConfigLoader

    folder = ROOT / ".jupyter"
    config = PyFileConfigLoader("jupyter_server_config.py", path=str(folder)).load_config()
    (path,) = config.LabApp.extra_labextensions_path
    package = json.loads((Path(path) / "kvlab-solutions" / "package.json").read_text())
    entry = Path(path) / "kvlab-solutions" / package["jupyterlab"]["_build"]["load"]
    assert Path(path) == folder / "labextensions" and entry.is_file()
    assert "NotebookActions.executionScheduled" in entry.read_text()


def test_student_editions_say_what_their_edition_holds(edition, tmp_path):
    """The preface's sentence about the worked solutions holds only where they are: both
    student editions put the student edition's sentence in its place."""
    import student

    preface = ROOT / "notebooks" / "00-preface.md"
    book = jupytext.read(preface)
    (tagged,) = [c for c in book.cells if student.EDITION_TAG in c.metadata.get("tags", [])]
    assert "worked solution follows it" in tagged.source
    site = student.write_site_sources(tmp_path / "site") / "notebooks" / "00-preface.ipynb"
    for nb in (nbformat.read(edition / "00-preface.ipynb", as_version=4),
               nbformat.read(site, as_version=4)):
        text = "\n".join(c.source for c in nb.cells)
        assert "worked solution follows it" not in text and "collapsed" not in text
        assert tagged.metadata[student.STUDENT_TEXT] in text


def test_an_edition_cell_without_student_text_is_left_out():
    import student

    cells = [nbformat.v4.new_markdown_cell("kept"),
             nbformat.v4.new_markdown_cell("only with solutions",
                                           metadata={"tags": [student.EDITION_TAG]}),
             nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["hide-cell"]})]
    assert [c.source for c in student.for_students(cells)] == ["kept"]
    assert cells[1].source == "only with solutions"   # the book's cells are left as they were
