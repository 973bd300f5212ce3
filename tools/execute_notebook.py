"""Regenerate a chapter's ``.ipynb`` from its MyST ``.md`` source and execute it in place.

    python tools/execute_notebook.py notebooks/07-engine.md [--timeout 120]

jupytext reads the source (the pairing metadata and cell ids of an existing ``.ipynb`` are kept,
so the diff shows only what changed); nbclient executes it in the notebook's folder with a
per-cell timeout and stores widget state; the result is written next to the source. A cell that
raises stops the run with the cell's traceback and writes nothing.

Before writing, :func:`finish` makes the notebook what JupyterLab will keep unchanged and what a
student should see first:

* solution cells (tagged ``hide-cell`` or ``solution``) get ``jupyter.source_hidden`` and
  ``jupyter.outputs_hidden``, so Lab shows them collapsed as the site does (Lab's collapsed bar
  shows the cell's first line: ``tools/student.py --write-sources`` makes it a "Solution" label);
* the kernelspec is the one the kernel was started from (Lab rewrites a different
  ``display_name`` on open, which marked every chapter modified before anyone touched it);
* nbclient's per-cell ``execution`` timestamps are dropped (they change on every run).

    python tools/execute_notebook.py --finish-only notebooks/07-engine.md   # no execution
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

SOLUTION_TAGS = frozenset({"solution", "hide-cell"})
KERNEL = "python3"


def kernelspec(name: str = KERNEL) -> dict:
    """The notebook ``kernelspec`` entry of installed kernel ``name``, as JupyterLab writes it."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(name)
    return {"display_name": spec.display_name, "language": spec.language, "name": name}


def finish(nb, spec: dict | None = None):
    """Collapse solution cells, set the kernelspec, drop timing metadata (see the module doc).
    Returns ``nb`` (changed in place); running it twice changes nothing."""
    nb.metadata["kernelspec"] = spec or kernelspec()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code" and SOLUTION_TAGS & set(cell.metadata.get("tags", [])):
            cell.metadata.setdefault("jupyter", {}).update(source_hidden=True,
                                                           outputs_hidden=True)
            cell.metadata["collapsed"] = True   # nbformat's older flag, which Lab writes too
    return nb


def execute(source: Path, timeout: int) -> Path:
    """Execute ``source`` (a paired ``.md``) and write its ``.ipynb``; returns that path."""
    target = source.with_suffix(".ipynb")
    nb = jupytext.read(source)
    if target.exists():
        nb = jupytext.combine.combine_inputs_with_outputs(nb, nbformat.read(target, 4))
    os.environ.setdefault(EXPORT_ENV, "1")  # widgets carry their kernel-free twin (the site)
    # a prediction recorded by an earlier session in this folder would answer the worked
    # solutions "graded once" (kvlab/exercises/_common.py): the stored run starts without one
    (source.parent / ".kvlab-predictions.json").unlink(missing_ok=True)
    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL, record_timing=False,
                            resources={"metadata": {"path": str(source.parent)}})
    start = time.perf_counter()
    client.execute()
    nbformat.write(finish(nb), target)
    print(f"{target}: executed in {time.perf_counter() - start:.1f} s")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="notebooks/NN-topic.md files")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per cell")
    parser.add_argument("--finish-only", action="store_true",
                        help="apply finish() to the stored .ipynb without executing it")
    args = parser.parse_args(argv)
    for source in args.sources:
        if source.suffix != ".md" or not source.exists():
            parser.error(f"{source}: expected an existing .md chapter source")
        if args.finish_only:
            target = source.with_suffix(".ipynb")
            nbformat.write(finish(nbformat.read(target, as_version=4)), target)
            print(f"{target}: finished")
        else:
            execute(source, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
