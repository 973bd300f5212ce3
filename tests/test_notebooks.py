"""The notebook pipeline: every chapter's .md source and executed .ipynb agree cell by cell,
every chapter is in docs/toc.yml and it names only files that exist (chapters as executed .ipynb,
plain pages such as the glossary and bibliography as .md), and no chapter reads a file through a
path relative to the working directory (nbgrader and students run chapters elsewhere)."""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.md"))


def _cells(path: Path) -> list[tuple[str, str]]:
    notebook = jupytext.read(path)
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "docs" / "toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    files += [chapter["file"] for chapter in toc.get("chapters", [])]
    return files


def test_there_are_chapters():
    assert SOURCES, "notebooks/ holds no NN-topic.md sources"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_md_and_ipynb_agree_on_cell_types_and_sources(source):
    executed = source.with_suffix(".ipynb")
    rebuild = f"make notebook NB={source.relative_to(ROOT)}"
    assert executed.exists(), f"{executed.name} is missing: run `{rebuild}`"
    assert _cells(source) == _cells(executed), (
        f"{source.name} and {executed.name} disagree: regenerate with `{rebuild}`"
    )


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_ipynb_is_executed_with_outputs(source):
    notebook = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code, f"{source.name} has no code"
    assert all(cell.get("execution_count") for cell in code), f"{source.name}: unexecuted cells"
    errors = [o for cell in code for o in cell.outputs if o.get("output_type") == "error"]
    assert not errors, f"{source.name} stored an error output"


def test_toc_lists_every_chapter_and_only_existing_files():
    listed = _toc_files()
    assert len(listed) == len(set(listed)), "toc.yml lists a file twice"
    chapters = {f"notebooks/{p.stem}" for p in SOURCES}
    for entry in listed:
        if entry in chapters or (ROOT / f"{entry}.ipynb").exists():
            assert (ROOT / f"{entry}.ipynb").exists(), f"toc.yml names {entry}, which has no .ipynb"
        else:  # a plain MyST page without code (the glossary, the bibliography)
            assert (ROOT / f"{entry}.md").exists(), f"toc.yml names {entry}, which does not exist"
    assert chapters <= set(listed), f"not in toc.yml: {sorted(chapters - set(listed))}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_md_source_round_trips_through_jupytext(source):
    # what Lab's Jupytext contents manager writes when a reader saves the chapter unchanged
    from jupytext.config import load_jupytext_configuration_file

    config = load_jupytext_configuration_file(str(NOTEBOOKS / "jupytext.toml"))
    text = source.read_text()
    assert jupytext.writes(jupytext.read(source), fmt="md:myst", config=config) == text, (
        f"{source.name} changes when saved unchanged from Lab: write it back with jupytext")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_code_reads_no_path_relative_to_the_working_directory(source):
    # nbgrader runs a chapter in course/source/<ch>/, release/<ch>/ or autograded/<s>/<ch>/, and
    # a student anywhere: "../benchmarks/..." exists only beside notebooks/
    bad = [cell.source.splitlines()[0] for cell in jupytext.read(source).cells
           if cell.cell_type == "code" and re.search(r"""["']\.\.(/|["'])""", cell.source)]
    assert not bad, (f"{source.name}: a code cell reads a path relative to the working directory "
                     f"(locate files from kvlab.__file__, as chapter 4 does): {bad}")
