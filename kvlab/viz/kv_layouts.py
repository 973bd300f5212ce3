"""Chapter 14 figure: a model's KV memory, layer by layer, against the context length.

``layer_map_figure(layout, tokens)`` is pure (a
:class:`~kvlab.labs.capacity.hf_config.ModelLayout` in, a new Figure out) and narrow enough for a
phone (3.5 in wide, two panels stacked): above, one bar per layer, the bytes that layer keeps for
one request of ``tokens`` tokens, coloured by what the layer caches; below, the request's total
against the context length, stacked by kind, with the total an engine would keep if every layer
kept every token (dashed). ``layer_map_explorer()`` is the ipywidgets wrapper, with a kernel-free
twin over the shipped models and four context lengths.
"""

from __future__ import annotations

import numpy as np

from kvlab.labs.capacity.hf_config import SHIPPED, ModelLayout, shipped_layout
from kvlab.labs.capacity.hybrid_plan import bytes_by_layer
from kvlab.labs.capacity.layer_kv import KINDS
from kvlab.viz._widgets import figure_widget
from kvlab.viz.style import INK, MUTED, REQUEST_PALETTE

#: Colour of each kind of layer (Okabe–Ito, from the book's palette).
KIND_COLORS = {"full": REQUEST_PALETTE[0], "sliding": REQUEST_PALETTE[1],
               "mla": REQUEST_PALETTE[2], "state": REQUEST_PALETTE[3]}
KIND_LABELS = {"full": "full attention", "sliding": "sliding window", "mla": "MLA latent",
               "state": "recurrent state"}

#: Context lengths of the lower panel's x axis (tokens).
CONTEXTS = tuple(2**k for k in range(8, 19))          # 256 .. 262144
#: The kernel-free twin's context lengths.
KERNEL_FREE_TOKENS = (1024, 8192, 32768, 131072)

MiB, GiB = 2**20, 2**30


def _tokens_label(value: float, _pos=None) -> str:
    """256, 1k, 4k, … 256k: token counts as a reader says them."""
    return f"{value / 1024:g}k" if value >= 1024 else f"{value:g}"


def _totals_by_kind(layout: ModelLayout, tokens: int, kv_dtype: str, tp: int) -> dict[str, float]:
    per_layer = bytes_by_layer(layout, tokens, kv_dtype=kv_dtype, tp=tp)
    totals = dict.fromkeys(KINDS, 0.0)
    for layer, nbytes in zip(layout.layers, per_layer, strict=True):
        totals[layer.kind] += nbytes
    return totals


