"""Chapter 14's per-layer memory map: it draws what the planner computes, fits a 390 px phone
at a legible size, and its kernel-free twin offers every shipped model."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvlab.labs.capacity.hf_config import SHIPPED, shipped_layout
from kvlab.labs.capacity.hybrid_plan import bytes_by_layer
from kvlab.viz.kernel_free import EXPORT_ENV, render_figure
from kvlab.viz.kv_layouts import (
    KERNEL_FREE_TOKENS,
    KIND_COLORS,
    layer_map_caption,
    layer_map_figure,
    layer_map_kernel_free,
)
from kvlab.viz.style import use_style


@pytest.fixture(autouse=True)
def _headless():
    import matplotlib

    matplotlib.use("Agg")
    use_style()


def test_bars_are_the_planners_bytes_per_layer():
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    layout = shipped_layout("gemma-3-27b-it")
    fig = layer_map_figure(layout, 32768)
    top = fig.axes[0]
    widths = np.array([p.get_width() for p in top.patches])
    assert np.allclose(widths * 2**20, bytes_by_layer(layout, 32768))
    colours = [to_hex(p.get_facecolor()) for p in top.patches]
    assert colours == [KIND_COLORS[layer.kind] for layer in layout.layers]
    assert "2.91 GiB" in top.get_title(loc="left")               # 10 x 256 MiB + 52 x 8 MiB
    plt.close(fig)


@pytest.mark.parametrize("name", SHIPPED)
def test_fits_a_phone_at_a_legible_size(name):
    shot = render_figure(layer_map_figure(shipped_layout(name), 8192))
    assert shot.width <= 350                   # a 390 px screen's column, no sideways scroll
    assert shot.min_text_css_px >= 9.5         # the site check fails under 9


def test_context_above_the_model_maximum_is_drawn_at_the_maximum():
    import matplotlib.pyplot as plt

    layout = shipped_layout("qwen2.5-7b-instruct")          # max_position_embeddings 32768
    fig = layer_map_figure(layout, 131072)
    assert "32,768 tokens (max 32,768)" in fig.axes[0].get_title(loc="left")
    plt.close(fig)
    assert layer_map_caption(layout, 131072).startswith("qwen2.5-7b-instruct, 32,768 tokens")


def test_kernel_free_twin_offers_every_model_and_context(monkeypatch):
    monkeypatch.setenv(EXPORT_ENV, "1")
    kf = layer_map_kernel_free()
    assert len(kf.frames) == len(SHIPPED) * len(KERNEL_FREE_TOKENS)
    html = kf.to_html()
    (shown,) = re.findall(r'data-kf-key="([\d-]+)">', html)
    assert shown == kf.default_key == f"{SHIPPED.index('gemma-3-27b-it')}-2"
    default = next(f for f in kf.frames if f.key == kf.default_key)
    assert default.caption == layer_map_caption(shipped_layout("gemma-3-27b-it"), 32768)
    assert kf.nbytes < 1_200_000                # the chapter page stays light
