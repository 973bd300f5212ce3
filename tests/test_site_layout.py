"""The book's pages fit a phone, and its citations name one work each.

* long inline code (command-line flags, CamelCase names) can break where a reader would break
  it, and copies unchanged (``break_long_literals`` in ``docs/_ext/kvlab_site.py``);
* ``docs/_static/kvlab.css`` keeps math and the previous / next links from being cut by the theme's
  ``overflow: hidden``;
* with the citation styles ``book.yml`` selects (``docs/_ext/kvlab_bib.py``), no two bibliography
  entries print the same in-text citation, each citation reads as its entry's label, and every
  key a chapter cites is in ``docs/references.bib``;
* in headless Chromium at 390 and 360 px (skipped without chromium, chromium-driver and
  selenium), a page with the theme's stylesheet and kvlab.css shows a long inline formula, a
  long display equation, a long flag and a long previous / next title without cutting any.
"""

from __future__ import annotations

import html
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
sys.path.insert(0, str(ROOT / "tools"))

CSS = ROOT / "docs" / "_static" / "kvlab.css"
WBR = re.compile(r"<wbr>")


def _pre(text: str) -> str:
    return f'<code class="docutils literal notranslate"><span class="pre">{text}</span></code>'


# ---------------------------------------------------------------------------- long literals


def test_long_flags_break_after_their_inner_hyphens_and_copy_unchanged():
    import kvlab_site

    flags = ["--disaggregation-decode-allocation-policy", "--speculative-accept-threshold-single",
             "--disaggregation-enable-kv-checksum"]
    for flag in flags:
        body = f"<p>the {_pre(flag)} flag</p>"
        out = kvlab_site.break_long_literals(body)
        assert WBR.sub("", out) == body                     # the text a reader copies
        words = flag[2:].split("-")
        assert out.count("<wbr>") == len(words) - 1, out    # after each inner hyphen ...
        assert "--" + "-<wbr>".join(words) in out           # ... never after the leading "--"
    out = kvlab_site.break_long_literals(_pre("--max-num-batched-tokens=-1"))
    assert "tokens=-1" in out                               # a minus sign is not a hyphen
    out = kvlab_site.break_long_literals(_pre("a--b---c-long-enough"))
    assert "a--<wbr>b---<wbr>c-<wbr>long-<wbr>enough" in out   # a run of hyphens: once, after


def test_only_long_camelcase_runs_break_at_their_humps():
    import kvlab_site

    body = _pre("SchedulerDisaggregationPrefillMixin._send_kv_chunk")
    out = kvlab_site.break_long_literals(body)
    assert WBR.sub("", out) == body
    assert out.startswith('<code class="docutils literal notranslate"><span class="pre">'
                          "Scheduler<wbr>Disaggregation<wbr>Prefill<wbr>Mixin._<wbr>send_")
    # a name short enough to fit a phone's column keeps its humps whole
    out = kvlab_site.break_long_literals(_pre("DecodePreallocQueue.pop"))
    assert "DecodePreallocQueue.<wbr>pop" in out
    # entities are never split
    out = kvlab_site.break_long_literals(_pre("&quot;ProductionReadyServingEngineConfig&quot;"))
    assert "&quot;" in out and "&q<wbr>" not in out and WBR.sub("", out).count("&quot;") == 2


# ---------------------------------------------------------------------------- stylesheet


