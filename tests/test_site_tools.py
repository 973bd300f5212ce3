"""Kernel-free widgets, the chapter install cell and the site extension's helpers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "_ext"))


def _bars(n):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.bar(range(n), range(1, n + 1))
    return fig


def test_static_widget_frames_controls_and_errors():
    from kvlab.viz.kernel_free import dropdown, spread, static_widget

    kf = static_widget(lambda n, c: _bars(n), {"n": [1, 2, 3], "c": dropdown(["a", "b"])},
                       default={"n": 2, "c": "b"}, caption=lambda n, c: f"n={n} c={c}")
    assert [f.key for f in kf.frames] == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    assert kf.default_key == "1-1" and kf.frames[3].caption == "n=2 c=b"
    assert len({f.png for f in kf.frames[::2]}) == 3       # different n, different picture
    html = kf.to_html()
    visible = re.findall(r'data-kf-key="([\d-]+)"(?! hidden)>', html)
    assert visible == ["1-1"]                                # only the default shows without JS
    assert 'type="range"' in html and "<select" in html and "http" not in html
    bundle = kf._repr_mimebundle_()
    assert set(bundle) == {"text/html", "text/plain"}
    assert "run this cell" in bundle["text/plain"].lower()
    with pytest.raises(ValueError, match="max_frames"):
        static_widget(lambda n: _bars(n), {"n": range(10)}, max_frames=5)
    with pytest.raises(ValueError, match="not one of"):
        static_widget(lambda n: _bars(n), {"n": [1, 2]}, default={"n": 7})
    with pytest.raises(ValueError, match="unknown controls"):
        static_widget(lambda n: _bars(n), {"n": [1, 2]}, default={"m": 1})
    assert spread(100, 5, include=[37]) == [0, 25, 37, 50, 74, 99]
    assert spread(3, 10) == [0, 1, 2]


def test_chapter_widget_bundle_text_fallback_and_export(monkeypatch):
    from kvlab.viz.blocks import RefcountView, fork_scenario
    from kvlab.viz.kernel_free import EXPORT_ENV

    view = RefcountView(fork_scenario(n=2))
    box = view.widget()
    monkeypatch.delenv(EXPORT_ENV, raising=False)
    bundle = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "VBox" not in bundle["text/plain"] and "run this cell" in bundle["text/plain"].lower()
    assert "text/html" not in bundle                         # no export cost in a live session
    monkeypatch.setenv(EXPORT_ENV, "1")
    html = box._repr_mimebundle_()["text/html"]
    assert html.count('class="kvlab-kf-frame"') == len(view.steps)


def _run_install_cell(monkeypatch, missing: set[str]) -> list[tuple[str, str]]:
    """Execute the chapter install cell with a fake IPython; return the magics it ran."""
    import importlib.util

    import install_cell
    from IPython.core.inputtransformer2 import TransformerManager

    calls: list[tuple[str, str]] = []

    class Shell:
        def run_line_magic(self, name, line):
            calls.append((name, line))

        def system(self, cmd):
            calls.append(("!", cmd))

        def getoutput(self, cmd):  # pragma: no cover - older IPython spells ! this way
            calls.append(("!", cmd))

        def var_expand(self, cmd, depth=0):
            return cmd

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else real(name, *a))
    before = list(sys.path)
    code = TransformerManager().transform_cell(install_cell.CELL)
    try:
        exec(compile(code, "<install cell>", "exec"), {"get_ipython": lambda: Shell()})
    finally:
        sys.path[:] = before
    return calls


def test_install_cell_is_first_everywhere_and_installs_only_when_missing(monkeypatch):
    import install_cell

    for source in sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.md")):
        first = jupytext.read(source).cells[0]
        assert first.source.strip() == install_cell.CELL.strip(), source.name
        assert first.metadata.get("tags") == ["remove-cell"], source.name
    assert _run_install_cell(monkeypatch, set()) == []     # kvlab importable: nothing runs
    calls = _run_install_cell(monkeypatch, {"kvlab"})
    assert [c[0] for c in calls] == ["!", "pip"]
    assert calls[0][1].startswith("git clone") and install_cell.REPO_URL in calls[0][1]
    assert "--editable" in calls[1][1] and "kvlab-src" in calls[1][1]
    calls = _run_install_cell(monkeypatch, {"kvlab", "torch"})
    assert [c[0] for c in calls] == ["pip", "!", "pip"]
    assert install_cell.TORCH_PIN in calls[0][1] and "whl/cpu" in calls[0][1]


def test_site_extension_cleans_scripts_and_nbval_markers():
    from types import SimpleNamespace

    import kvlab_site

    def js(filename="", **attributes):
        return SimpleNamespace(filename=filename, attributes=attributes)

    scripts = [js("_static/vendor/mathjax-3.2.2/tex-svg.js?v=1", defer="defer"),
               js("", body='const THEBE_JS_URL = "x"'), js("", body='const THEBE_JS_URL = "x"'),
               js("https://cdnjs.cloudflare.com/ajax/libs/require.js/2.3.4/require.min.js"),
               js("_static/vendor/mathjax-3.2.2/tex-svg.js?v=1"), js("_static/doctools.js"),
               js("", type="application/vnd.jupyter.widget-state+json", body="{}"),
               js("_static/sphinx-thebe.js")]
    kept = kvlab_site.clean_scripts(scripts)
    assert [s.filename for s in kept] == ["_static/vendor/mathjax-3.2.2/tex-svg.js?v=1",
                                          "_static/doctools.js"]
    assert kept[0].attributes == {"defer": "defer"}
    text = "# NBVAL_IGNORE_OUTPUT\nimport json\n  # NBVAL_SKIP\nx = 1  # NBVAL_ not a marker\n"
    assert kvlab_site.strip_nbval_markers(text) == "import json\nx = 1  # NBVAL_ not a marker\n"
