"""Sphinx extension for the kvlab book: pages that load offline with no console errors.

Loaded through ``book.yml`` (``sphinx.local_extensions``). On every HTML page it

* drops scripts the book does not need and that would reach the network: anything loaded from
  another origin (the ipywidgets CDN embed, require.js), the thebe configuration and loader (the
  book offers no live-code button), and the ipywidgets state blob (the site shows each widget's
  kernel-free twin instead, so the state would only add page weight);
* keeps one copy of each script: Sphinx's MathJax support and myst-nb both add ``tex-svg.js``
  (once with ``defer``, once without), and sphinx-thebe declares ``THEBE_JS_URL`` twice;
* defines the theme's colour mode (pydata-sphinx-theme logs a console error without it);
* hides the nbval markers (``# NBVAL_IGNORE_OUTPUT`` and friends) from rendered code cells: they
  steer the notebook tests and mean nothing to a reader;
* gives a notebook's output figure the alt text its PNG carries (what the figure shows, written
  by :func:`kvlab.viz.kernel_free.render_figure`) where the page would otherwise use its file
  path, and serves its phone variant (carried in the PNG's ``kvPh`` chunk,
  :func:`kvlab.viz.kernel_free.add_phone_chunk`) to narrow screens in a ``<picture>``; a figure
  that has no phone layout gets a line saying that a tap opens it full size;
* moves the frames of kernel-free widgets out of the page into image files: a page loads the
  frames it shows (a ``<picture>`` loads one of its two variants; hidden frames are lazy), not
  every frame of every widget as base64 text; a frame with no phone layout opens full size on
  tap like a static figure;
* drops the Font Awesome script (1.5 MB: it turns each icon into an inline SVG) and serves the
  theme's icon fonts instead, cut down to the glyphs the site uses (``_static/kvlab-icons.css``,
  written when the build finishes); drops MathJax from pages with no math;
* makes search summaries work from a copy opened from disk (``file://``), where the browser
  refuses the page fetches Sphinx's search makes: ``_static/kvlab.js`` answers them from
  ``_static/kvlab-search-pages.js``, the pages' text written when the build finishes;
* closes the page-contents and chapter drawers after a pick and on Esc (``_static/kvlab.js``);
* lets long inline code (file paths, dotted names, command-line flags) break after ``/``,
  ``.``, ``_`` and the hyphens inside a word, and between the humps of a CamelCase run too long
  for a phone's column: the "In real systems" tables fit the column instead of scrolling
  sideways, and on a phone a long name in prose
  (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``,
  ``--disaggregation-decode-allocation-policy``, ``SchedulerDisaggregationPrefillMixin``) is
  not cut at the screen's edge. The breaks are ``<wbr>`` elements: copied text is unchanged.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from docutils import nodes
from PIL import Image

from kvlab.viz.kernel_free import (
    PNG_DESCRIPTION,
    PNG_MIN_TEXT,
    SCALE,
    phone_media,
    split_phone_chunk,
)

NBVAL_MARKER = re.compile(r"^[ \t]*# NBVAL_[A-Z_]+[ \t]*\n", re.M)
_REMOTE = re.compile(r"^(?:[a-z]+:)?//", re.I)
_DROP_BODY = ("THEBE_JS_URL",)
_DROP_FILES = ("sphinx-thebe.js", "fontawesome.js")
_DROP_TYPES = ("application/vnd.jupyter.widget-state+json",)


def strip_nbval_markers(text: str) -> str:
    """``text`` without the lines that are only an nbval marker comment."""
    return NBVAL_MARKER.sub("", text)


def _script_key(script: Any) -> str:
    filename = str(getattr(script, "filename", script) or "")
    if filename:
        return "file:" + filename.split("?", 1)[0]
    return "body:" + str(getattr(script, "attributes", {}).get("body", ""))


def keep_script(script: Any) -> bool:
    """False for a script the book's pages must not load (see the module docstring)."""
    filename = str(getattr(script, "filename", script) or "")
    attributes = getattr(script, "attributes", {}) or {}
    body = str(attributes.get("body", ""))
    if filename and _REMOTE.match(filename):
        return False
    if any(filename.endswith(name) for name in _DROP_FILES):
        return False
    if attributes.get("type") in _DROP_TYPES:
        return False
    return not any(marker in body for marker in _DROP_BODY)


