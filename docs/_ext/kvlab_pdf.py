"""Sphinx extension for the kvlab book: the site links the whole book as one PDF.

``make pdf`` prints the book to ``_build/pdf/kvlab.pdf`` (``tools/book_pdf.py``). When that
file exists as the HTML site is built, this extension copies it to the site's root
(``kvlab.pdf``) and adds a "PDF" link to the links at the top of the navigation sidebar (the ☰
drawer on a phone) of every page. When it does not, the site has no link, so a site built
without ``make pdf`` never links to a missing file. Whether the PDF is there is a config value
of the HTML build, so building again after ``make pdf`` rewrites every page with the link.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

PDF_NAME = "kvlab.pdf"


def built_pdf(app) -> Path:
    """Where ``make pdf`` writes the book: ``pdf/kvlab.pdf`` beside the builders' folders."""
    return Path(app.outdir).parent / "pdf" / PDF_NAME


def _config_inited(app, config) -> None:
    pdf = built_pdf(app)
    config.kvlab_pdf = f"{PDF_NAME}:{pdf.stat().st_size}" if pdf.exists() else ""


def _page_context(app, pagename, templatename, context, doctree) -> None:
    if app.builder.name != "html" or not app.config.kvlab_pdf:
        return
    link = {"name": "The whole book as a PDF", "url": context["pathto"](PDF_NAME, 1),
            "icon": "_static/kvlab-pdf.svg", "type": "local",
            "attributes": {"target": "_self", "download": PDF_NAME}}
    context["theme_icon_links"] = [*(context.get("theme_icon_links") or []), link]


def _build_finished(app, exception) -> None:
    if exception is None and app.builder.name == "html" and app.config.kvlab_pdf:
        shutil.copy2(built_pdf(app), Path(app.outdir) / PDF_NAME)


def setup(app) -> dict[str, Any]:
    app.add_config_value("kvlab_pdf", "", "html")
    app.connect("config-inited", _config_inited)
    app.connect("html-page-context", _page_context)
    app.connect("build-finished", _build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