def _rules(css: str) -> dict[str, str]:
    """selector -> declarations, comments dropped, @media blocks flattened (with the query
    prefixed to the selector)."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    rules: dict[str, str] = {}
    for media, inner in re.findall(r"(@media[^{]+)\{((?:[^{}]*\{[^{}]*\})*)\s*\}", css):
        for selector, body in re.findall(r"([^{}]+)\{([^{}]*)\}", inner):
            for one in selector.split(","):
                rules[media.strip() + " " + " ".join(one.split())] = " ".join(body.split())
    css = re.sub(r"@media[^{]+\{(?:[^{}]*\{[^{}]*\})*\s*\}", "", css)
    for selector, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css):
        for one in selector.split(","):
            rules.setdefault(" ".join(one.split()), "")
            rules[" ".join(one.split())] += " " + " ".join(body.split())
    return rules


def test_stylesheet_keeps_math_and_prev_next_links_uncut():
    rules = _rules(CSS.read_text())
    # inline math: the theme's overflow: hidden cut a formula wider than the column
    assert "overflow-x: auto" in rules["span.math"]
    assert "fitMath" in (CSS.parent / "kvlab.js").read_text()             # shrinks to fit
    assert "max-width: 100%" in rules["span.math mjx-assistive-mml"]
    # display math scrolls inside its box, with edge shadows that show there is more
    display = rules['div.math mjx-container[display="true"]']
    assert "overflow-x: auto" in display and "min-width: 0" in display
    assert "local" in display and "scroll" in display
    # previous / next: the text may shrink, the chevron may not; a phone gives each link the row
    assert "min-width: 0" in rules[".prev-next-area a .prev-next-info"]
    assert "flex-shrink: 0" in rules[".prev-next-area a i"]
    phone = [body for selector, body in rules.items()
             if selector.startswith("@media (max-width: 575.98px)")
             and selector.endswith(".prev-next-area a")]
    assert phone and "max-width: 100%" in phone[0]


# ---------------------------------------------------------------------------- citations


def _book_config() -> dict:
    return yaml.safe_load((ROOT / "book.yml").read_text())["sphinx"]


def _citations():
    """(key, bibliography label, parenthetical text, textual text) of every bib entry, with
    the styles book.yml selects."""
    import pybtex.plugin
    from pybtex.database import parse_file
    from sphinxcontrib.bibtex.plugin import find_plugin
    from sphinxcontrib.bibtex.style.referencing import format_references
    from sphinxcontrib.bibtex.style.template import SphinxReferenceInfo

    config = _book_config()
    for name in config["local_extensions"]:     # registers the book's styles
        module = __import__(name)
        if hasattr(module, "register"):
            module.register()
    settings = config["config"]
    style = pybtex.plugin.find_plugin(
        "pybtex.style.formatting", settings.get("bibtex_default_style", "alpha"))()
    referencing = find_plugin("sphinxcontrib.bibtex.style.referencing",
                              settings["bibtex_reference_style"])()
    entries = style.sort(parse_file(ROOT / "docs" / "references.bib").entries.values())
    info = SphinxReferenceInfo(None, "a", "bibliography", "id1", None, "", "")
    out = []
    for label, entry in zip(style.format_labels(entries), entries, strict=True):
        formatted = style.format_entry(label, entry)
        refs = [(entry, formatted, info)]
        out.append((entry.key, formatted.label,
                    str(format_references(referencing, "p", refs)),
                    str(format_references(referencing, "t", refs))))
    return out


def test_no_two_works_share_an_in_text_citation():
    citations = _citations()
    by_text: dict[str, list[str]] = {}
    for key, _label, parenthetical, _textual in citations:
        by_text.setdefault(parenthetical, []).append(key)
    shared = {text: keys for text, keys in by_text.items() if len(keys) > 1}
    assert not shared, f"works cited alike: {shared}"
    texts = {key: (label, p, t) for key, label, p, t in citations}
    # the citation is the bibliography's label, so a reader finds the entry by what the text says
    for key, (label, parenthetical, _textual) in texts.items():
        assert parenthetical == f"[{label}]", key
    # works by one author in one year: a, b, ... in the bibliography's order (by title)
    same = [key for key, label, _, _ in citations if label.startswith("The vLLM project, 2025")]
    assert len(same) >= 2 and "vllm" in same and "vllmspecdecode" in same
    assert [texts[key][0][-1] for key in same] == [chr(ord("a") + i) for i in range(len(same))]
    assert texts["vllm2024specguided"][1] == "[The vLLM project, 2024]"   # alone: no letter
    assert texts["sglang"][2] == "The SGLang project [2025b]"             # {cite:t}
    assert texts["kwon2023pagedattention"][1] == "[Kwon et al., 2023]"
    assert texts["chowdhery2023palm"][1] == "[Chowdhery et al., 2023]"    # "and others"
    # the bibliography lists entries in the order of their labels (organisations by name)
    labels = [label.casefold() for _key, label, _p, _t in citations]
    assert labels == sorted(labels)


def test_every_cited_key_is_in_the_bibliography():
    from pybtex.database import parse_file

    keys = set(parse_file(ROOT / "docs" / "references.bib").entries)
    cited: dict[str, set[str]] = {}
    for source in sorted((ROOT / "notebooks").glob("*.md")):
        for group in re.findall(r"\{cite(?::[a-z]+)?\}`([^`]+)`", source.read_text()):
            for key in group.split(","):
                cited.setdefault(key.strip(), set()).add(source.name)
    assert cited, "no citations found"
    missing = {key: sorted(where) for key, where in cited.items() if key not in keys}
    assert not missing


# ---------------------------------------------------------------------------- in a browser

_BROWSER = (shutil.which("chromedriver") is not None and shutil.which("chromium") is not None
            and importlib.util.find_spec("selenium") is not None)

_PAGE = """<!doctype html><html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<link rel="stylesheet" href="pst.css"><link rel="stylesheet" href="kvlab.css">
<style>span.pre {{ white-space: nowrap; hyphens: none; }}
  article {{ padding: 0 1rem; }} .admonition {{ padding: 0 .6rem; }}</style>
