"""Chapter 8 figures: one weight row, its quantization grid, per-group scales and errors.

``quantization_figure(row, bits, group_size, symmetric)`` is pure (a 1-D weight row in, a new
Figure out); ``quantization_explorer()`` is the ipywidgets wrapper (bits, group size, outlier
strength, symmetric or zero-point). ``example_row(outlier)`` is the row both use: a Gaussian
row of 256 weights with three outliers of ``outlier`` times the row's standard deviation.
"""

from __future__ import annotations

import numpy as np

from kvlab.viz._widgets import figure_widget
from kvlab.viz.style import INK, MUTED, PHASE_COLORS, REQUEST_PALETTE


def example_row(outlier: float = 12.0, n: int = 256, seed: int = 0):
    """A float32 torch row of ``n`` N(0, 0.02) weights with outliers of ``outlier`` sigmas at
    positions 37, 130 and 201 (seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    row = torch.randn(n, generator=g) * 0.02
    for i, sign in ((37, 1.0), (130, -1.0), (201, 1.0)):
        if i < n:
            row[i] = sign * outlier * 0.02
    return row


def quantization_summary(row, bits: int, group_size: int, symmetric: bool = True) -> dict:
    """Numbers the figure shows: dequantized row, per-group scales, errors, effective bits and
    the storage bits the packed row really spends (its bytes x 8 / weights)."""
    from kvlab.engine.quantization import QuantConfig, dequantize, quantize

    cfg = QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric)
    packed = quantize(row.reshape(1, -1), cfg)
    deq = dequantize(packed)[0]
    err = (row - deq).numpy()
    return {"config": cfg, "deq": deq.numpy(), "scales": packed.scales.float()[0].numpy(),
            "error": err, "rms": float(np.sqrt((err ** 2).mean())),
            "max_error": float(np.abs(err).max()), "effective_bits": cfg.effective_bits(),
            "storage_bits": cfg.storage_bits(), "bytes": packed.nbytes}


def quantization_figure(row, bits: int = 4, group_size: int = 32, symmetric: bool = True):
    """Three panels: the row and its reconstruction with each group's grid (top), the scale of
    every group (bottom left) and the histogram of errors against ``±s/2`` (bottom right).
    The legend sits right of the top panel, off the data."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    s = quantization_summary(row, bits, group_size, symmetric)
    x = row.numpy()
    n = x.size
    fig = plt.figure(figsize=(10.0, 5.4), layout="constrained")  # makes room for the legend
    grid = fig.add_gridspec(2, 2, height_ratios=[1.3, 1.0])
    ax = fig.add_subplot(grid[0, :])
    levels = 2 ** bits - 1
    for gi, scale in enumerate(s["scales"]):
        lo, hi = gi * group_size, (gi + 1) * group_size
        if symmetric:
            qmax = 2 ** (bits - 1) - 1
            grid_vals = np.arange(-qmax, qmax + 1) * scale
        else:
            zero = np.round(-min(x[lo:hi].min(), 0.0) / scale)
            grid_vals = (np.arange(levels + 1) - zero) * scale
        if grid_vals.size <= 64:
            ax.hlines(grid_vals, lo, hi - 1, color=MUTED, linewidth=0.3, alpha=0.6)
        ax.axvline(lo - 0.5, color=MUTED, linewidth=0.5, linestyle=":")
    ax.plot(np.arange(n), x, ".", color=REQUEST_PALETTE[0], markersize=3, label="weight")
    ax.step(np.arange(n), s["deq"], where="mid", color=PHASE_COLORS["prefill"], linewidth=0.9,
            label="dequantized")
    ax.set_xlim(-1, n)
    ax.set_xlabel("index in the row (dotted: group boundaries; grey: each group's grid)")
    stored = ("" if s["storage_bits"] == s["effective_bits"]
              else f" ({s['storage_bits']:.3g} stored)")
    ax.set_title(f"int{bits} {'symmetric' if symmetric else 'zero-point'}, group {group_size}: "
                 f"{s['effective_bits']:.3g} effective bits{stored}, RMS error {s['rms']:.2e}, "
                 f"max {s['max_error']:.2e}", loc="left", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax2 = fig.add_subplot(grid[1, 0])
    ax2.bar(np.arange(s["scales"].size), s["scales"], color=REQUEST_PALETTE[2], edgecolor=INK,
            linewidth=0.4)
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))  # group numbers, a few of them
    ax2.set_xlabel("group")
    ax2.set_ylabel("scale s")
    ax2.set_title("one scale per group: outliers inflate theirs", loc="left", fontsize=10)
    ax3 = fig.add_subplot(grid[1, 1])
    half = float(s["scales"].max()) / 2
    ax3.hist(s["error"], bins=41, range=(-1.05 * half, 1.05 * half), color=REQUEST_PALETTE[4])
    ax3.axvline(-half, color=INK, linestyle="--", linewidth=0.8)
    ax3.axvline(half, color=INK, linestyle="--", linewidth=0.8)
    # few, short tick labels (a shared power of ten at the axis end): they do not run together
    ax3.xaxis.set_major_locator(MaxNLocator(5, steps=[1, 2, 2.5, 5, 10]))
    ax3.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    ax3.set_xlabel("x - deq(q(x))")
    ax3.set_title("error histogram (dashed: ±max(s)/2)", loc="left", fontsize=10)
    return fig


