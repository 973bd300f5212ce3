"""kvlab.viz: pure figure functions (snapshot -> matplotlib Figure) and thin ipywidgets glue.

Widgets never reach into engine internals: they draw the plain-data snapshots that
``kvlab.core`` and ``kvlab.engine`` return. The colours and sizes come from :mod:`.style`.
Chapter figures load on first use, so ``from kvlab.viz import setup_notebook`` stays light.
"""

from __future__ import annotations

from kvlab._lazy import lazy_exports
from kvlab.viz.notebook import setup_notebook
from kvlab.viz.style import (
    BLOCK_STATE_COLORS,
    BLOCK_STATE_ORDER,
    PHASE_COLORS,
    REQUEST_PALETTE,
    block_state_color,
    legend_figure,
    request_color,
    use_style,
)

# name -> submodule of kvlab.viz that defines it, imported on first attribute access.
_LAZY = {
    **dict.fromkeys(["capacity_figure", "capacity_explorer"], ".capacity"),
    **dict.fromkeys(
        ["block_table_figure", "waste_figure", "waste_timeline_figure", "BlockTableView"], ".paging"
    ),
    **dict.fromkeys(["pool_figure", "fork_scenario", "RefcountView"], ".blocks"),
    **dict.fromkeys(["radix_figure", "hit_rate_figure", "RadixView"], ".radix"),
    **dict.fromkeys(
        ["state_diagram_figure", "recovery_figure", "RecoveryExplorer"], ".lifecycle"
    ),
    **dict.fromkeys(["batch_timeline_figure", "SchedulingView"], ".timeline"),
    **dict.fromkeys(["engine_step_figure", "EngineStepper"], ".engine"),
    **dict.fromkeys(["quantization_figure", "quantization_explorer"], ".quantization"),
    **dict.fromkeys(["acceptance_figure", "AcceptanceView"], ".spec"),
    **dict.fromkeys(["layer_map_figure", "layer_map_explorer"], ".kv_layouts"),
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)

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
    *_LAZY,
]
