"""Numbers in chapter prose and chapters in JupyterLab: every ``{eval}`name``` role names a value
its code binds and glues under that name (the site pastes the glue output, Lab the kernel's
value), the executed notebooks store those values for Lab (``tools/inline_values.py``), the
site's ``eval`` role takes names only, and a MyST source stores the ``language_info`` that the
kernel writes on open (so Lab does not mark it modified)."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import jupytext
import nbformat
import pytest
from docutils.frontend import get_default_settings
from docutils.parsers.rst import Parser
from docutils.utils import new_document
from IPython.core.inputtransformer2 import TransformerManager

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import inline_values  # noqa: E402

CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.md"))


def _glued_as_bound(source: str) -> set[str]:
    """Names ``x`` glued as ``glue("x", x, ...)`` in a code cell's source."""
    tree = ast.parse(TransformerManager().transform_cell(source))
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "glue"
            and len(node.args) > 1 and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[1], ast.Name) and node.args[1].id == node.args[0].value}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_eval_role_names_a_value_the_chapter_binds_and_glues(chapter):
    nb = jupytext.read(chapter)
    roles = {name for cell in nb.cells if cell.cell_type == "markdown"
             for name in inline_values.expressions(cell.source)}
    bound = set().union(*[_glued_as_bound(c.source) for c in nb.cells
                          if c.cell_type == "code"])
    assert roles <= bound, (f"{chapter.name}: {{eval}} of {sorted(roles - bound)}, which no "
                            'cell binds and glues as glue("x", x, ...)')


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_executed_notebook_stores_the_glued_values_for_lab(chapter):
    nb = nbformat.read(chapter.with_suffix(".ipynb"), as_version=4)
    assert inline_values.stale(nb) == [], (
        f"{chapter.name}: run `python tools/inline_values.py {chapter.relative_to(ROOT)}`")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_source_header_language_info_is_the_executed_notebooks(chapter):
    stored = jupytext.read(chapter).metadata.get("language_info")
    if stored is None:
        pytest.skip(f"{chapter.name} stores no language_info (Lab opens it modified)")
    executed = nbformat.read(chapter.with_suffix(".ipynb"), as_version=4).metadata
    assert stored == executed["language_info"]


def _notebook(markdown: str) -> nbformat.NotebookNode:
    glue_out = nbformat.v4.new_output(
        "display_data", data={"application/papermill.record/text/plain": "'264'"},
        metadata={"scrapbook": {"name": "growth", "mime_prefix": "application/papermill.record/"}})
    code = nbformat.v4.new_code_cell('growth = "264"\nglue("growth", growth, display=False)',
                                     outputs=[glue_out])
    return nbformat.v4.new_notebook(cells=[code, nbformat.v4.new_markdown_cell(markdown),
                                           nbformat.v4.new_markdown_cell("no roles")])


def test_store_writes_one_entry_per_role_as_the_kernel_answers_and_is_idempotent():
    nb = _notebook("{eval}`growth`-fold, and again {eval}`growth`")
    nb.cells[2].metadata["user_expressions"] = [{"expression": "old"}]
    assert inline_values.stale(nb) == [1, 2]
    inline_values.store(nb)
    entry = {"expression": "growth",
             "result": {"status": "ok", "data": {"text/plain": "'264'"}, "metadata": {}}}
    assert nb.cells[1].metadata["user_expressions"] == [entry, entry]
    assert "user_expressions" not in nb.cells[2].metadata and "user_expressions" not in \
        nb.cells[0].metadata
    assert inline_values.stale(nb) == []


def test_a_role_whose_name_is_not_glued_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"cell 1: .*'load_us'"):
        inline_values.store(_notebook("{eval}`growth` and {eval}`load_us`"))


def _run_site_role(text: str):
    from kvlab_eval import EvalGlueRole

    document = new_document("chapter", get_default_settings(Parser))
    reporter = types.SimpleNamespace(get_source_and_line=lambda line: ("chapter", line))
    inliner = types.SimpleNamespace(document=document, reporter=reporter)
    return EvalGlueRole()("eval", f"{{eval}}`{text}`", text, 1, inliner)


def test_site_eval_role_takes_a_glue_key_only():
    nodes, messages = _run_site_role("growth * 2")
    assert nodes == [] and len(messages) == 1
    assert "takes a name" in messages[0].astext()
    nodes, messages = _run_site_role("growth")   # a name: looked up as glue data
    assert nodes == [] and "No key 'growth' found in glue data" in messages[0].astext()