def clean_scripts(scripts: list) -> list:
    """``scripts`` filtered by :func:`keep_script`, first copy of each file or body kept."""
    seen: set[str] = set()
    kept = []
    for script in scripts:
        key = _script_key(script)
        if key in seen or not keep_script(script):
            continue
        seen.add(key)
        kept.append(script)
    return kept


_PRE_SPAN = re.compile(r'(<span class="pre">)([^<]{13,})(</span>)')
# after a "/", "." or "_" (not inside a run of them), and after the hyphens between two word
# characters: "--disaggregation-decode" breaks as "--disaggregation-|decode", never after its
# leading "--" nor inside "x=-1"
_BREAK_AFTER = re.compile(r"([/._](?=[^/._])|(?<=\w)-+(?=\w))")
# a run with no break opportunity that is longer than this (about 210 px of inline code) may
# also break before each capital that follows a lower-case letter (Scheduler|Disaggregation)
_LONG_RUN = 24
_RUN = re.compile(r"[^/._\-&;]{" + str(_LONG_RUN) + ",}")
_HUMP = re.compile(r"(?<=[a-z])(?=[A-Z])")


def break_long_literals(body: str) -> str:
    """``body`` with a ``<wbr>`` after each ``/``, ``.``, ``_`` and inner hyphen of its long
    inline-code words, and at the humps of a CamelCase run of ``_LONG_RUN`` characters or more
    (in prose and tables; code blocks, which have no ``<span class="pre">``, keep their lines).
    A ``<wbr>`` has no text: what a reader copies is unchanged."""

    def literal(match: re.Match) -> str:
        text = _RUN.sub(lambda run: _HUMP.sub("<wbr>", run[0]), match[2])
        return match[1] + _BREAK_AFTER.sub(r"\1<wbr>", text) + match[3]

    return _PRE_SPAN.sub(literal, body)


def png_text(path: str | Path) -> dict[str, str]:
    """The text chunks of the PNG at ``path`` (empty when it has none or cannot be read)."""
    try:
        with Image.open(path) as image:
            return {str(k): str(v) for k, v in getattr(image, "text", {}).items()}
    except (OSError, ValueError):
        return {}


@dataclass(frozen=True)
class PhoneFigure:
    """A notebook figure's phone variant (None: it has none) and the wide one's size."""

    png: bytes | None
    fits: bool          # False: no phone layout, the wide figure is shown scaled
    width: int          # the wide figure's CSS size and smallest text (image px)
    min_text_px: float


# image file name -> its phone variant, filled while a page's doctree is resolved and used when
# its HTML is written (both happen in the process that writes the page)
_PHONE: dict[str, PhoneFigure] = {}
_IMG = re.compile(r'<img\b[^>]*?\bsrc="([^"]*?/([^"/]+)\.png)"[^>]*?/?>')
_STYLE_SIZE = re.compile(r' style="width: (\d+)px; height: (\d+)px;"')
#: The line under a figure that has no phone layout (shown on narrow screens only).
ZOOM_NOTE = "Too wide to read on this screen: tap the figure to open it full size."


def _zoom_note(tag: str = "span") -> str:
    return f'<{tag} class="kvlab-zoom-note">{ZOOM_NOTE}</{tag}>'


