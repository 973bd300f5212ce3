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
  steer the notebook tests and mean nothing to a reader.
"""

from __future__ import annotations

import re
from typing import Any

from docutils import nodes

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


def _page_context(app, pagename, templatename, context, doctree) -> None:
    # pydata-sphinx-theme reads the colour mode from this template variable; left undefined,
    # every first visit logs "Got invalid theme mode" as a console error.
    context.setdefault("default_mode", "auto")
    if "script_files" in context:
        context["script_files"] = clean_scripts(context["script_files"])


def _doctree_resolved(app, doctree, docname) -> None:
    for block in list(doctree.findall(nodes.literal_block)):
        text = block.astext()
        stripped = strip_nbval_markers(text)
        if stripped != text:  # rawsource must equal the text, or Sphinx skips highlighting
            block.children = []
            block.append(nodes.Text(stripped))
            block.rawsource = stripped


def setup(app) -> dict[str, Any]:
    app.connect("doctree-resolved", _doctree_resolved)
    app.connect("html-page-context", _page_context, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
