"""Every code line of every chapter fits in 88 characters, so code on the site rarely scrolls.

The site shows code unwrapped (tools/site_check.py fails on a wrapped line); 88 characters fit
the text column at 1280 px. A line is exempt only where a URL alone fills it: a URL cannot be
split, but the rest of a line that holds one can move to the next line.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.md"))
MAX_CHARS = 88


def _unsplittable(line: str, limit: int) -> bool:
    """Whether ``line`` is over ``limit`` only because of a URL: its indentation, the URL and a
    few characters of syntax (``# ``, quotes) already exceed the limit."""
    urls = [word for word in line.split() if "://" in word]
    indent = len(line) - len(line.lstrip())
    return bool(urls) and indent + max(map(len, urls)) + 4 > limit


def long_lines(source: Path, limit: int = MAX_CHARS) -> list[str]:
    """``cell N, line M (L chars): text`` for each code line of ``source`` (a chapter's MyST
    source) longer than ``limit`` characters, URL lines excepted."""
    notebook = jupytext.read(source)
    found = []
    for n, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        for m, line in enumerate(cell.source.splitlines(), 1):
            if len(line) > limit and not _unsplittable(line, limit):
                found.append(f"cell {n}, line {m} ({len(line)} chars): {line.strip()[:60]}")
    return found


def test_long_lines_finds_a_long_line(tmp_path):
    chapter = tmp_path / "99-x.md"
    chapter.write_text("```{code-cell} ipython3\nx = 1\n" + "y = '" + "a" * 90 + "'\n"
                       "# https://example.org/" + "b" * 90 + "\n"
                       "!curl --silent --fail --location --retry 3 --output data.bin "
                       "https://example.org/data.bin\n```\n")
    found = long_lines(chapter)
    assert len(found) == 2, found          # the URL alone is too long: exempt; the rest not
    assert found[0].startswith("cell 0, line 2 (96 chars): y = ")
    assert found[1].startswith("cell 0, line 4 (")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_chapter_code_lines_fit_88_characters(source):
    found = long_lines(source)
    assert not found, (f"{source.name}: {len(found)} code lines over {MAX_CHARS} characters:\n"
                       + "\n".join(found))
