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
  path, and a ``min-width`` at which its smallest text (also in the PNG) is still 9 CSS px: on
  a phone the figure then scrolls sideways instead of shrinking into unreadable text;
* lets long inline code (file paths, dotted names, command-line flags) break after ``/``,
  ``.``, ``_`` and the hyphens inside a word, and between the humps of a CamelCase run too long
  for a phone's column: the "In real systems" tables fit the column instead of scrolling
  sideways, and on a phone a long name in prose
  (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``,
  ``--disaggregation-decode-allocation-policy``, ``SchedulerDisaggregationPrefillMixin``) is
  not cut at the screen's edge. The breaks are ``<wbr>`` elements: copied text is unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from docutils import nodes
from PIL import Image

from kvlab.viz.kernel_free import PNG_DESCRIPTION, PNG_MIN_TEXT, min_display_width

NBVAL_MARKER = re.compile(r"^[ \t]*# NBVAL_[A-Z_]+[ \t]*\n", re.M)
_REMOTE = re.compile(r"^(?:[a-z]+:)?//", re.I)
_DROP_BODY = ("THEBE_JS_URL",)
_DROP_FILES = ("sphinx-thebe.js",)
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


# image file name -> min-width in CSS px, filled while a page's doctree is resolved and used
# when its HTML is written (both happen in the process that writes the page)
_MIN_WIDTH: dict[str, int] = {}
_IMG_SRC = re.compile(r'<img\b[^>]*?\bsrc="[^"]*?/([^"/]+\.png)"[^>]*?>')


def add_min_widths(body: str, widths: dict[str, int]) -> str:
    """``body`` with ``min-width: Npx`` in the style of each ``<img>`` whose file has an entry
    (Sphinx writes an image's width and height as its ``style``)."""

    def img(match: re.Match) -> str:
        tag, name = match[0], match[1]
        if name not in widths or "min-width" in tag:
            return tag
        rule = f"min-width: {widths[name]}px;"
        if ' style="' in tag:
            return tag.replace(' style="', f' style="{rule} ', 1)
        return tag[:4] + f' style="{rule}"' + tag[4:]

    return _IMG_SRC.sub(img, body)


def _page_context(app, pagename, templatename, context, doctree) -> None:
    # pydata-sphinx-theme reads the colour mode from this template variable; left undefined,
    # every first visit logs "Got invalid theme mode" as a console error.
    context.setdefault("default_mode", "auto")
    if "script_files" in context:
        context["script_files"] = clean_scripts(context["script_files"])
    if "body" in context:
        context["body"] = add_min_widths(break_long_literals(context["body"]), _MIN_WIDTH)


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
        source = image.get("candidates", {}).get("*", uri)
        text = png_text(Path(app.srcdir) / source)
        if text.get(PNG_DESCRIPTION) and (not image.get("alt") or image["alt"] == uri):
            image["alt"] = text[PNG_DESCRIPTION]
        try:
            width = int(str(image.get("width", "0")).removesuffix("px"))
            floor = min_display_width(width, float(text.get(PNG_MIN_TEXT, 0)))
        except ValueError:
            continue
        if floor:
            _MIN_WIDTH[Path(uri).name] = floor


def setup(app) -> dict[str, Any]:
    app.connect("doctree-resolved", _doctree_resolved)
    app.connect("html-page-context", _page_context, priority=900)
    # env_version: bumped when what this extension writes into pages changes, so an incremental
    # build re-reads every page instead of keeping pages written by the previous version
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 3}
