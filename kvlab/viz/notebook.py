"""Kernel-side set-up shared by every chapter: seeds, matplotlib backend and the book's style."""

from __future__ import annotations

import os
import random
import sys

from .style import use_style


def setup_notebook(seed: int = 0) -> None:
    """Seed Python, NumPy and (if installed) torch; use the book's figure style.

    Called in the first code cell of every chapter so that outputs are reproducible and
    figures look the same in JupyterLab, under nbval and on the site. Torch is seeded only
    when already imported or importable, and kept to a deterministic single thread count.
    """
    random.seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    import matplotlib

    if "ipykernel" in sys.modules:
        try:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None:
                shell.run_line_magic("matplotlib", "inline")
                shell.run_line_magic("config", "InlineBackend.figure_formats = ['png']")
        except Exception:  # pragma: no cover - outside a kernel there is nothing to configure
            pass
    else:
        matplotlib.use("Agg")
    use_style()
