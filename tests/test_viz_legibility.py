"""The book's figures keep their smallest text legible as the site shows them.

The site check (tools/site_check.py) fails a figure whose smallest text is under 9 CSS px as
displayed at 1280 px. Each figure here is built the way its chapter builds it, rendered with
:func:`kvlab.viz.kernel_free.render_figure` (the path both notebook outputs and kernel-free
frames take) and its smallest text measured the way the site check measures it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.core.request import TRANSITIONS, RequestStatus, holds_kv
from kvlab.labs.speculation.acceptance import AcceptanceData
from kvlab.viz.blocks import fork_scenario, pool_figure, text_scale
from kvlab.viz.kernel_free import COLUMN_PX, SCALE, render_figure
from kvlab.viz.lifecycle import state_diagram_figure
from kvlab.viz.paging import BlockTableView, block_table_figure
from kvlab.viz.pd import fault_run_figure
from kvlab.viz.quantization import quality_figure
from kvlab.viz.spec import acceptance_figure
from kvlab.viz.style import use_style

#: Smallest text a chapter figure may show, CSS px (the site check's floor is 9).
FLOOR_CSS_PX = 9.5
QUALITY_JSON = Path(__file__).resolve().parents[1] / "benchmarks/results/quantization_quality.json"


@pytest.fixture(autouse=True)
def _headless():
    import matplotlib

    matplotlib.use("Agg")


def displayed_min_text(fig) -> tuple[float, str]:
    """Smallest text of ``fig`` in CSS px as the book's 880 px column shows a notebook output
    (``tight`` crop, shrunk by the browser if wider than the column), and its alt text."""
    shot = render_figure(fig, colors=256, tight=True)
    return shot.min_text_px / SCALE * min(1.0, COLUMN_PX / shot.width), shot.description


def _ch2_view():
    view = BlockTableView(num_blocks=16, block_size=4)
    for prompt in (6, 9, 3):
        view.add_request(prompt)
    view.finish("r1")
    view.add_request(10)
    view.append("r0", 3)
    return view.figure()


def _ch2_shared():
    return block_table_figure({"a": [4, 9, 2], "b": [4, 9, 6]}, num_blocks=12, block_size=4,
                              token_counts={"a": 11, "b": 10})


def _pool(num_blocks, per_row, **kw):
    steps = fork_scenario(n=3, num_blocks=num_blocks, **kw)
    return pool_figure(steps[len(steps) // 2][1], per_row=per_row)  # mid-run: tables, refcounts


class _Run:  # the fields fault_run_figure reads from a PDDemo run
    def __init__(self):
        steps = fork_scenario(n=3, num_blocks=40, block_size=8, prompt_len=29)
        self.snapshot = steps[len(steps) // 2][1]
        self.fault, self.decision, self.action = "corrupt_payload", "corrupt_payload", "recompute"


def _acceptance():
    data = AcceptanceData("draft_model", 4, 0.8, (0.9, 0.7, 0.5, 0.3),
                          {f"r{i}": ((1, 2), (2, 4), (3, 5)) for i in range(4)},
                          ((0.1, 0.5), (0.2, 0.9), (0.05, 0.3)), 0.62, 2.4)
    return acceptance_figure(data)


def _state_diagram():
    return state_diagram_figure({s.value: [d.value for d in TRANSITIONS[s]] for s in RequestStatus},
                                {s.value: holds_kv(s) for s in RequestStatus},
                                highlight=["preempted"])


FIGURES = {
    "ch2 block tables (widget)": _ch2_view,
    "ch2 block tables (shared)": _ch2_shared,
    "ch4 KV pool, 16 per row": lambda: _pool(16, 16, enable_prefix_caching=True),
    "ch8 perplexity / KL": lambda: quality_figure(json.loads(QUALITY_JSON.read_text())["rows"]),
    "ch9 acceptance": _acceptance,
    "ch10 consumer pool": lambda: fault_run_figure(_Run()),
    "ch5 state machine": _state_diagram,
}


@pytest.mark.parametrize("name", list(FIGURES))
def test_smallest_text_is_legible_at_the_column(name):
    use_style()
    px, alt = displayed_min_text(FIGURES[name]())
    assert px >= FLOOR_CSS_PX, f"{name}: smallest text {px:.1f} CSS px as displayed"
    assert alt.strip(), f"{name}: no title or axis label to describe it"


def test_wide_pools_scale_their_text():
    # 40 blocks at 40 per row hit the 12-inch cap: shown narrowed, the text must grow to match
    use_style()
    px, _ = displayed_min_text(_pool(40, 40, block_size=8, prompt_len=29))
    assert px >= FLOOR_CSS_PX
    assert text_scale(9.0, 7.5) == 1.0          # 96 px per inch: 7.5 pt is 10 px
    assert text_scale(12.0, 7) == pytest.approx(9.8 * 72 * 12 / (880 * 7))
    with pytest.raises(ValueError, match="positive"):
        text_scale(0, 7)


def test_state_diagram_alt_text_names_the_figure():
    use_style()
    _, alt = displayed_min_text(_state_diagram())
    assert alt.startswith("request state machine: ")
    assert "running" in alt
