"""The first cell of every chapter: install kvlab where it is missing (Colab, a bare kernel).

    python tools/install_cell.py            # check every chapter starts with the cell
    python tools/install_cell.py --write    # insert or refresh it in every notebooks/NN-*.md

Where kvlab is importable (``make lab``, Binder, the book build, nbval) the cell does nothing
and prints nothing. Elsewhere it clones the book's repository, installs it editable with the
CPU build of torch when torch is missing, and puts the clone on ``sys.path`` so the running
kernel imports it without a restart. The cell is tagged ``remove-cell``: the site hides it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO_URL = "https://github.com/kvlab-book/kvlab"
TORCH_PIN = "torch==2.13.0"
TAG = "remove-cell"

CELL = f"""\
# Colab or a bare kernel: install kvlab (does nothing where kvlab is already installed).
import importlib.util
import sys

if importlib.util.find_spec("kvlab") is None:
    if importlib.util.find_spec("torch") is None:
        %pip install --quiet {TORCH_PIN} \\
            --index-url https://download.pytorch.org/whl/cpu
    !git clone --quiet --depth 1 {REPO_URL} kvlab-src
    %pip install --quiet --editable "kvlab-src[dev]"
    sys.path.insert(0, "kvlab-src")  # importable now, without restarting the kernel"""

BLOCK = f"```{{code-cell}} ipython3\n:tags: [{TAG}]\n\n{CELL}\n```\n\n"
_FRONT = re.compile(r"\A---\n.*?\n---\n\n", re.S)
_OLD = re.compile(r"```\{code-cell\} ipython3\n:tags: \[remove-cell\]\n\n"
                  r"# Colab or a bare kernel.*?\n```\n\n", re.S)


def with_cell(text: str) -> str:
    """``text`` (a chapter's MyST source) with the install cell first, right after the front
    matter; an existing install cell is replaced, so this is idempotent."""
    front = _FRONT.match(text)
    if front is None:
        raise ValueError("chapter source has no jupytext front matter")
    body = _OLD.sub("", text[front.end():], count=1)
    return text[:front.end()] + BLOCK + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="insert or refresh the cell")
    args = parser.parse_args(argv)
    stale = []
    for source in sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.md")):
        text = source.read_text()
        if with_cell(text) != text:
            stale.append(source.name)
            if args.write:
                source.write_text(with_cell(text))
    if stale and not args.write:
        print("missing or stale install cell:", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
