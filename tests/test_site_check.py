"""tools/site_check.py finds each failure it promises to find, and passes a clean page.

A tiny site is written to a temporary folder: one clean page (a kernel-free widget made by
``static_widget``, math rendered by the vendored MathJax, a favicon) and one page per defect.
The checker must report exactly the expected kinds on each. Needs headless Chromium; skipped
where chromium, chromedriver or selenium is missing (``make site-check`` installs them).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

pytestmark = pytest.mark.skipif(
    shutil.which("chromedriver") is None or shutil.which("chromium") is None
    or importlib.util.find_spec("selenium") is None,
    reason="needs chromium, chromium-driver and selenium",
)

HEAD = ('<!doctype html><html><head><meta charset="utf-8"><link rel="icon" href="favicon.svg">'
        '{extra}</head><body>{body}</body></html>')
MATHJAX = ('<script>window.MathJax = {loader: {load: ["input/tex-base", "output/chtml"]}};'
           '</script><script defer src="mathjax/startup.js"></script>')
KVLAB_JS = '<script src="_static/kvlab.js"></script>'
PHONE = '<meta name="viewport" content="width=device-width, initial-scale=1">'


def _widget_html(*, with_script: bool = True, fontsize: float = 10.0) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.kernel_free import static_widget

    def draw(n):
        fig, ax = plt.subplots(figsize=(2, 1))
        ax.bar(range(n), range(1, n + 1))
        ax.set_title(f"{n} bars", fontsize=fontsize)
        ax.tick_params(labelsize=fontsize)
        return fig

    html = static_widget(draw, {"n": [1, 2, 3]}, default={"n": 2}).to_html()
    return html if with_script else re.sub(r"<script>.*?</script>", "", html, flags=re.S)


def _output_png(path: Path, fontsize: float = 10.0) -> None:
    """A figure as a notebook output stores it (kvlab.viz.kernel_free.figure_output_png)."""
    import base64

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.kernel_free import figure_output_png

    fig, ax = plt.subplots(figsize=(3, 1.5))
    ax.plot([1, 2, 3], [3, 1, 2])
    ax.set_title("three points", fontsize=fontsize)
    ax.tick_params(labelsize=fontsize)
    data, _ = figure_output_png(fig)
    plt.close(fig)
    path.write_bytes(base64.b64decode(data))


# A theme-like page: ☰ (primary) and page-contents (secondary) buttons that show their panels
# with a script, or (dead=True) with none. On a wide screen the chapter list starts open and the
# ☰ hides and shows it, as sphinx-book-theme does.
MENU = """<div class="bd-header-article"><button class="primary-toggle">menu</button>
<button class="secondary-toggle">contents</button></div>
<nav class="bd-links" id="primary" style="display:none"><a href="#one">Chapter one</a></nav>
<nav class="page-toc" id="secondary" style="display:none"><a href="#two">Section two</a></nav>
<p id="one">one</p><p id="two">two</p>"""
MENU_SCRIPT = """<script>
const wide = innerWidth >= 992, primary = document.getElementById('primary');
if (wide) primary.style.display = 'block';
const flip = el => { el.style.display = el.style.display === 'none' ? 'block' : 'none'; };
document.querySelector('.primary-toggle').onclick = () => flip(primary);
document.querySelector('.secondary-toggle').onclick =
  () => flip(document.getElementById('secondary'));
