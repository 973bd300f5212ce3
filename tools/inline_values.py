"""Store in a chapter's ``.ipynb`` the values its ``{eval}`name``` roles show in JupyterLab.

    python tools/inline_values.py notebooks/04-prefix-reuse.md [...]     # write the .ipynb
    python tools/inline_values.py --check notebooks/04-prefix-reuse.md   # exit 1 if stale

A number in prose is ``{eval}`name```, where a code cell binds ``name`` and glues it under the
same name. jupyterlab-myst renders the role from the markdown cell's ``user_expressions``
metadata (one entry per role, in reading order, holding the kernel's answer for the
expression) and writes that metadata when the cell runs; a notebook opened without running it
shows the stored values, or the bare name where there are none. This tool writes the metadata
from the glued outputs of the same notebook: the glue output is the value's display bundle,
which is what the kernel answers for the expression ``name`` (the lab check compares the two
after Run All). The site pastes the same glue output (``docs/_ext/kvlab_eval.py``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

EVAL = re.compile(r"\{eval\}`([^`]+)`")
METADATA = "user_expressions"   # jupyterlab-myst's cell metadata key


def expressions(source: str) -> list[str]:
    """The ``{eval}`` expressions of a markdown source, in reading order, repeats kept (as
    jupyterlab-myst evaluates them: one request key per role)."""
    return EVAL.findall(source)


def glued(nb) -> dict[str, dict]:
    """``{name: mime bundle}`` of every ``myst_nb.glue`` output in ``nb`` (the prefix that
    ``display=False`` adds to the mime types removed)."""
    found: dict[str, dict] = {}
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            scrap = out.get("metadata", {}).get("scrapbook")
            if not scrap:
                continue
            prefix = scrap.get("mime_prefix", "")
            found[scrap["name"]] = {mime[len(prefix):]: value
                                    for mime, value in out.get("data", {}).items()
                                    if mime.startswith(prefix)}
    return found


def user_expressions(nb) -> list[list[dict] | None]:
    """For each cell of ``nb``: the ``user_expressions`` entries its ``{eval}`` roles need, or
    None (no role). Raises ValueError naming the cell and the name when a role's name is not
    glued in ``nb``."""
    values = glued(nb)
    result: list[list[dict] | None] = []
    for index, cell in enumerate(nb.cells):
        names = expressions(cell.source) if cell.cell_type == "markdown" else []
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(f"cell {index}: {{eval}} of {missing} but the notebook glues no "
                             "value of that name (bind it and glue it under the same name)")
        result.append([{"expression": n,
                        "result": {"status": "ok", "data": dict(values[n]), "metadata": {}}}
                       for n in names] or None)
    return result


def store(nb):
    """Write every markdown cell's ``user_expressions`` (drop it where the cell has no role).
    Returns ``nb``, changed in place; running it twice changes nothing."""
    for cell, entries in zip(nb.cells, user_expressions(nb), strict=True):
        if entries is None:
            cell.metadata.pop(METADATA, None)
        else:
            cell.metadata[METADATA] = entries
    return nb


def stale(nb) -> list[int]:
    """Indices of the cells whose stored ``user_expressions`` differ from :func:`store`'s."""
    return [i for i, (cell, entries) in enumerate(zip(nb.cells, user_expressions(nb),
                                                      strict=True))
            if cell.metadata.get(METADATA) != entries]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="notebooks/NN-topic.md files")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    status = 0
    for source in args.sources:
        target = source.with_suffix(".ipynb")
        if not target.exists():
            parser.error(f"{target}: no executed notebook (run `make notebook NB={source}`)")
        nb = nbformat.read(target, as_version=4)
        try:
            cells = stale(nb)
        except ValueError as exc:
            print(f"{target}: {exc}", file=sys.stderr)
            status = 1
            continue
        if args.check:
            if cells:
                print(f"{target}: stale {METADATA} in cells {cells}: run "
                      f"`python tools/inline_values.py {source}`", file=sys.stderr)
                status = 1
        elif cells:
            nbformat.write(store(nb), target)
            print(f"{target}: {METADATA} written in {len(cells)} cells")
    return status


if __name__ == "__main__":
    sys.exit(main())