def quantization_caption(row, bits: int, group_size: int, symmetric: bool = True) -> str:
    """The line under the figure: the bytes stored, the bits per weight they make (the storage
    bits, exactly), and the effective bits beside them, with why the two differ where they do
    (a code narrower than its container)."""
    s = quantization_summary(row, bits, group_size, symmetric)
    n = int(row.numel())
    container = 4 if bits <= 4 else 8
    extras = "fp16 scales" if symmetric else "fp16 scales and uint8 zero points"
    line = (f"{s['bytes']} bytes for {n} weights = {8 * s['bytes'] / n:.4g} bits each: "
            f"{container}-bit code containers plus {extras}")
    if s["storage_bits"] == s["effective_bits"]:
        return line + f" (= effective_bits, {s['effective_bits']:.4g})"
    packed = s["effective_bits"] * n / 8
    return (line + f". effective_bits says {s['effective_bits']:.4g}: it counts {bits} bits per "
            f"code, what a layout packing codes across byte boundaries would store "
            f"({packed:.4g} bytes); kvlab keeps each {bits}-bit code in "
            f"{'an' if container == 8 else 'a'} {container}-bit container")


def quantization_explorer():
    """Sliders for bits and outlier strength, dropdowns for group size and the variant."""
    import ipywidgets as w

    controls = {
        "bits": w.IntSlider(value=4, min=2, max=8, description="bits"),
        "group_size": w.Dropdown(options=[8, 16, 32, 64, 128, 256], value=32,
                                 description="group size"),
        "outlier": w.FloatSlider(value=12.0, min=0.0, max=40.0, step=1.0,
                                 description="outlier (σ)"),
        "symmetric": w.Dropdown(options=[("symmetric", True), ("zero-point", False)],
                                value=True, description="variant"),
    }

    def draw(bits, group_size, outlier, symmetric):
        return quantization_figure(example_row(outlier), bits, group_size, symmetric)

    def caption(bits, group_size, outlier, symmetric):
        return quantization_caption(example_row(outlier), bits, group_size, symmetric)

    return figure_widget(controls, draw, caption=caption,
                         what="quantization explorer (bits, group size, outlier, variant)",
                         kernel_free=quantization_kernel_free)


#: The kernel-free explorer's grid: 3 widths x 3 group sizes x 2 variants = 18 frames (the
#: outlier fixed at the explorer's default, 12 sigma).
KERNEL_FREE_GRID = {"bits": (2, 4, 8), "group_size": (8, 32, 128), "symmetric": (True, False)}


def quantization_kernel_free(outlier: float = 12.0, *, bits: int = 4, group_size: int = 32,
                             symmetric: bool = True):
    """The explorer without a kernel: :data:`KERNEL_FREE_GRID` precomputed for one row (outlier
    ``outlier`` sigma), the explorer's default first, each frame with its bytes line."""
    from kvlab.viz.kernel_free import dropdown, slider, static_widget

    row = example_row(outlier)
    grid = KERNEL_FREE_GRID
    return static_widget(
        lambda bits, group_size, symmetric: quantization_figure(row, bits, group_size,
                                                                symmetric),
        {"bits": slider(grid["bits"]), "group_size": dropdown(grid["group_size"],
                                                              label="group size"),
         "symmetric": dropdown(grid["symmetric"], label="variant",
                               labels=["symmetric" if v else "zero-point"
                                       for v in grid["symmetric"]])},
        default={"bits": bits, "group_size": group_size, "symmetric": symmetric},
        caption=lambda bits, group_size, symmetric: quantization_caption(row, bits, group_size,
                                                                         symmetric),
        title=f"quantization explorer (outliers of {outlier:g} sigma)")


QUALITY_METRICS = (("ppl_ratio", "perplexity / fp32"), ("kl_nats", "KL(fp32 || quant), nats"),
                   ("top1_agreement", "teacher-forced top-1 agreement"),
                   ("greedy_agreement", "greedy tokens before first difference"))


def quality_figure(rows: list[dict]):
    """Four panels (two by two), one per metric of :data:`QUALITY_METRICS`, against effective
    bits: one line per group size of the symmetric formats, zero-point formats as hollow markers,
    each point with its 95% interval (``<metric>_ci95``). ``rows``: the ``rows`` of
    ``benchmarks/results/quantization_quality.json``; the fp32 row draws a dotted line."""
    import matplotlib.pyplot as plt

    weight_rows = [r for r in rows if r.get("bits")]
    if not weight_rows:
        raise ValueError("quality_figure: no weight-quantized rows")
    fp32 = next((r for r in rows if r["config"] == "fp32"), None)
    # two by two at the column's width, so nothing is shown narrowed (text at its point size)
    fig, axes = plt.subplots(2, 2, figsize=(9.0, 6.4))
    axes = axes.ravel()
    groups = sorted({r["group_size"] for r in weight_rows})
    for ax, (key, label) in zip(axes, QUALITY_METRICS, strict=True):
        for j, g in enumerate(groups):
            for sym in (True, False):
                pts = sorted((r for r in weight_rows if r["group_size"] == g
                              and r["symmetric"] is sym), key=lambda r: r["effective_bits"])
                if not pts:
                    continue
                xs = [r["effective_bits"] for r in pts]
                ys = [r[key] for r in pts]
                err = [[y - r[f"{key}_ci95"][0] for y, r in zip(ys, pts, strict=True)],
                       [r[f"{key}_ci95"][1] - y for y, r in zip(ys, pts, strict=True)]]
                color = REQUEST_PALETTE[j % len(REQUEST_PALETTE)]
                ax.errorbar(xs, ys, yerr=err, fmt="o-" if sym else "s", ms=4, capsize=2,
                            color=color, mfc=color if sym else "white",
                            label=f"g={g}" + ("" if sym else " zero-point"))
        if fp32 is not None and fp32[key] > 0:
            ax.axhline(fp32[key], color=MUTED, ls=":", lw=1)
        if key in ("ppl_ratio", "kl_nats"):
            ax.set_yscale("log")
        ax.set(xlabel="effective bits", title=label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
