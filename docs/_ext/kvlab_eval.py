"""Sphinx extension for the kvlab book: ``{eval}`name``` on the site is the glued value ``name``.

Loaded through ``book.yml`` (``sphinx.local_extensions``). A number in a chapter's prose is
written ``{eval}`load_us```, where the code cell before it binds ``load_us`` and glues it under
the same name (``glue("load_us", load_us, display=False)``). The two readers of the chapter
resolve the role from that one cell:

* in JupyterLab, jupyterlab-myst evaluates the expression ``load_us`` in the kernel when the
  markdown cell runs and stores the result in the cell's ``user_expressions`` metadata, from
  which it renders the value when the stored notebook is opened
  (``tools/inline_values.py`` writes that metadata from the glued outputs after execution);
* on the site there is no kernel (``execute_notebooks: off``), so myst-nb's own ``eval`` role
  would only warn; this extension replaces it with myst-nb's ``glue:text`` role, which pastes
  the stored glue output of that name, as ``{glue:text}`load_us``` always did.

Only a plain name is accepted (the glue key): an expression has no stored value to paste, and
the build says so instead of printing something the cell did not compute.
"""

from __future__ import annotations

import re
from typing import Any

from myst_nb.ext.glue.roles import PasteTextRole
from myst_nb.ext.glue.utils import glue_warning

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EvalGlueRole(PasteTextRole):
    """``{eval}`name```: the text/plain of the glue output ``name`` of this notebook."""

    def run(self):
        if not NAME.fullmatch(self.text):
            return [], [glue_warning(
                f"{{eval}}`{self.text}`: the site pastes a glued value, so the role takes "
                "a name that a code cell binds and glues under that name "
                "(an expression has no stored value)", self.document, self.line)]
        return super().run()


def setup(app: Any) -> dict:
    # myst-nb registers its kernel-evaluating ``eval`` role in its own setup, which runs first
    app.add_role("eval", EvalGlueRole(), override=True)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
