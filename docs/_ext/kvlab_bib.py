"""Sphinx extension for the kvlab book: author-year citations that never name two works alike.

Loaded through ``book.yml`` (``sphinx.local_extensions``), which selects its two styles:
``bibtex_default_style: kvlab`` (the bibliography) and ``bibtex_reference_style:
kvlab_author_year`` (the citations in the text).

sphinxcontrib-bibtex's ``author_year`` citations are built from each entry's author and year
alone, so works by one author in one year read the same: four references rendered as
"The vLLM project, 2025" and two as "The SGLang project, 2025", while the bibliography's
``alpha`` labels ("Thevproject25a") matched none of them. Here

* every bibliography label is the entry's author-year citation ("Kwon et al., 2023"), and
  works that would share one get the letters a, b, c, ... in the order the bibliography lists
  them (pybtex's own mechanism for duplicate labels: "The vLLM project, 2025a");
* the bibliography is sorted by that label (author as printed, then year, then title, case and
  braces ignored), so an organisation ("The vLLM project") files under its printed name
  instead of after every person;
* the citations in the text print the year with the letter of the entry's label, so the text
  says "The vLLM project, 2025d" and the bibliography lists "[The vLLM project, 2025d]";
* BibTeX's "and others" (an author list cut short) reads "et al.", in the text and in the
  labels: "Chowdhery et al., 2023", not "Chowdhery and others, 2023".
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pybtex.plugin
from pybtex.richtext import Tag, Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle
from pybtex.style.template import FieldIsMissing, first_of, optional, tag
from sphinxcontrib.bibtex.plugin import register_plugin
from sphinxcontrib.bibtex.style.referencing import BaseReferenceStyle, PersonStyle
from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle
from sphinxcontrib.bibtex.style.referencing.basic_author_year import (
    BasicAuthorYearParentheticalReferenceStyle,
    BasicAuthorYearTextualReferenceStyle,
)
from sphinxcontrib.bibtex.style.referencing.extra_year import ExtraYearReferenceStyle
from sphinxcontrib.bibtex.style.template import (
    field,
    join,
    join2,
    node,
    post_text,
    pre_text,
    reference,
    year,
)

STYLE = "kvlab"                        # bibtex_default_style
REFERENCE_STYLE = "kvlab_author_year"  # bibtex_reference_style
ET_AL = Text(" ", Tag("em", "et al."))


@node
def names_et_al(children, data: dict[str, Any], role: str, **kwargs) -> Text:
    """sphinxcontrib-bibtex's ``names``, reading BibTeX's "and others" as "et al."
    ("Chowdhery and others" cites as "Chowdhery et al.")."""
    assert not children
    try:
        persons = list(data["entry"].persons[role])
    except KeyError:
        raise FieldIsMissing(role, data["entry"]) from None
    person = data["style"].person
    others = len(persons) > 1 and str(persons[-1]) == "others"
    if others:
        persons.pop()
    names = [person.style_plugin.format(p, person.abbreviate) for p in persons]
    text = join(**kwargs)[names].format_data(data)
    if others and (kwargs.get("other") is None or len(names) < 3):
        text = Text(text, kwargs.get("other") or ET_AL)
    return text


@dataclass
class EtAlPersonStyle(PersonStyle):
    """:class:`PersonStyle` with :func:`names_et_al`."""

    def names(self, role: str, full: bool):
        return names_et_al(role=role, sep=self.sep, sep2=self.sep2, last_sep=self.last_sep,
                           other=None if full else self.other)

    def author_or_editor_or_title(self, full: bool):
        return first_of[
            optional[self.names("author", full)],
            optional[self.names("editor", full)],
            tag("em")[field("title")],
        ]


@node
def year_with_suffix(children, data: dict[str, Any]) -> Text:
    """The entry's year, followed by the letter its bibliography label adds ("2025" and label
    "The vLLM project, 2025d" give "2025d")."""
    assert not children
    text = year.format_data(data)
    label = data["formatted_entry"].label
    plain = str(text)
    match = re.search(re.escape(plain) + r"([a-z]+)$", label)
    return Text(text, match[1]) if match else text


@dataclass
class _Parenthetical(BasicAuthorYearParentheticalReferenceStyle):
    def inner(self, role_name: str):
        return join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
            pre_text,
            reference[
                join(sep=self.author_year_sep)[
                    self.person.author_or_editor_or_title(full="s" in role_name),
                    year_with_suffix,
                ]
            ],
            post_text,
        ]


@dataclass
class _Textual(BasicAuthorYearTextualReferenceStyle):
    def inner(self, role_name: str):
        return join(sep=self.text_reference_sep)[
            self.person.author_or_editor_or_title(full="s" in role_name),
            join[
                self.bracket.left,
                join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
                    pre_text,
                    reference[year_with_suffix],
                    post_text,
                ],
                self.bracket.right,
            ],
        ]


@dataclass
class _Year(ExtraYearReferenceStyle):
    def inner(self, role_name: str):
        return reference[year_with_suffix]


_REPLACE = {
    BasicAuthorYearParentheticalReferenceStyle: _Parenthetical,
    BasicAuthorYearTextualReferenceStyle: _Textual,
    ExtraYearReferenceStyle: _Year,
}


@dataclass
class KvlabAuthorYearReferenceStyle(AuthorYearReferenceStyle):
    """sphinxcontrib-bibtex's ``author_year`` with the label's letter after the year, and
    "et al." for BibTeX's "and others"."""

    person: PersonStyle = dataclasses.field(default_factory=EtAlPersonStyle)

    def __post_init__(self):
        super().__post_init__()
        swapped: list[BaseReferenceStyle] = []
        for style in self.styles:
            kind = _REPLACE.get(type(style))
            swapped.append(kind(**vars(style)) if kind else style)
        self.styles[:] = swapped
        self.role_style.clear()
        self.role_style.update(
            (role, style) for style in self.styles for role in style.role_names())


