"""The glossary promises that a chapter links each of its terms: every term of notebooks/glossary.md
is the target of a {term} role in some chapter, and every {term} role in a chapter names a glossary
term (compared case-insensitively, as Sphinx resolves them). One term is left unlinked on
purpose (below)."""

from __future__ import annotations

import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.md"))
ROLE = re.compile(r"\{term\}`([^`]+)`")
#: named by no chapter's prose: chapter 11's debug exercise 4 describes it, and a link there
#: would give the exercise away
UNLINKED_ON_PURPOSE = {"closed-loop load"}


def _terms() -> set[str]:
    block = (NOTEBOOKS / "glossary.md").read_text().split("```{glossary}\n", 1)[1]
    block = block.split("\n```", 1)[0]
    return {line.strip().lower() for line in block.splitlines() if line and not line[0].isspace()}


def _targets(text: str) -> list[str]:
    """The target of each {term} role: the part inside <...> when the text differs from it."""
    return [re.sub(r"^.*<(.+)>$", r"\1", m.strip(), flags=re.S).lower() for m in ROLE.findall(text)]


def test_every_glossary_term_is_linked_from_a_chapter():
    terms = _terms()
    assert len(terms) > 50, "the glossary block was not parsed"
    linked = {target for chapter in CHAPTERS for target in _targets(chapter.read_text())}
    unlinked = sorted(terms - linked - UNLINKED_ON_PURPOSE)
    assert not unlinked, f"glossary terms that no chapter links with {{term}}: {unlinked}"


def test_every_term_role_names_a_glossary_term():
    terms = _terms()
    bad = [
        f"{chapter.name}: {target!r}"
        for chapter in CHAPTERS
        for target in _targets(chapter.read_text())
        if target not in terms
    ]
    assert not bad, f"{{term}} targets missing from the glossary: {bad}"
