"""The book's visual language: stable, distinct colours and a headless legend figure."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.colors as mcolors
import pytest

from kvlab.viz import (
    BLOCK_STATE_COLORS,
    BLOCK_STATE_ORDER,
    REQUEST_PALETTE,
    block_state_color,
    legend_figure,
    request_color,
    use_style,
)


def test_block_states_have_distinct_colours_distinct_from_requests():
    assert set(BLOCK_STATE_ORDER) == set(BLOCK_STATE_COLORS)
    states = {mcolors.to_hex(c) for c in BLOCK_STATE_COLORS.values()}
    requests = {mcolors.to_hex(c) for c in REQUEST_PALETTE}
    assert len(states) == len(BLOCK_STATE_COLORS)
    assert len(requests) == len(REQUEST_PALETTE)
    assert not states & requests


def test_request_colour_by_order_is_distinct_and_hash_fallback_is_stable():
    ids = [f"req-{i}" for i in range(len(REQUEST_PALETTE))]
    assert len({request_color(r, ids) for r in ids}) == len(ids)
    assert request_color("abc") == request_color("abc") == request_color("abc", ["x"])


def test_unknown_block_state_names_the_state():
    assert block_state_color("shared") == BLOCK_STATE_COLORS["shared"]
    with pytest.raises(KeyError, match="'sharde'"):
        block_state_color("sharde")


def test_legend_figure_draws_one_swatch_per_state_and_request():
    use_style()
    fig = legend_figure(["a", "b", "c"])
    state_ax, request_ax = fig.axes
    assert [p.get_label() for p in request_ax.patches] == ["a", "b", "c"]
    assert len(state_ax.patches) == len(BLOCK_STATE_ORDER)
    fills = [mcolors.to_hex(p.get_facecolor()) for p in state_ax.patches]
    assert fills == [BLOCK_STATE_COLORS[s] for s in BLOCK_STATE_ORDER]


def test_every_lazy_viz_name_resolves():
    import kvlab.viz as viz

    for name in viz._LAZY:
        assert callable(getattr(viz, name)), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        viz.nope  # noqa: B018


def test_setup_notebook_limits_torch_threads_before_torch_starts():
    import subprocess
    import sys

    code = (
        "from kvlab.viz import setup_notebook; setup_notebook(torch_threads=1); "
        "import torch; print(torch.get_num_threads())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={"PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "1"