</script>"""


def _phone_pngs(wide: Path, phone: Path) -> None:
    """A two-panel figure too wide for a phone as a notebook output stores it, and its phone
    variant (split out of its PNG as the site extension does)."""
    import base64

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.kernel_free import figure_output_png, split_phone_chunk

    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    for ax in axes:
        ax.plot([1, 2, 3], [3, 1, 2])
        ax.set_title("three points", fontsize=10)
    data, _ = figure_output_png(fig)
    plt.close(fig)
    png, small, fits = split_phone_chunk(base64.b64decode(data))
    assert fits and small is not None
    wide.write_bytes(png)
    phone.write_bytes(small)


DRAWER = """<button class="secondary-toggle">contents</button>
<dialog id="pst-secondary-sidebar-modal"><nav class="page-toc"><a href="#one">One</a>
<a href="#two">Two</a></nav></dialog><p id="one">one</p><p id="two" style="margin-top:2000px">
two</p><script>document.querySelector('.secondary-toggle').onclick =
  () => document.getElementById('pst-secondary-sidebar-modal').showModal();</script>"""

# Sphinx's search page in small: one result, whose summary it fetches from the page
SEARCH = """<!doctype html><html data-content_root="./"><head><meta charset="utf-8">
<link rel="icon" href="favicon.svg">{js}</head><body><div id="search-results">
<p class="search-summary"></p><ul></ul></div><script>
const li = document.createElement('li');
li.innerHTML = '<a href="good.html">Good</a>';
document.querySelector('#search-results ul').appendChild(li);
fetch('./good.html').then(r => r.text()).then(text => {{
  const p = document.createElement('p');
  p.className = 'context';
  const page = new DOMParser().parseFromString(text, 'text/html');
  p.textContent = (page.querySelector('[role="main"]') || page.body).textContent
    .slice(0, 60);
  li.appendChild(p);
}}).finally(() => {{
  document.querySelector('.search-summary').textContent = 'Search finished, found 1 page';
}});
</script></body></html>"""


def _site(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "docs" / "_static" / "favicon.svg", tmp_path / "favicon.svg")
    shutil.copytree(ROOT / "docs" / "_static" / "vendor" / "mathjax-3.2.2", tmp_path / "mathjax")
    (tmp_path / "_static").mkdir()
    shutil.copy(ROOT / "docs" / "_static" / "kvlab.js", tmp_path / "_static" / "kvlab.js")
    (tmp_path / "_static" / "kvlab-search-pages.js").write_text(
        'window.KVLAB_SEARCH_PAGES = {"good": "<div role=\\"main\\">a good page</div>"};')
    (tmp_path / "search.html").write_text(SEARCH.format(js=KVLAB_JS))
    _output_png(tmp_path / "fig.png")
    _phone_pngs(tmp_path / "wide.png", tmp_path / "phone.png")
    _output_png(tmp_path / "fig2.png", fontsize=11)
    _output_png(tmp_path / "tiny.png", fontsize=4)
    pixel = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
             "nGNgYPj/HwADAgH/eL9GtQAAAABJRU5ErkJggg==")
    stuck = _widget_html()
    for key in ('"0"', '"2"'):            # frames no control position can show
        stuck = stuck.replace(f"data-kf-key={key}", 'data-kf-key="9"')
    wide = "word " * 120
    W = 'width="288"'                      # the 3-inch figures' display width

    def captioned(img: str, caption: str = "Three points joined by lines.") -> str:
        """A static figure as MyST-NB writes one from ``mystnb: figure: caption:``."""
        return (f'<div class="cell_output"><figure>{img}<figcaption><p>{caption}</p>'
                "</figcaption></figure></div>")

    pages = {
        "good.html": (MATHJAX, MENU + '<p><span class="math">\\(x^2 + 1\\)</span></p>'
                      '<div class="highlight"><pre>short line</pre></div>'   # code may scroll:
                      '<div class="highlight"><pre style="width:200px;overflow-x:auto">'
                      f"{wide}</pre></div>"
                      + captioned(f'<img src="fig.png" {W} alt="three points">')
                      + _widget_html() + MENU_SCRIPT),
        "console.html": ("", "<script>console.error('boom')</script>"),
        "image.html": ("", '<img src="missing.png" alt="x">'),
        "math.html": ("", '<span class="math">\\(y\\)</span>'),
        "widget.html": ("", _widget_html(with_script=False)),
        "stuck.html": ("", stuck),
        "remote.html": ('<script src="http://127.0.0.1:9/cdn.js"></script>', "<p>x</p>"),
        "clipped.html": ("", '<div class="highlight"><pre style="width:200px;overflow:hidden;'
                         'white-space:pre">' + "x" * 400 + "</pre></div>"),
        "spill.html": ("", '<article class="bd-article" style="width:300px">'
                       '<div class="cell_output"><pre style="overflow:visible">' + "y" * 300
                       + "</pre></div></article>"),
        "table.html": ("", '<article class="bd-article" style="width:300px">'
                       '<div style="overflow-x:auto"><table style="width:900px"><tr><td>a</td>'
                       "</tr></table></div></article>"),
        "wrapped.html": ("", '<div class="highlight"><pre style="white-space:pre-wrap;'
                         f'width:200px">{wide}</pre></div>'),
        "figure.html": ("", _widget_html(fontsize=3)
                        + captioned(f'<img src="tiny.png" {W} alt="tiny">')),
        "undeclared.html": ("", captioned(f'<img src="{pixel}" alt="a dot">')),
        "alt.html": ("", captioned(f'<img src="fig.png" {W} alt="../_images/fig.png">')
                     + captioned(f'<img src="fig2.png" {W}>')),
        # a static figure with no caption, and one whose figcaption is empty
        "caption.html": ("", f'<div class="cell_output"><img src="fig.png" {W} '
                         'alt="three points"></div>'
                         + captioned(f'<img src="fig2.png" {W} alt="three points">', " ")),
        "twin.html": ("", '<div class="cell_output"><pre>[interactive widget: block tables. '
                      "Run this cell in Jupyter to use it.]</pre></div>"),
        "menu.html": ("", MENU),
        "nbval.html": ("", '<div class="highlight"><pre># NBVAL_IGNORE_OUTPUT\nprint(1)</pre>'
                       "</div>"),
        "duplicate.html": ("", f'<img src="{pixel}" alt="a"><img src="{pixel}" alt="b">'),
        "noicon.html": (None, "<p>no icon</p>"),
        # a figure shown wider than a phone's screen (its box scrolls), and one served to a
        # phone as its phone variant (a <picture>): only the first fails, at 390 px only
        "toowide.html": (PHONE, '<div class="cell_output" style="overflow-x:auto"><figure>'
                         '<img src="fig.png" style="width:600px;max-width:none" '
                         'alt="three points"><figcaption><p>Wide.</p></figcaption>'
                         "</figure></div>"),
        "picture.html": (PHONE + "<style>img { max-width: 100%; height: auto; }</style>",
                         captioned(
            '<picture><source media="(max-width: 600px)" srcset="phone.png">'
            '<img src="wide.png" width="864" height="288" alt="two panels"></picture>')),
        # page-contents drawers (modal dialogs, as pydata-sphinx-theme opens them): with
        # kvlab.js a pick closes them (and Esc); without, a pick leaves them open
        "drawer.html": (KVLAB_JS, DRAWER),
        "stuckdrawer.html": ("", DRAWER),
        # a phone page (device-width viewport) widened by a name that cannot break
        "wide.html": ('<meta name="viewport" content="width=device-width, initial-scale=1">',
                      '<p>see <code style="white-space:nowrap">'
                      + "EngineArgs._set_default_max_num_seqs_and_batched_tokens_args"
                      + "</code></p>"),
    }
    for name, (extra, body) in pages.items():
        page = HEAD.format(extra=extra or "", body=body)
        if extra is None:
            page = page.replace('<link rel="icon" href="favicon.svg">', "")
        (tmp_path / name).write_text(page)
    (tmp_path / "index.html").write_text(HEAD.format(extra="", body="index"))
    return tmp_path


def test_site_check_detects_each_failure_and_passes_a_clean_page(tmp_path):
    import site_check

    root = _site(tmp_path)
    report = site_check.check_site(root)
    checked, problems, widgets = report.pages, report.problems, report.widgets
    kinds: dict[str, set[str]] = {page: set() for page in checked}
    details: dict[str, list[str]] = {page: [] for page in checked}
    for problem in problems:
        kinds[problem.page].add(problem.kind)
        details[problem.page].append(problem.detail)
    assert kinds["good.html"] == set(), details["good.html"]
    assert kinds["index.html"] == set()
    assert kinds["console.html"] == {"console"}
    assert kinds["image.html"] == {"image", "request", "console"}   # 404 + "Failed to load"
    assert kinds["math.html"] == {"math"}
    assert kinds["widget.html"] == {"widget"}
    assert any("did not run" in d for d in details["widget.html"])
    assert kinds["stuck.html"] == {"widget"}
    assert any("does not change" in d for d in details["stuck.html"])
    assert "request" in kinds["remote.html"]
    assert kinds["clipped.html"] == {"clipped"}
    assert any("cut off (overflow hidden)" in d for d in details["clipped.html"])
    assert kinds["spill.html"] == {"clipped"}
    assert any("past the text column" in d for d in details["spill.html"])
    assert kinds["table.html"] == {"clipped"}
    assert [d for d in details["table.html"] if "table wider" in d]          # at 1280 only
    assert all("1280px" in d for d in details["table.html"] if "table wider" in d)
    assert kinds["wrapped.html"] == {"wrapped"}
    assert kinds["figure.html"] == {"figure"}
    assert len([d for d in details["figure.html"] if "smallest text" in d]) >= 2  # frame + PNG
    assert kinds["undeclared.html"] == {"figure"}
    assert any("declares no text size" in d for d in details["undeclared.html"])
    assert kinds["alt.html"] == {"alt"} and len(details["alt.html"]) == 2
    assert kinds["caption.html"] == {"caption"} and len(details["caption.html"]) == 2
    assert kinds["twin.html"] == {"twin"}
    assert kinds["menu.html"] == {"menu"}
    for width in (1280, 390):
        assert any(f"☰ menu at {width}px" in d for d in details["menu.html"])
        assert any(f"page-contents button at {width}px does nothing" in d
                   for d in details["menu.html"])
    assert kinds["nbval.html"] == {"nbval"}
    assert kinds["duplicate.html"] == {"duplicate"}
    # without a declared icon Chromium asks for /favicon.ico, which 404s: three findings
    assert kinds["noicon.html"] == {"favicon", "request", "console"}
    assert kinds["wide.html"] == {"clipped"}
    assert [d for d in details["wide.html"] if "page scrolls sideways" in d
            and "390px" in d and "on a 390 px screen" in d]
    assert widgets == 4                     # good, widget, stuck and figure pages' widgets
    assert kinds["toowide.html"] == {"figure"}
    assert [d for d in details["toowide.html"] if "wider than" in d and "390px" in d]
    assert not [d for d in details["toowide.html"] if "1280px" in d]
    assert kinds["picture.html"] == set(), details["picture.html"]
    assert kinds["drawer.html"] == set(), details["drawer.html"]
    assert kinds["stuckdrawer.html"] == {"menu"}
    assert any("stays open after a pick" in d for d in details["stuckdrawer.html"])
    visible, fitting, _ = report.figures(390)
    assert 0 < fitting < visible
    assert all(row["bytes"] > 0 for row in report.seen[1280].values())
    # the search page from disk: summaries come from kvlab-search-pages.js, no console error
    assert not [p for p in problems if p.page.startswith("search.html")]


def test_search_from_disk_without_the_page_texts_fails(tmp_path):
    import site_check

    (tmp_path / "favicon.svg").write_text("<svg xmlns='http://www.w3.org/2000/svg'/>")
    (tmp_path / "good.html").write_text('<div role="main">a good page</div>')
    (tmp_path / "search.html").write_text(SEARCH.format(js=""))
    driver = site_check.start_browser(390)
    try:
        problems = site_check.check_search_from_disk(driver, tmp_path)
    finally:
        driver.quit()
    kinds = {p.kind for p in problems}
    assert kinds == {"search", "console"}, problems          # fetch refused on file://
