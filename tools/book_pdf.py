"""The whole book as one PDF, offline: Jupyter Book's single-page build printed by headless
Chromium.

    jupyter-book build . --config book.yml --toc docs/toc.yml --builder singlehtml
    python tools/book_pdf.py [_build/singlehtml] [--out _build/pdf/kvlab.pdf]   # make pdf

The single-page build holds every chapter of the table of contents on one page, with the
stored outputs: figures, tables, the first view of each widget's kernel-free twin, and math
(MathJax from ``docs/_static``, so nothing is fetched from the network). Chromium opens it from a
local server, waits until MathJax has typeset every formula and every image has loaded, and
prepares it for paper: each chapter starts a page, the worked solutions are printed open after
their exercises (a PDF cannot open a collapsed cell), and the site's navigation, buttons and
search are left out (``PRINT_CSS``). ``Page.printToPDF`` writes an A4 PDF with page numbers
and a bookmark per heading.

:func:`check_pdf` reads the PDF back (pypdf) and fails unless every page of ``docs/toc.yml`` has
its bookmark, its title on the page the bookmark opens, and the PDF holds figures; ``make pdf``
runs it. Exit status 0 when the PDF is written and checked, 1 when a check fails, 2 when the
page cannot be printed (no browser, math not typeset, an image that does not load).
"""

from __future__ import annotations

import argparse
import base64
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from site_check import serve, start_browser  # noqa: E402

PRINT_CSS = """
@page { size: A4; }
@media print {
  .bd-header, .bd-header-article, .bd-sidebar-primary, .bd-sidebar-secondary, .bd-footer,
  .bd-footer-article, .prev-next-area, .skip-link, #pst-back-to-top, .headerlink,
  .copybtn, .bd-search, .search-button-field, .pst-scrollable-table-container + .copybtn,
  details > summary, .kvlab-kf-controls { display: none !important; }
  html, body, .bd-page-width, .bd-container, .bd-container__inner, .bd-main, .bd-content,
  .bd-article-container, .bd-article { display: block !important; max-width: none !important;
    min-width: 0 !important; width: auto !important; margin: 0 !important;
    padding: 0 !important; }
  /* the site gives a figure the min-width at which its text stays legible on a phone; on
     paper the figure fits the column (A4 at 100%: wider than a phone's screen) */
  img { min-width: 0 !important; max-width: 100% !important; height: auto !important; }
  body { font-size: 10.5pt; }
  pre, .highlight pre { font-size: 7.6pt !important; white-space: pre-wrap !important; }
  .kvlab-chapter { break-before: page; }
  h1, h2, h3 { break-after: avoid; }
  figure, img, table { break-inside: avoid; }
}
"""

PRINTED = "kvlab-print.html"   # the copy of the single page that is printed

# Open every collapsed block (the worked solutions), keep a widget twin's first view only, mark
# where each chapter starts (Sphinx's single-page builder puts a span with id
# "document-<docname>" before each document it inlines), point the book's links to places in
# the book at those places, add the print style sheet.
_PREPARE = """
for (const d of document.querySelectorAll('details')) d.open = true;
// a widget's kernel-free twin prints its first view; the other views are not on paper
for (const e of document.querySelectorAll('.kvlab-kf-frame[hidden], script[data-kf-part]')) {
  e.remove();
}
const starts = [...document.querySelectorAll('span[id^="document-"]')];
for (const s of starts) {
  const next = s.nextElementSibling;
  if (next) next.classList.add('kvlab-chapter');
}
// a link to a place in the book (written as "notebooks/00-preface.html#id") stays in the PDF
for (const a of document.querySelectorAll('a[href^="' + arguments[1] + '#"]')) {
  a.setAttribute('href', a.getAttribute('href').slice(arguments[1].length));
}
const style = document.createElement('style');
style.textContent = arguments[0];
document.head.appendChild(style);
return starts.length;
"""

_MATH_DONE = """
const done = arguments[arguments.length - 1];
if (!window.MathJax || !MathJax.startup || !MathJax.startup.promise) { done('no MathJax'); }
else { MathJax.startup.promise.then(() => done('typeset'), e => done('error: ' + e)); }
"""

_IMAGES_LOADED = """
return [...document.images].every(i => i.complete);
"""

FOOTER = ('<div style="font-size:8px; width:100%; text-align:center; color:#555">'
          '<span class="pageNumber"></span> / <span class="totalPages"></span></div>')


