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
MATHJAX = '<script defer src="tex-svg.js"></script>'


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
    """A figure as a notebook output stores it (kvlab.viz.style.figure_output_png)."""
    import base64

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.style import figure_output_png

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


def _site(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "_static" / "favicon.svg", tmp_path / "favicon.svg")
    shutil.copy(ROOT / "_static" / "vendor" / "mathjax-3.2.2" / "tex-svg.js",
                tmp_path / "tex-svg.js")
    _output_png(tmp_path / "fig.png")
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
    checked, problems, widgets = site_check.check_site(root)
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
