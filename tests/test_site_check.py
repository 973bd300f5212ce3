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


def _widget_html(*, with_script: bool = True) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.kernel_free import static_widget

    def draw(n):
        fig, ax = plt.subplots(figsize=(2, 1))
        ax.bar(range(n), range(1, n + 1))
        return fig

    html = static_widget(draw, {"n": [1, 2, 3]}, default={"n": 2}).to_html()
    return html if with_script else re.sub(r"<script>.*?</script>", "", html, flags=re.S)


def _site(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "_static" / "favicon.svg", tmp_path / "favicon.svg")
    shutil.copy(ROOT / "_static" / "vendor" / "mathjax-3.2.2" / "tex-svg.js",
                tmp_path / "tex-svg.js")
    pixel = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
             "nGNgYPj/HwADAgH/eL9GtQAAAABJRU5ErkJggg==")
    pages = {
        "good.html": (MATHJAX, '<p><span class="math">\\(x^2 + 1\\)</span></p>'
                      '<div class="highlight"><pre>short line</pre></div>' + _widget_html()),
        "console.html": ("", "<script>console.error('boom')</script>"),
        "image.html": ("", '<img src="missing.png" alt="x">'),
        "math.html": ("", '<span class="math">\\(y\\)</span>'),
        "widget.html": ("", _widget_html(with_script=False)),
        "remote.html": ('<script src="http://127.0.0.1:9/cdn.js"></script>', "<p>x</p>"),
        "clipped.html": ("", '<div class="highlight"><pre style="width:200px;overflow:auto;'
                         'white-space:pre">' + "x" * 400 + "</pre></div>"),
        "nbval.html": ("", '<div class="highlight"><pre># NBVAL_IGNORE_OUTPUT\nprint(1)</pre>'
                       "</div>"),
        "duplicate.html": ("", f'<img src="{pixel}" alt="a"><img src="{pixel}" alt="b">'),
        "noicon.html": (None, "<p>no icon</p>"),
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
    for problem in problems:
        kinds[problem.page].add(problem.kind)
    assert kinds["good.html"] == set(), [str(p) for p in problems if p.page == "good.html"]
    assert kinds["index.html"] == set()
    assert kinds["console.html"] == {"console"}
    assert kinds["image.html"] == {"image", "request", "console"}   # 404 + "Failed to load"
    assert kinds["math.html"] == {"math"}
    assert kinds["widget.html"] == {"widget"}
    assert "request" in kinds["remote.html"]
    assert kinds["clipped.html"] == {"clipped"}
    assert kinds["nbval.html"] == {"nbval"}
    assert kinds["duplicate.html"] == {"duplicate"}
    # without a declared icon Chromium asks for /favicon.ico, which 404s: three findings
    assert kinds["noicon.html"] == {"favicon", "request", "console"}
    widget_problems = [p.detail for p in problems if p.page == "widget.html"]
    assert any("did not run" in d for d in widget_problems)
    assert any("does not change" in d for d in widget_problems)
    assert widgets == 2                              # good.html's and widget.html's