def chapter_titles(toc: Path = ROOT / "docs" / "toc.yml") -> list[str]:
    """The first heading of every page in the book's table of contents, in order."""
    files = re.findall(r"(?:root|file):\s*(\S+)", toc.read_text())
    titles = []
    for name in files:
        path = ROOT / name
        source = next(p for p in (path.with_suffix(".md"), path.with_suffix(".ipynb"))
                      if p.exists())
        prose = re.sub(r"^```.*?^```", "", source.read_text(), flags=re.M | re.S)
        heading = re.search(r"^# (.+)$", prose, re.M)
        if heading is None:
            raise ValueError(f"{source}: no title heading")
        titles.append(heading.group(1).strip())
    return titles


def print_pdf(site: Path, out: Path, timeout: float = 900) -> int:
    """Print the single-page build in ``site`` to ``out``; returns the number of documents it
    holds. Raises RuntimeError when MathJax does not finish or an image does not load."""
    # The single-page builder writes the book at the root document's path
    # (notebooks/00-preface.html) with links relative to the site's root: a copy at the root
    # resolves them.
    redirect = re.search(r"url=([^\"']+)", (site / "index.html").read_text())
    page = redirect.group(1) if redirect else "index.html"
    (site / PRINTED).write_bytes((site / page).read_bytes())
    with serve(site) as base:
        driver = start_browser()
        try:
            driver.set_script_timeout(timeout)
            # printing two hundred pages of figures outlasts the driver's 120 s default
            driver.command_executor.client_config.timeout = timeout
            driver.get(base + PRINTED)
            math = driver.execute_async_script(_MATH_DONE)
            if math != "typeset":
                raise RuntimeError(f"math not typeset: {math}")
            documents = driver.execute_script(_PREPARE, PRINT_CSS, page)
            deadline = time.monotonic() + timeout
            while not driver.execute_script(_IMAGES_LOADED):
                if time.monotonic() > deadline:
                    raise RuntimeError("images did not load")
                time.sleep(0.5)
            pdf = driver.execute_cdp_cmd("Page.printToPDF", {
                "paperWidth": 8.27, "paperHeight": 11.69, "marginTop": 0.6,
                "marginBottom": 0.6, "marginLeft": 0.6, "marginRight": 0.6,
                "printBackground": True, "displayHeaderFooter": True,
                "headerTemplate": "<span></span>", "footerTemplate": FOOTER,
                "generateDocumentOutline": True})
        finally:
            driver.quit()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(base64.b64decode(pdf["data"]))
    return documents


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _outline(reader, items=None) -> list[tuple[str, int]]:
    """(title, page index) of every bookmark of the PDF, depth first."""
    found = []
    for item in reader.outline if items is None else items:
        if isinstance(item, list):
            found += _outline(reader, item)
        else:
            found.append((_normal(item.title), reader.get_destination_page_number(item)))
    return found


def check_pdf(pdf: Path, titles: list[str]) -> list[str]:
    """What is wrong with the printed book ``pdf``: a title in ``titles`` without its bookmark
    or not on the page its bookmark opens, no rendered math, or no image at all. Empty when it
    is right."""
    from pypdf import PdfReader

    reader = PdfReader(pdf)
    marks = _outline(reader)
    texts: dict[int, str] = {}
    problems = []
    for title in titles:
        pages = [page for name, page in marks if name == _normal(title)]
        if not pages:
            problems.append(f"no bookmark for the chapter {title!r}")
            continue
        text = texts.setdefault(pages[0], _normal(reader.pages[pages[0]].extract_text() or ""))
        if _normal(title) not in text:
            problems.append(f"{title!r} is not on the page its bookmark opens ({pages[0] + 1})")
    if not any(page.images for page in reader.pages):
        problems.append("no figure in the PDF")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", type=Path, default=ROOT / "_build" / "singlehtml")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "pdf" / "kvlab.pdf")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        parser.error(f"{args.site}: no single-page build (jupyter-book build --builder "
                     "singlehtml)")
    start = time.perf_counter()
    try:
        documents = print_pdf(args.site, args.out)
    except RuntimeError as exc:
        print(f"book-pdf: {exc}", file=sys.stderr)
        return 2
    titles = chapter_titles()
    problems = check_pdf(args.out, titles)
    from pypdf import PdfReader

    pages = len(PdfReader(args.out).pages)
    print(f"book-pdf: {args.out} ({pages} pages, {args.out.stat().st_size / 2**20:.1f} MiB, "
          f"{documents} documents) printed in {time.perf_counter() - start:.0f} s")
    for problem in problems:
        print(f"book-pdf FAIL: {problem}")
    if not problems:
        print(f"book-pdf: all {len(titles)} titles of the table of contents are bookmarked "
              "and on their pages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