def add_phone_variants(body: str, figures: dict[str, PhoneFigure], write) -> str:
    """``body`` with each figure that has a phone variant in a ``<picture>`` whose
    ``<source>`` serves it to narrow screens (``write(name, png)`` stores the variant and
    returns its URL), its size as attributes instead of an inline style (so the source's
    size applies), and a note under each figure that has no phone layout."""

    def img(match: re.Match) -> str:
        tag, name = match[0], match[2]
        info = figures.get(name + ".png")
        if info is None:
            return tag
        tag = _STYLE_SIZE.sub(r' width="\1" height="\2"', tag)
        if info.png is not None:
            with Image.open(io.BytesIO(info.png)) as image:
                width, height = (round(n / SCALE) for n in image.size)
            url = write(name + "-phone.png", info.png)
            tag = (f'<picture><source media="{phone_media(info.width, info.min_text_px)}" '
                   f'srcset="{url}" width="{width}" height="{height}">{tag}</picture>')
        elif not info.fits:
            tag += _zoom_note()
        return tag

    return _IMG.sub(img, body)


_DATA_PNG = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=]+)")
_NO_PHONE_FRAME = re.compile(r'<img src="([^"]+)"[^>]*\bdata-phone="none"[^>]*>')


def extract_frames(body: str, write) -> str:
    """``body`` with every PNG data URI (the frames of kernel-free widgets) replaced by the URL
    ``write(name, png)`` returns for it, named by its content, and each frame with no phone
    layout in a link that opens it full size, with a note (on narrow screens)."""

    def frame(match: re.Match) -> str:
        png = base64.b64decode(match[1])
        return write(f"kf-{hashlib.sha256(png).hexdigest()[:20]}.png", png)

    body = _DATA_PNG.sub(frame, body)
    return _NO_PHONE_FRAME.sub(
        lambda m: (f'<a class="kvlab-zoom" href="{m[1]}" target="_blank" rel="noopener">'
                   f"{m[0]}</a>{_zoom_note()}"), body)


def _writer(app, pagename: str, context):
    """``write(name, png)``: store ``png`` as ``_images/name`` in the build (once) and return
    its URL relative to the page."""
    images = Path(app.outdir) / "_images"

    def write(name: str, png: bytes) -> str:
        path = images / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(png)
        return context["pathto"](f"_images/{name}", 1)

    return write


def _page_context(app, pagename, templatename, context, doctree) -> None:
    # pydata-sphinx-theme reads the colour mode from this template variable; left undefined,
    # every first visit logs "Got invalid theme mode" as a console error.
    context.setdefault("default_mode", "auto")
    body = context.get("body", "")
    if "script_files" in context:
        # Jupyter Book adds every .js under _static to every page: MathJax's components are
        # loaded by its loader (mathjax_path), on pages with math only
        scripts = [s for s in clean_scripts(context["script_files"])
                   if not is_mathjax(s) or _is_loader(s, app.config.mathjax_path)]
        if 'class="math' not in body:
            scripts = [s for s in scripts if not is_mathjax(s)]
        context["script_files"] = scripts
    if body:
        write = _writer(app, pagename, context)
        body = add_phone_variants(break_long_literals(body), _PHONE, write)
        context["body"] = extract_frames(body, write)


def is_mathjax(script: Any) -> bool:
    """True for MathJax's scripts and its configuration."""
    filename = str(getattr(script, "filename", script) or "")
    body = str((getattr(script, "attributes", {}) or {}).get("body", ""))
    return "mathjax" in filename.lower() or "window.MathJax" in body


def _is_loader(script: Any, mathjax_path: str) -> bool:
    filename = str(getattr(script, "filename", script) or "").split("?", 1)[0]
    return not filename or filename.endswith(mathjax_path)


_FONTAWESOME_TAG = re.compile(r'<script[^>]*\bsrc="[^"]*/scripts/fontawesome\.js[^"]*"[^>]*>'
                              r"\s*</script>\s*")


def _drop_fontawesome_script(outdir: Path) -> None:
    """The theme writes its Font Awesome script into its page template, not into the page's
    script list: it is taken out of the written pages (the icon fonts draw the icons)."""
    for path in outdir.rglob("*.html"):
        page = path.read_text()
        cleaned = _FONTAWESOME_TAG.sub("", page)
        if cleaned != page:
            path.write_text(cleaned)