def layer_map_figure(layout: ModelLayout, tokens: int, *, kv_dtype: str = "bf16", tp: int = 1,
                     contexts=CONTEXTS):
    """Per-layer bytes of one request of ``tokens`` tokens (top) and its total against the
    context length (bottom), on one of ``tp`` ranks. ``tokens`` above the model's
    ``max_position_embeddings`` is drawn at that maximum (the title says so)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    limit = layout.max_position_embeddings or max(contexts)
    shown = min(tokens, limit)
    per_layer = np.asarray(bytes_by_layer(layout, shown, kv_dtype=kv_dtype, tp=tp)) / MiB
    kinds = [layer.kind for layer in layout.layers]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(3.5, 5.6),
                                      gridspec_kw={"height_ratios": [1.35, 1.0]})
    rows = np.arange(layout.num_layers)
    top.barh(rows, per_layer, height=0.8, color=[KIND_COLORS[k] for k in kinds], linewidth=0)
    top.invert_yaxis()
    top.set_ylim(layout.num_layers - 0.5, -0.5)
    top.set_ylabel("layer", fontsize=9)
    top.set_xlabel("MiB per request", fontsize=9)
    top.tick_params(labelsize=8)
    total = per_layer.sum()
    capped = "" if shown == tokens else f" (max {limit:,})"
    top.set_title(f"{layout.name}\n{shown:,} tokens{capped}: {total / 1024:.2f} GiB"
                  f"{'' if tp == 1 else f' per rank (TP {tp})'}", loc="left", fontsize=9)

    xs = [c for c in contexts if c <= limit] or [limit]
    stacks = {k: [] for k in KINDS}
    for c in xs:
        for kind, value in _totals_by_kind(layout, c, kv_dtype, tp).items():
            stacks[kind].append(value / GiB)
    present = [k for k in KINDS if any(stacks[k])]
    bottom.stackplot(xs, *[stacks[k] for k in present],
                     colors=[KIND_COLORS[k] for k in present],
                     labels=[KIND_LABELS[k] for k in present], alpha=0.9)
    if layout.windows():
        flat = [sum(bytes_by_layer(layout.without_windows(), c, kv_dtype=kv_dtype, tp=tp)) / GiB
                for c in xs]
        bottom.plot(xs, flat, color=INK, linestyle="--", linewidth=1.0,
                    label="no windows")
    bottom.axvline(shown, color=MUTED, linestyle=":", linewidth=1.0)
    bottom.set_xscale("log", base=2)
    bottom.set_xlim(xs[0], xs[-1])
    bottom.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    bottom.set_xlabel("context (tokens)", fontsize=9)
    bottom.set_ylabel("GiB per request", fontsize=9)
    bottom.tick_params(labelsize=8)
    bottom.legend(loc="upper left", fontsize=8, frameon=False)
    fig.tight_layout(h_pad=0.8)
    return fig


def layer_map_caption(layout: ModelLayout, tokens: int, kv_dtype: str = "bf16",
                      tp: int = 1) -> str:
    """One line per kind: layers, and bytes per request at ``tokens`` tokens."""
    shown = min(tokens, layout.max_position_embeddings or tokens)
    totals = _totals_by_kind(layout, shown, kv_dtype, tp)
    counts = layout.kind_counts()
    lines = [f"{layout.name}, {shown:,} tokens, KV {kv_dtype}"]
    for kind, n in counts.items():
        window = (f" (window {', '.join(map(str, sorted(layout.windows())))})"
                  if kind == "sliding" else "")
        lines.append(f"  {n:>2} {KIND_LABELS[kind]}{window}: {totals[kind] / MiB:,.1f} MiB")
    return "\n".join(lines)


def layer_map_explorer(model: str = "gemma-3-27b-it", tokens: int = 32768):
    """A model dropdown, a context slider and a KV dtype -> :func:`layer_map_figure`."""
    import ipywidgets as w

    controls = {
        "model": w.Dropdown(options=list(SHIPPED), value=model, description="model"),
        "tokens": w.SelectionSlider(options=list(CONTEXTS), value=tokens,
                                    description="context"),
        "kv_dtype": w.Dropdown(options=["bf16", "fp8"], value="bf16", description="KV dtype"),
    }
    return figure_widget(
        controls,
        lambda model, tokens, kv_dtype: layer_map_figure(shipped_layout(model), tokens,
                                                         kv_dtype=kv_dtype),
        caption=lambda model, tokens, kv_dtype: layer_map_caption(shipped_layout(model), tokens,
                                                                  kv_dtype),
        what="per-layer KV memory map (model, context, KV dtype)",
        kernel_free=lambda: layer_map_kernel_free(model, tokens))


def layer_map_kernel_free(model: str = "gemma-3-27b-it", tokens: int = 32768):
    """The explorer without a kernel: every shipped model at :data:`KERNEL_FREE_TOKENS`, bf16."""
    from kvlab.viz.kernel_free import dropdown, slider, static_widget

    grid = sorted({*KERNEL_FREE_TOKENS, tokens})
    return static_widget(
        lambda model, tokens: layer_map_figure(shipped_layout(model), tokens),
        {"model": dropdown(SHIPPED), "tokens": slider(grid, label="context",
                                                      labels=[f"{t:,}" for t in grid])},
        default={"model": model, "tokens": tokens},
        caption=lambda model, tokens: layer_map_caption(shipped_layout(model), tokens),
        title="per-layer KV memory map (bf16, one GPU)")