_AUTHOR_STYLE: KvlabAuthorYearReferenceStyle | None = None


def citation_base(entry) -> str:
    """What the ``author_year`` citation of ``entry`` prints, as plain text, before any
    letter: "Kwon et al., 2023", "Saxena, 2023", "The vLLM project, 2025"."""
    global _AUTHOR_STYLE
    if _AUTHOR_STYLE is None:
        _AUTHOR_STYLE = KvlabAuthorYearReferenceStyle()
    data = {"entry": entry, "style": _AUTHOR_STYLE}
    author = _AUTHOR_STYLE.person.author_or_editor_or_title(full=False).format_data(data)
    return f"{author.render_as('text')}, {year.format_data(data).render_as('text')}"


def _plain_key(text: str) -> str:
    text = unicodedata.normalize("NFKD", text.replace("{", "").replace("}", ""))
    return "".join(c for c in text if not unicodedata.combining(c)).casefold()


class AuthorYearSortingStyle(BaseSortingStyle):
    """By the printed citation (author, then year), then by title."""

    def sorting_key(self, entry):
        return (_plain_key(citation_base(entry)), _plain_key(entry.fields.get("title", "")))


class AuthorYearLabelStyle(BaseLabelStyle):
    """The entry's citation as its label; a, b, c, ... where several would share one."""

    def format_labels(self, sorted_entries):
        labels = [citation_base(entry) for entry in sorted_entries]
        total = Counter(labels)
        seen: Counter[str] = Counter()
        for label in labels:
            if total[label] == 1:
                yield label
            else:
                yield label + chr(ord("a") + seen[label])
                seen[label] += 1


class KvlabStyle(UnsrtStyle):
    """pybtex's ``unsrt`` entries (as ``alpha`` formats them) under author-year labels."""

    default_label_style = REFERENCE_STYLE
    default_sorting_style = REFERENCE_STYLE


def register() -> None:
    """Make the styles known to pybtex and sphinxcontrib-bibtex (idempotent)."""
    pybtex.plugin.register_plugin("pybtex.style.labels", REFERENCE_STYLE, AuthorYearLabelStyle,
                                  force=True)
    pybtex.plugin.register_plugin("pybtex.style.sorting", REFERENCE_STYLE, AuthorYearSortingStyle,
                                  force=True)
    pybtex.plugin.register_plugin("pybtex.style.formatting", STYLE, KvlabStyle, force=True)
    register_plugin("sphinxcontrib.bibtex.style.referencing", REFERENCE_STYLE,
                    KvlabAuthorYearReferenceStyle, force=True)


def setup(app) -> dict[str, Any]:
    register()
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