def _doctree_resolved(app, doctree, docname) -> None:
    for block in list(doctree.findall(nodes.literal_block)):
        text = block.astext()
        stripped = strip_nbval_markers(text)
        if stripped != text:  # rawsource must equal the text, or Sphinx skips highlighting
            block.children = []
            block.append(nodes.Text(stripped))
            block.rawsource = stripped
    for image in doctree.findall(nodes.image):
        uri = image.get("uri", "")
        if not uri.lower().endswith(".png") or "://" in uri:
            continue
        # myst-nb's output images: ``candidates`` holds the path relative to the source folder
        source = Path(app.srcdir) / image.get("candidates", {}).get("*", uri)
        text = png_text(source)
        if text.get(PNG_DESCRIPTION) and (not image.get("alt") or image["alt"] == uri):
            image["alt"] = text[PNG_DESCRIPTION]
        try:
            width = int(str(image.get("width", "0")).removesuffix("px"))
            _, phone, fits = split_phone_chunk(source.read_bytes())
        except (OSError, ValueError):
            continue
        if phone is not None or not fits:
            _PHONE[Path(uri).name] = PhoneFigure(phone, fits, width,
                                                 float(text.get(PNG_MIN_TEXT, 0)))


# -- when the build is done: images without their phone chunk, icon fonts, search texts --

def _strip_phone_chunks(outdir: Path) -> None:
    """The wide PNGs as served: without the phone variant they carry (served on its own)."""
    for path in (outdir / "_images").glob("*.png"):
        png = path.read_bytes()
        wide = split_phone_chunk(png)[0]
        if wide != png:
            path.write_bytes(wide)


_ICON_RULE = re.compile(r'((?:\.fa-[a-z0-9-]+:before,?)+)\{content:"\\([0-9a-f]+)"\}')
_ICON_NAME = re.compile(r"\bfa-[a-z0-9-]+")
#: The theme's Font Awesome faces: (CSS family, weight, file name in its webfonts folder).
ICON_FACES = (("Font Awesome 6 Free", 900, "fa-solid-900.ttf"),
              ("Font Awesome 6 Free", 400, "fa-regular-400.ttf"),
              ("Font Awesome 6 Brands", 400, "fa-brands-400.ttf"))


_PRIVATE_USE = re.compile("[\ue000-\uf8ff]")


def icon_font_css(theme_css: str, used: set[str], fonts: Path) -> str:
    """``@font-face`` rules that replace the theme's Font Awesome fonts by subsets holding
    only the glyphs of the icon classes in ``used`` (``fa-bars``, ...) and those the theme's
    stylesheet draws itself (admonition and link icons, written as the glyph's character),
    as data URIs (a few KB; they load from a copy on disk too). A glyph missing from a subset
    would make the browser fetch the theme's whole font as well."""
    from fontTools import subset
    from fontTools.ttLib import TTFont

    codepoints = {ord(c) for c in _PRIVATE_USE.findall(theme_css)}
    for rule in _ICON_RULE.finditer(theme_css):
        names = {name.removesuffix(":before").lstrip(".") for name in rule[1].split(",") if name}
        if names & used:
            codepoints.add(int(rule[2], 16))
    css = []
    for family, weight, name in ICON_FACES:
        path = fonts / name
        if not path.exists():
            continue
        font = TTFont(path)
        keep = sorted(codepoints & set(font.getBestCmap()))
        if not keep:
            continue
        options = subset.Options()
        options.flavor = "woff"
        subsetter = subset.Subsetter(options)
        subsetter.populate(unicodes=keep)
        subsetter.subset(font)
        out = io.BytesIO()
        font.flavor = "woff"
        font.save(out)
        data = base64.b64encode(out.getvalue()).decode()
        css.append(f'@font-face{{font-family:"{family}";font-style:normal;font-weight:{weight};'
                   f'font-display:block;src:url(data:font/woff;base64,{data}) format("woff")}}')
    return "\n".join(css) + "\n"


