"""Kernel-side set-up shared by every chapter: seeds, matplotlib backend and the book's style."""

from __future__ import annotations

import os
import random
import sys

from kvlab.viz.style import use_style


def setup_notebook(seed: int = 0, torch_threads: int = 1) -> None:
    """Seed Python, NumPy and torch; fix torch's CPU thread count; use the book's figure style.

    String hashing cannot be seeded from inside a running kernel (``PYTHONHASHSEED`` is read at
    interpreter start), so chapters never print anything whose order depends on ``hash(str)``.

    Called in the first code cell of every chapter so that outputs are reproducible and
    figures look the same in JupyterLab, under nbval and on the site. The book's models are
    tiny: their matmuls gain nothing from several threads, and on a shared CPU extra threads
    make them many times slower, so torch gets ``torch_threads`` (1 by default). Torch is not
    imported here: when it is not loaded yet the limit goes through ``OMP_NUM_THREADS`` (read
    when torch starts) and its seed is set by whoever imports it (kvlab seeds per request).
    """
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.manual_seed(seed)
        torch.set_num_threads(torch_threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
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
    _display_figures_for_the_site()


def _display_figures_for_the_site() -> None:
    """In an IPython kernel, show each figure as the site stores it: sharp at the column's
    width, with its phone variant inside (:func:`kvlab.viz.kernel_free.figure_output_png`)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with the book extras
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "display_formatter"):
        from matplotlib.figure import Figure

        from kvlab.viz.kernel_free import figure_output_png

        shell.display_formatter.formatters["image/png"].for_type(Figure, figure_output_png)
