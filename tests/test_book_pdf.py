"""The whole-book PDF (``make pdf``, ``tools/book_pdf.py``): the titles it must hold come from
the table of contents, and its check fails on a PDF that lacks a chapter. The full book is
printed and checked by ``make pdf`` itself (part of ``make test``); here a two-chapter
single-page site stands in for it (headless Chromium, a few seconds)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

# two documents as Sphinx's single-page builder writes them (a span before each), a figure,
# and the MathJax start-up promise the printer waits for
PAGE = """<!DOCTYPE html><html><head><script>
window.MathJax = {startup: {promise: Promise.resolve()}};</script></head><body>
<div class="bd-article"><section><h1>Preface: using this book</h1><p>Read me.</p></section>
<span id="document-notebooks/01-kv-capacity"></span><section><h2>1. KV cache capacity</h2>
<img src="_images/dot.png" alt="a dot" width="40" height="40">
<details><summary>Show code cell source</summary><pre># Solution (try the exercise first)</pre>
</details></section></div></body></html>"""


def test_the_book_titles_come_from_the_table_of_contents():
    import book_pdf

    titles = book_pdf.chapter_titles()
    assert titles[0] == "Preface: using this book" and titles[-1] == "Bibliography"
    assert "1. KV cache capacity" in titles and len(titles) == len(set(titles)) >= 15
    assert not any(t.startswith(("#", "Colab")) for t in titles), "a code comment is no title"


@pytest.mark.skipif(shutil.which("chromedriver") is None, reason="needs chromium-driver")
def test_the_printed_book_is_checked_for_every_title(tmp_path):
    import book_pdf
    from PIL import Image

    site = tmp_path / "singlehtml"
    (site / "notebooks").mkdir(parents=True)
    (site / "_images").mkdir()
    Image.new("RGB", (40, 40), "red").save(site / "_images" / "dot.png")
    (site / "index.html").write_text('<meta http-equiv="Refresh" content="0; '
                                     'url=notebooks/00-preface.html" />')
    (site / "notebooks" / "00-preface.html").write_text(PAGE)
    pdf = tmp_path / "book.pdf"
    assert book_pdf.print_pdf(site, pdf, timeout=120) == 1
    from pypdf import PdfReader

    reader = PdfReader(pdf)
    assert len(reader.pages) == 2, "each chapter starts a page"
    assert "# Solution" in reader.pages[1].extract_text(), "solutions are printed open"
    present = ["Preface: using this book", "1. KV cache capacity"]
    assert book_pdf.check_pdf(pdf, present) == []
    assert book_pdf.check_pdf(pdf, [*present, "2. Page tables"]) == [
        "no bookmark for the chapter '2. Page tables'"]