def _write_icon_fonts(outdir: Path) -> None:
    static = outdir / "_static"
    theme_css = static / "styles" / "pydata-sphinx-theme.css"
    if not theme_css.exists():
        return
    used = set()
    for path in [*outdir.rglob("*.html"), *static.rglob("*.js")]:
        if path.name != "fontawesome.js":
            used |= set(_ICON_NAME.findall(path.read_text(errors="ignore")))
    text = theme_css.read_text()
    css = icon_font_css(text, used, static / "vendor" / "fontawesome" / "webfonts")
    (static / "kvlab-icons.css").write_text(css)
    theme_css.write_text(drop_unused_icon_rules(text, used))


def drop_unused_icon_rules(theme_css: str, used: set[str]) -> str:
    """The theme's stylesheet without the ``.fa-NAME:before`` rules of icons no page uses
    (about 1,400 rules, a sixth of the file)."""

    def rule(match: re.Match) -> str:
        names = {name.removesuffix(":before").lstrip(".") for name in match[1].split(",")}
        return match[0] if names & used else ""

    return re.sub(r"(?<=\})" + _ICON_RULE.pattern, rule, theme_css)   # whole rules only


class _MainText(HTMLParser):
    """The text of a page's article, in its sections (with their ids): what Sphinx's search
    summary reads from a fetched page."""

    SKIP = frozenset({"script", "style", "template", "button"})
    BREAK = frozenset({"p", "div", "li", "pre", "tr", "td", "th", "br", "h1", "h2", "h3", "h4",
                       "h5", "h6", "dt", "dd", "figcaption"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.inside = 0
        self.skip = 0
        self.out: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        a = dict(attrs)
        if tag == "article" and "bd-article" in (a.get("class") or ""):
            self.inside += 1
        if not self.inside:
            return
        if tag in self.SKIP or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip += 1
        elif tag == "section":
            self.out.append(f'<section id="{html.escape(a.get("id") or "")}">')
        elif tag in self.BREAK:
            self.out.append(" ")

    def handle_endtag(self, tag) -> None:
        if not self.inside:
            return
        if tag == "article":
            self.inside -= 1
        elif tag in self.SKIP or (tag == "a" and self.skip):
            self.skip = max(0, self.skip - 1)
        elif tag == "section":
            self.out.append("</section>")

    def handle_data(self, data) -> None:
        if self.inside and not self.skip:
            self.out.append(html.escape(data, quote=False))


def page_text(page_html: str) -> str:
    """A page reduced to what the search summary needs: ``<div role="main">`` holding its
    article's text in its sections."""
    parser = _MainText()
    parser.feed(page_html)
    text = re.sub(r"\s+", " ", "".join(parser.out)).strip()
    return f'<div role="main">{text}</div>'


def _write_search_pages(outdir: Path) -> None:
    pages = {}
    for path in sorted(outdir.rglob("*.html")):
        name = path.relative_to(outdir).as_posix()
        if name.startswith("_") or name in ("search.html", "genindex.html"):
            continue
        pages[name.removesuffix(".html")] = page_text(path.read_text(errors="ignore"))
    (outdir / "_static" / "kvlab-search-pages.js").write_text(
        "window.KVLAB_SEARCH_PAGES = " + json.dumps(pages, ensure_ascii=False) + ";\n")


def _build_finished(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    _drop_fontawesome_script(outdir)
    _strip_phone_chunks(outdir)
    _write_icon_fonts(outdir)
    _write_search_pages(outdir)


def setup(app) -> dict[str, Any]:
    app.connect("doctree-resolved", _doctree_resolved)
    app.connect("html-page-context", _page_context, priority=900)
    app.connect("build-finished", _build_finished)
    app.add_js_file("kvlab.js")
    app.add_css_file("kvlab-icons.css")
    # env_version: bumped when what this extension writes into pages changes, so an incremental
    # build re-reads every page instead of keeping pages written by the previous version
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 5}