<script src="kvlab.js"></script>
<script>window.MathJax = {{loader: {{load: ["input/tex-base", "output/chtml"]}}}};</script>
<script defer src="mathjax/startup.js"></script></head><body>
<article class="bd-article">
<p>A step costs <span class="math notranslate nohighlight">
\\(\\max(\\mathrm{{FLOPs}}/\\mathrm{{peak}},
\\ \\mathrm{{bytes}}/\\mathrm{{bandwidth}}) + 0.5\\,\\mathrm{{ms}}\\)</span> for Llama 3 8B.</p>
<div class="math notranslate nohighlight">\\[P(\\text{{emit }} x) = \\min(p(x), q(x)) + (1-\\beta)
\\frac{{p(x) - \\min(p(x), q(x))}}{{1 - \\beta}} = p(x).\\]</div>
<div class="admonition"><p>{flag} and {mixin} in an admonition.</p></div>
</article>
<footer class="prev-next-footer"><div class="prev-next-area">
<a class="left-prev" href="#"><i class="fa-solid fa-angle-left">&lt;</i>
<div class="prev-next-info"><p class="prev-next-subtitle">previous</p>
<p class="prev-next-title">8. Group quantization</p></div></a>
<a class="right-next" href="#"><div class="prev-next-info">
<p class="prev-next-subtitle">next</p><p class="prev-next-title">10. Prefill/decode
disaggregation</p></div><i class="fa-solid fa-angle-right">&gt;</i></a>
</div></footer></body></html>"""

# content cut: a box that hides overflow and is narrower than its content; something out of
# the viewport with no scrolling box around it; display math that cannot scroll to its end;
# inline math not shown whole
_MEASURE = """
const done = arguments[arguments.length - 1];
MathJax.startup.promise.then(() => setTimeout(() => {   // kvlab.js has fitted the math
  const vw = document.documentElement.clientWidth, out = [];
  const style = el => getComputedStyle(el);
  const scrolls = el => ['auto', 'scroll'].includes(style(el).overflowX);
  const name = el => el.tagName.toLowerCase() + '.' + (el.getAttribute('class') || '') + ' "'
    + el.textContent.trim().replace(/\\s+/g, ' ').slice(0, 40) + '"';
  for (const el of document.querySelectorAll('article *, footer *')) {
    if (el.closest('mjx-assistive-mml') || !el.getClientRects().length) continue;
    const s = style(el);
    if (['hidden', 'clip'].includes(s.overflowX) && el.scrollWidth > el.clientWidth + 1)
      out.push('cut by overflow hidden: ' + name(el) + ' ' + el.scrollWidth + ' > '
               + el.clientWidth);
    let box = el.parentElement;
    while (box && !scrolls(box)) box = box.parentElement;
    const r = el.getBoundingClientRect();
    if (!box && r.width && (r.right > vw + 1 || r.left < -1))
      out.push('outside the ' + vw + ' px screen: ' + name(el) + ' ' + Math.round(r.left)
               + '..' + Math.round(r.right));
  }
  for (const m of document.querySelectorAll('.math mjx-container')) {
    const svg = m.querySelector('mjx-math').getBoundingClientRect().width;
    let box = m; while (box && !scrolls(box)) box = box.parentElement;
    if (!box && svg > m.getBoundingClientRect().width + 1)
      out.push('math wider than its box and no scrolling: ' + name(m));
    if (box && box.scrollWidth + 1 < svg) out.push('math scrolls short of its end: ' + name(m));
  }
  for (const m of document.querySelectorAll('span.math')) {   // inline math shows whole
    const svg = m.querySelector('mjx-math').getBoundingClientRect(),
          r = m.getBoundingClientRect();
    if (svg.right > r.right + 1) out.push('inline math not shown whole: ' + name(m));
  }
  done(out);
}, 200));
"""


@pytest.mark.skipif(not _BROWSER, reason="needs chromium, chromium-driver and selenium")
def test_phone_widths_cut_no_math_code_or_link(tmp_path):
    import kvlab_site
    import pydata_sphinx_theme
    import site_check

    theme = Path(pydata_sphinx_theme.__file__).parent
    shutil.copy(next(theme.rglob("styles/pydata-sphinx-theme.css")), tmp_path / "pst.css")
    shutil.copy(CSS, tmp_path / "kvlab.css")
    shutil.copy(CSS.parent / "kvlab.js", tmp_path / "kvlab.js")
    shutil.copytree(ROOT / "docs" / "_static" / "vendor" / "mathjax-3.2.2", tmp_path / "mathjax")
    body = _PAGE.format(flag=_pre("--disaggregation-decode-allocation-policy"),
                        mixin=_pre("SchedulerDisaggregationPrefillMixin._send_kv_chunk"))
    (tmp_path / "index.html").write_text(kvlab_site.break_long_literals(body))
    driver = site_check.start_browser()
    try:
        with site_check.serve(tmp_path) as base:
            found = {}
            for width in (1280, 390, 360):
                site_check.set_viewport(driver, width)
                driver.get(base + "index.html")
                found[width] = driver.execute_async_script(_MEASURE)
    finally:
        driver.quit()
    assert found == {1280: [], 390: [], 360: []}, html.unescape(str(found))
