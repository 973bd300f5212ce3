"""kvlab.viz: pure figure functions (snapshot -> matplotlib Figure) and thin ipywidgets glue.

Widgets never reach into engine internals: they draw the plain-data snapshots that
``kvlab.core`` and ``kvlab.engine`` return. The colours and sizes come from :mod:`.style`.
"""

from .notebook import setup_notebook
from .style import (
    BLOCK_STATE_COLORS,
    BLOCK_STATE_ORDER,
    PHASE_COLORS,
    REQUEST_PALETTE,
    block_state_color,
    legend_figure,
    request_color,
    use_style,
)

__all__ = [
    "BLOCK_STATE_COLORS",
    "BLOCK_STATE_ORDER",
    "PHASE_COLORS",
    "REQUEST_PALETTE",
    "block_state_color",
    "legend_figure",
    "request_color",
    "setup_notebook",
    "use_style",
]
