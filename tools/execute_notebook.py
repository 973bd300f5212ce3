"""Regenerate a chapter's ``.ipynb`` from its MyST ``.md`` source and execute it in place.

    python tools/execute_notebook.py notebooks/07-engine.md [--timeout 120]

jupytext reads the source (the pairing metadata and cell ids of an existing ``.ipynb`` are kept,
so the diff shows only what changed); nbclient executes it in the notebook's folder with a
per-cell timeout and stores widget state; the result is written next to the source. A cell that
raises stops the run with the cell's traceback and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

from kvlab.viz.kernel_free import EXPORT_ENV


def execute(source: Path, timeout: int) -> Path:
    """Execute ``source`` (a paired ``.md``) and write its ``.ipynb``; returns that path."""
    target = source.with_suffix(".ipynb")
    nb = jupytext.read(source)
    if target.exists():
        nb = jupytext.combine.combine_inputs_with_outputs(nb, nbformat.read(target, 4))
    os.environ.setdefault(EXPORT_ENV, "1")  # widgets carry their kernel-free twin (the site)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(source.parent)}})
    start = time.perf_counter()
    client.execute()
    nbformat.write(nb, target)
    print(f"{target}: executed in {time.perf_counter() - start:.1f} s")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="notebooks/NN-topic.md files")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per cell")
    args = parser.parse_args(argv)
    for source in args.sources:
        if source.suffix != ".md" or not source.exists():
            parser.error(f"{source}: expected an existing .md chapter source")
        execute(source, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
